from __future__ import annotations

import torch

from executor_svc.sampler import SamplingParams, filter_logits, sample, sample_one


def test_greedy_is_argmax():
    logits = torch.randn(4, 50)
    tokens, _ = sample(logits, [SamplingParams()] * 4, [0] * 4)
    assert tokens == logits.argmax(-1).tolist()


def test_seed_stream_is_reproducible_and_independent_of_batch():
    logits = torch.randn(50)
    p = SamplingParams(temperature=1.0, seed=42)
    draws = [sample_one(logits, p, i) for i in range(20)]
    assert draws == [sample_one(logits, p, i) for i in range(20)]
    assert len(set(draws)) > 1  # draws differ along the stream
    batch = torch.randn(3, 50)
    batch[1] = logits
    tokens, _ = sample(batch, [SamplingParams(temperature=1.0, seed=s) for s in (1, 42, 3)], [5, 7, 9])
    assert tokens[1] == draws[7]


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.5, 0.3, 0.2, 0.0])
    logits = probs.log()
    p = SamplingParams(temperature=1.0, seed=7)
    counts = torch.bincount(torch.tensor([sample_one(logits, p, i) for i in range(3000)]), minlength=4)
    freq = counts.float() / counts.sum()
    assert counts[3] == 0
    assert torch.allclose(freq[:3], probs[:3], atol=0.04), freq


def test_top_k_and_top_p_filters():
    logits = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0])
    assert torch.isinf(filter_logits(logits, 2, 1.0)[2:]).all()
    assert not torch.isinf(filter_logits(logits, 2, 1.0)[:2]).any()
    probs = torch.softmax(logits, -1)  # ~[0.64, 0.24, 0.09, ...]
    kept = ~torch.isinf(filter_logits(logits, 0, 0.8))
    assert kept.tolist() == [True, True, False, False, False]
    assert probs[:1].sum() < 0.8 <= probs[:2].sum()
    p = SamplingParams(temperature=1.0, top_k=2, seed=1)
    assert {sample_one(logits, p, i) for i in range(200)} == {0, 1}


def test_logprobs_are_of_the_raw_distribution():
    logits = torch.randn(2, 30)
    tokens, lps = sample(logits, [SamplingParams(logprobs=True), SamplingParams()], [0, 0])
    assert abs(lps[0] - torch.log_softmax(logits[0], -1)[tokens[0]].item()) < 1e-6
    assert lps[1] == 0.0
