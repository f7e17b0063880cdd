from __future__ import annotations

import pytest
import torch

from executor_svc.sampler import SamplingParams, filter_logits, sample, sample_one

pytestmark = pytest.mark.unit


def test_greedy_is_argmax():
    logits = torch.randn(4, 50)
    tokens = sample(logits, [SamplingParams()] * 4, [0] * 4).tokens
    assert tokens == logits.argmax(-1).tolist()


def test_seed_stream_is_reproducible_and_independent_of_batch():
    logits = torch.randn(50)
    p = SamplingParams(temperature=1.0, seed=42)
    draws = [sample_one(logits, p, i) for i in range(20)]
    assert draws == [sample_one(logits, p, i) for i in range(20)]
    assert len(set(draws)) > 1  # draws differ along the stream
    batch = torch.randn(3, 50)
    batch[1] = logits
    tokens = sample(batch, [SamplingParams(temperature=1.0, seed=s) for s in (1, 42, 3)], [5, 7, 9]).tokens
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
    tokens, lps, _ = sample(logits, [SamplingParams(logprobs=True), SamplingParams()], [0, 0])
    assert abs(lps[0] - torch.log_softmax(logits[0], -1)[tokens[0]].item()) < 1e-6
    assert lps[1] == 0.0


# ---- the batched sampler against the one-row definition ----------------------------------------------
def _weights_in_vocab_order(scaled, top_k, top_p):
    from executor_svc.sampler import thresholds

    return torch.softmax(scaled.masked_fill(scaled < thresholds(scaled, top_k, top_p), float("-inf")), -1)


@pytest.mark.parametrize("candidates", [256, 8], ids=["candidates", "past-the-candidates"])
@pytest.mark.parametrize("ties", [False, True], ids=["fp32", "bf16-ties"])
def test_batched_filters_equal_filter_logits_row_by_row(monkeypatch, candidates, ties):
    """Every combination of top-k (off, small, past the vocabulary) and top-p (off, tight, loose) in one batch;
    with 8 candidates most top-p rows reach past them and are sorted whole. bf16-rounded logits tie often, also
    at the cuts (where every tied token is kept)."""
    from executor_svc import sampler

    monkeypatch.setattr(sampler, "CANDIDATES", candidates)
    g = torch.Generator().manual_seed(11)
    combos = [(k, p) for k in (0, 1, 5, 40, 500) for p in (1.0, 0.3, 0.9, 0.999)]
    combos = [c for c in combos if c != (0, 1.0) and c != (500, 1.0)]  # (every row here has a filter)
    scaled = torch.randn(len(combos), 300, generator=g) * torch.rand(len(combos), 1, generator=g) * 4
    if ties:
        scaled = scaled.bfloat16().float()
    got = _weights_in_vocab_order(scaled, [k for k, _ in combos], [p for _, p in combos])
    for row, (k, p) in enumerate(combos):
        want = torch.softmax(filter_logits(scaled[row], k, p), -1)
        torch.testing.assert_close(got[row], want, rtol=1e-5, atol=1e-6, msg=f"top_k={k} top_p={p}")


def test_filter_logits_keeps_every_token_tied_at_a_cut():
    logits = torch.tensor([3.0, 2.0, 2.0, 2.0, 1.0, 0.0])
    assert (~torch.isinf(filter_logits(logits, 2, 1.0))).tolist() == [True, True, True, True, False, False]
    probs = torch.softmax(logits, -1)  # [0.46, 0.17 x 3, ...]: 0.5 is reached inside the tied run
    assert probs[0] < 0.5 < probs[:2].sum()
    assert (~torch.isinf(filter_logits(logits, 0, 0.5))).tolist() == [True, True, True, True, False, False]


@pytest.mark.parametrize("ties", [False, True], ids=["fp32", "bf16-ties"])
def test_a_rows_token_does_not_depend_on_its_batch(monkeypatch, ties):
    """Alone or among greedy rows, unfiltered rows and rows whose filters widen the candidates (a large top-k),
    each row draws the same tokens from the same (seed, draw); with bf16-rounded logits (a bf16 model's), ties
    everywhere."""
    from executor_svc import sampler

    monkeypatch.setattr(sampler, "CANDIDATES", 16)
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(7, 2000, generator=g) * 3
    if ties:
        logits = logits.bfloat16().float()
    params = [SamplingParams(temperature=0.7, top_p=0.8, seed=1), SamplingParams(),
              SamplingParams(temperature=1.3, seed=2), SamplingParams(temperature=1.0, top_k=150, seed=3),
              SamplingParams(temperature=0.9, top_k=7, top_p=0.95, seed=4),
              SamplingParams(temperature=2.0, top_p=0.999, seed=5),  # (past 16 candidates: sorted whole)
              SamplingParams(temperature=1.0, top_k=50, seed=6)]
    for draw in range(30):
        together = sample(logits, params, [draw] * len(params)).tokens
        alone = [sample(logits[i:i + 1], [p], [draw])[0][0] for i, p in enumerate(params)]
        pairs = [sample(logits[[i, 3]], [p, params[3]], [draw, draw])[0][0] for i, p in enumerate(params)]
        assert together == alone == pairs, draw


def test_the_draw_never_lands_on_a_filtered_token():
    """u just below 1 (the float32 rounding of u x total reached the total and picked the last column): the
    last token with a weight is drawn, never one after it."""
    from executor_svc.sampler import _draw

    scaled = torch.tensor([[1.0, 2.0, -5.0, -5.0], [0.0, 0.0, 0.0, 0.0]])
    threshold = torch.tensor([[0.5], [float("-inf")]])
    for u in (1 - 2.0 ** -26, 1 - 2.0 ** -53, 0.0):
        at = _draw(scaled, threshold, torch.tensor([[u], [u]], dtype=torch.float64)).tolist()
        assert at == ([1, 3] if u else [0, 0]), (u, at)


def test_a_row_without_finite_logits_takes_its_argmax():
    logits = torch.tensor([[0.0, float("inf"), 1.0], [float("nan"), 2.0, 1.0], [float("-inf")] * 3])
    tokens = sample(logits, [SamplingParams(temperature=1.0, seed=1)] * 3, [0, 0, 0]).tokens
    assert tokens[0] == 1 and all(0 <= t < 3 for t in tokens)


def test_filtered_sampling_follows_the_filtered_distribution():
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -1.0])
    p = SamplingParams(temperature=1.0, top_k=4, top_p=0.8, seed=9)
    want = torch.softmax(filter_logits(logits, 4, 0.8), -1)
    counts = torch.bincount(torch.tensor([sample_one(logits, p, i) for i in range(4000)]), minlength=6)
    freq = counts.float() / counts.sum()
    assert counts[want == 0].sum() == 0
    assert torch.allclose(freq, want, atol=0.03), (freq, want)
