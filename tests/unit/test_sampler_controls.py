"""The sampler's logits controls against transformers' logits processors, on random logits, in batches that mix
rows with and without controls: repetition_penalty (RepetitionPenaltyLogitsProcessor, over prompt + output),
min_tokens (MinNewTokensLengthLogitsProcessor), logit_bias (SequenceBiasLogitsProcessor, one-token sequences), min_p
(MinPLogitsWarper, after temperature); frequency and presence penalties (transformers has none) by vLLM's formula,
over the output. Greedy rows take the reference's argmax; seeded rows draw what the reference logits draw. And the
mirror's token counts: a request resent in full gets the counts it had incrementally."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import (
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    NoBadWordsLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    SuppressTokensLogitsProcessor,
)

from executor_svc.plan_check import RequestMirror
from executor_svc.sampler import History, SamplingParams, adjust_logits, min_p_cut, sample
from pagedkv.executor.v1 import executor_pb2 as pb
from scheduler_svc.validation import bad_words_token_ids

pytestmark = pytest.mark.unit

VOCAB = 300


def reference_logits(logits: torch.Tensor, prompt: list[int], output: list[int], p: SamplingParams) -> torch.Tensor:
    """One row's logits [V] after its controls, by transformers' processors in vLLM's order."""
    ids = torch.tensor([prompt + output])
    scores = logits.view(1, -1).clone()
    procs = LogitsProcessorList()
    if p.allowed_token_ids:
        procs.append(SuppressTokensLogitsProcessor(sorted(set(range(scores.shape[-1])) - set(p.allowed_token_ids))))
    if p.bad_words:  # (vLLM's bad words look at the output only: the processor is given the output as its input)
        scores = NoBadWordsLogitsProcessor([list(w) for w in p.bad_words])(torch.tensor([output], dtype=torch.long),
                                                                          scores)
    if p.min_tokens and p.min_tokens_stop_ids:
        procs.append(MinNewTokensLengthLogitsProcessor(len(prompt), p.min_tokens, list(p.min_tokens_stop_ids)))
    if p.logit_bias:
        procs.append(SequenceBiasLogitsProcessor([[[t], v] for t, v in p.logit_bias]))
    if p.repetition_penalty != 1:
        procs.append(RepetitionPenaltyLogitsProcessor(p.repetition_penalty))
    scores = procs(ids, scores)
    counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=scores.shape[-1]).view(1, -1)
    scores = scores - p.frequency_penalty * counts.float()  # (vLLM's apply_penalties: frequency, then presence)
    scores = scores - p.presence_penalty * (counts > 0).float()
    return scores.view(-1)


def random_params(rng: random.Random, sampled: bool, output: list[int]) -> SamplingParams:
    kind = rng.choice(["none", "repetition", "frequency", "presence", "all", "min_tokens", "bias", "allowed",
                       "bad_words"])
    kw: dict = {}
    if kind in ("repetition", "all"):
        kw["repetition_penalty"] = rng.choice([0.5, 1.3, 1.9])
    if kind in ("frequency", "all"):
        kw["frequency_penalty"] = rng.uniform(-2, 2)
    if kind in ("presence", "all"):
        kw["presence_penalty"] = rng.uniform(-2, 2)
    if kind in ("min_tokens", "all"):
        kw["min_tokens"] = rng.randint(1, 12)
        kw["min_tokens_stop_ids"] = tuple(rng.sample(range(VOCAB), 3))
    if kind in ("bias", "all"):
        kw["logit_bias"] = tuple(sorted((t, rng.uniform(-100, 100)) for t in rng.sample(range(VOCAB), 5)))
    if kind in ("allowed", "all"):
        kw["allowed_token_ids"] = tuple(rng.sample(range(VOCAB), rng.randint(1, 60)))
    if kind in ("bad_words", "all"):  # one-token words, words the output ends with the start of, and others
        words = [(rng.randrange(VOCAB),), (rng.randrange(20), rng.randrange(20)), (1, 2, 3)]
        for k in (1, 2):
            if len(output) >= k:
                words.append((*output[-k:], rng.randrange(VOCAB)))
        kw["bad_words"] = tuple(words)
    if sampled:
        kw.update(temperature=rng.choice([0.5, 1.0, 1.5]), seed=rng.randrange(2**63),
                  top_k=rng.choice([0, 40]), top_p=rng.choice([1.0, 0.9]))
    return SamplingParams(**kw)


def random_batch(seed: int, rows: int, sampled: bool):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    logits = torch.randn(rows, VOCAB) * 3  # (never zeros: every sign, no ties at 0)
    histories = []
    for _ in range(rows):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 40))]
        output = [rng.randrange(20) for _ in range(rng.randint(0, 16))]  # (a few ids: repeats)
        histories.append((prompt, output))
    params = [random_params(rng, sampled, output) for _, output in histories]
    return logits, params, histories


def outputs_of(histories):
    def outputs(row: int, n: int) -> list[int]:
        output = histories[row][1]
        return output[len(output) - min(n, len(output)):]
    return outputs


def history_of(params, histories) -> History | None:
    """The penalised rows' tokens, as the mirror gives them: each token of prompt or output once, with its output
    count."""
    pen = [h for p, h in zip(params, histories) if p.penalised]
    if not pen:
        return None
    entries = [(r, t, output.count(t)) for r, (prompt, output) in enumerate(pen) for t in sorted({*prompt, *output})]
    rows, tokens, counts = zip(*entries)
    return History(torch.tensor(rows), torch.tensor(tokens), torch.tensor(counts, dtype=torch.int32))


@pytest.mark.parametrize("seed", range(6))
def test_controls_equal_transformers_processors_row_by_row(seed):
    logits, params, histories = random_batch(seed, 24, sampled=False)
    draws = [len(o) for _, o in histories]
    got = adjust_logits(logits, params, draws, history_of(params, histories), outputs_of(histories))
    for i, (p, (prompt, output)) in enumerate(zip(params, histories)):
        ref = reference_logits(logits[i], prompt, output, p)
        assert torch.allclose(got[i], ref, rtol=0, atol=1e-5), f"row {i}: {p}"
        assert torch.equal(torch.isinf(got[i]), torch.isinf(ref))
    assert any(p.adjusts for p in params) and any(not p.adjusts for p in params)  # (a mixed batch)
    assert any(torch.isinf(got[i]).any() and p.bad_words and not (p.allowed_token_ids or p.min_tokens)
               for i, p in enumerate(params))  # (a bad word was masked)


@pytest.mark.parametrize("seed", range(6))
def test_greedy_tokens_equal_the_reference_argmax(seed):
    logits, params, histories = random_batch(100 + seed, 32, sampled=False)
    draws = [len(o) for _, o in histories]
    tokens, logprobs, _ = sample(logits, [SamplingParams(**{**_fields(p), "logprobs": True}) for p in params], draws,
                              history_of(params, histories), outputs_of(histories))
    ref = [int(reference_logits(logits[i], *histories[i], p).argmax()) for i, p in enumerate(params)]
    assert tokens == ref
    assert tokens != logits.argmax(-1).tolist()  # (the controls changed some tokens: the test can fail)
    raw = torch.log_softmax(logits, -1)  # log-probabilities stay the model's
    assert logprobs == pytest.approx([float(raw[i, t]) for i, t in enumerate(tokens)], abs=1e-6)


def _fields(p: SamplingParams) -> dict:
    return {k: getattr(p, k) for k in ("temperature", "top_p", "top_k", "seed", "logprobs", "presence_penalty",
                                       "frequency_penalty", "repetition_penalty", "min_p", "min_tokens",
                                       "min_tokens_stop_ids", "logit_bias", "allowed_token_ids", "bad_words")}


def _plain(p: SamplingParams) -> SamplingParams:
    """The same sampling without the logits controls."""
    f = _fields(p)
    for k in ("presence_penalty", "frequency_penalty", "min_p", "min_tokens"):
        f[k] = 0
    return SamplingParams(**{**f, "repetition_penalty": 1.0, "min_tokens_stop_ids": (), "logit_bias": (),
                             "allowed_token_ids": (), "bad_words": ()})


@pytest.mark.parametrize("seed", range(6))
def test_seeded_tokens_equal_the_draws_on_the_reference_logits(seed):
    logits, params, histories = random_batch(200 + seed, 32, sampled=True)
    draws = [len(o) for _, o in histories]
    tokens = sample(logits, params, draws, history_of(params, histories), outputs_of(histories)).tokens
    ref_logits = torch.stack([reference_logits(logits[i], *histories[i], p) for i, p in enumerate(params)])
    ref = sample(ref_logits, [_plain(p) for p in params], draws).tokens
    assert tokens == ref
    plain = sample(logits, [_plain(p) for p in params], draws).tokens
    assert tokens != plain


def test_min_tokens_masks_until_reached_then_not():
    logits = torch.randn(1, VOCAB)
    eos = int(logits.argmax())
    p = SamplingParams(min_tokens=3, min_tokens_stop_ids=(eos,))
    assert [sample(logits, [p], [d])[0][0] == eos for d in range(5)] == [False, False, False, True, True]


@pytest.mark.parametrize("min_p", [0.01, 0.1, 0.5, 1.0])
def test_min_p_equals_transformers_min_p_warper(min_p):
    torch.manual_seed(7)
    logits = torch.randn(8, VOCAB) * 3
    temps = torch.tensor([0.5, 1.0, 1.5, 0.7, 1.0, 2.0, 0.3, 1.0]).view(-1, 1)
    scaled = logits / temps
    got = min_p_cut(scaled, [min_p] * 8)
    ref = MinPLogitsWarper(min_p)(torch.zeros(8, 1, dtype=torch.long), scaled.clone())
    assert torch.equal(got, ref)
    # seeded draws with min_p equal draws on the reference's cut (mixed with rows without it)
    params = [SamplingParams(temperature=float(t), seed=i, min_p=min_p if i % 2 else 0.0)
              for i, t in enumerate(temps.view(-1))]
    cut = torch.where(torch.tensor([i % 2 == 1 for i in range(8)]).view(-1, 1),
                      logits.masked_fill(torch.isinf(ref), float("-inf")), logits)
    for draw in range(10):
        assert sample(logits, params, [draw] * 8)[0] == sample(cut, [_plain(p) for p in params], [draw] * 8)[0]
    if min_p == 1.0:  # only the most probable token is left
        assert sample(logits, params, [3] * 8)[0][1::2] == logits.argmax(-1).tolist()[1::2]


def test_rows_without_controls_take_the_fast_path():
    logits = torch.randn(4, VOCAB)
    params = [SamplingParams(temperature=1.0, seed=1), SamplingParams(min_tokens=0, min_tokens_stop_ids=(3,))]
    assert adjust_logits(logits, params, [0, 0]) is logits  # not copied, not changed


# ---- the mirror's counts ------------------------------------------------------------------------
def _new(rid: str, tokens: list[int], num_output: int, **sampling) -> pb.NewRequest:
    first = 0 if rid == "a" else 8  # (8 pages of 4 tokens each: room for the decodes)
    return pb.NewRequest(request_id=rid, token_ids=tokens, num_computed_tokens=len(tokens) - 1,
                         num_scheduled_tokens=1, page_ids=list(range(first, first + 8)),
                         sampling=pb.SamplingParams(**sampling), num_output_tokens=num_output)


def test_counts_after_a_full_resend_equal_the_incremental_ones():
    mirror = RequestMirror(num_pages=64, num_host_pages=0, block_size=4, vocab_size=VOCAB, max_positions=None)
    rng = random.Random(3)
    prompt = [rng.randrange(VOCAB) for _ in range(9)]
    mirror.apply(pb.StepPlan(step_id=1, new_requests=[_new("a", prompt, 0, repetition_penalty=1.3),
                                                      _new("b", prompt[:5], 0, frequency_penalty=0.5)]))
    a, b = mirror.requests["a"], mirror.requests["b"]
    for _ in range(12):  # decode: count each sampled token as the runner does
        states = [a, b]
        mirror.penalty_history(states, VOCAB, torch.device("cpu"))
        tokens = [rng.randrange(10) for _ in states]
        mirror.count_samples(states, tokens)
        for st, t in zip(states, tokens):
            st.token_ids.append(t)
            st.num_output += 1
            st.num_computed = len(st.token_ids) - 1
    incremental = mirror.penalty_history([a, b], VOCAB, torch.device("cpu"))
    slots = (a.counts_slot, b.counts_slot)
    # the scheduler resends "a" in full (a plan refused, a resume, a migration): its counts come from the tokens
    mirror.apply(pb.StepPlan(step_id=2, new_requests=[_new("a", a.token_ids, a.num_output,
                                                           repetition_penalty=1.3)], decodes=["b"]))
    a2 = mirror.requests["a"]
    assert a2 is not a and a2.counts_slot < 0
    rebuilt = mirror.penalty_history([a2, b], VOCAB, torch.device("cpu"))
    assert all(torch.equal(x, y) for x, y in zip(rebuilt, incremental))
    assert a2.counts_slot == slots[0]  # (the old slot was released and reused)
    expected = history_of([a2.sampling, b.sampling], [(prompt, a2.token_ids[len(prompt):]),
                                                       (prompt[:5], b.token_ids[5:])])
    assert all(torch.equal(x, y) for x, y in zip(incremental, expected))
    assert int(incremental.output_counts[incremental.rows == 0].sum()) == 12
    mirror.apply(pb.StepPlan(step_id=3, forget=["a", "b"]))
    assert sorted(mirror.token_counts.free) == list(range(len(mirror.token_counts.counts)))


def test_bad_words_mask_after_their_prefix_only():
    logits = torch.randn(1, VOCAB)
    top = int(logits.argmax())
    p = SamplingParams(bad_words=((5, 6, top),))
    def run(output):
        return sample(logits, [p], [len(output)], outputs=lambda row, n: output[len(output) - min(n, len(output)):])
    assert run([5, 6])[0] != [top] and run([1, 5, 6])[0] != [top]
    assert run([6, 5])[0] == [top] and run([6])[0] == [top] and run([])[0] == [top]


def test_bad_words_token_ids_follow_vllms_rule():
    vocab = {"bad": [10], " bad": [11], "two words": [20, 21], " two words": [22, 21], "same": [30], " same": [30],
             "long": [40], " long": [41, 42]}
    assert bad_words_token_ids(["bad", "  two words", "same", "long"], vocab.__getitem__) == [
        [10], [11], [20, 21], [22, 21], [30], [40]]
