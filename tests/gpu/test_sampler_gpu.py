"""The batched sampler on a GPU (executor_svc/sampler.py): filters equal the one-row definition, a row's tokens
do not depend on its batch, and the tokens equal the CPU's for the same logits (a rare boundary case apart:
float32 sums differ between devices). Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from executor_svc.sampler import SamplingParams, filter_logits, sample, thresholds

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_filters_and_tokens_on_the_gpu_equal_the_cpu():
    g = torch.Generator().manual_seed(3)
    vocab = 32000  # a real vocabulary's size: top-k / top-p over a partial selection
    combos = [(0, 0.9), (50, 1.0), (50, 0.95), (1, 1.0), (0, 0.5), (0, 1.0)]
    logits = (torch.randn(len(combos), vocab, generator=g) * 4).bfloat16().float()  # (ties, as a bf16 model's)
    params = [SamplingParams(temperature=0.8, top_k=k, top_p=p, seed=i) for i, (k, p) in enumerate(combos)]
    filtered = [i for i, (k, p) in enumerate(combos) if k or p < 1.0]
    scaled = (logits[filtered] / 0.8).cuda()
    cut = thresholds(scaled, [combos[i][0] for i in filtered], [combos[i][1] for i in filtered])
    full = torch.softmax(scaled.masked_fill(scaled < cut, float("-inf")), -1).cpu()
    for row, i in enumerate(filtered):
        want = torch.softmax(filter_logits(logits[i] / 0.8, *combos[i]), -1)
        torch.testing.assert_close(full[row], want, rtol=1e-4, atol=1e-6)
    same = total = 0
    for draw in range(50):
        cpu = sample(logits, params, [draw] * len(params)).tokens
        gpu = sample(logits.cuda(), params, [draw] * len(params)).tokens
        alone = [sample(logits[i:i + 1].cuda(), [p], [draw])[0][0] for i, p in enumerate(params)]
        assert gpu == alone, draw
        same += sum(a == b for a, b in zip(cpu, gpu))
        total += len(cpu)
    assert same >= 0.98 * total, (same, total)
