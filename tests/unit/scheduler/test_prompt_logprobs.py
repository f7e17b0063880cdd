"""Log-probabilities through the real planner and runner in one process (tiny-llama, tests/support/inprocess.py):
a request's prompt log-probabilities arrive once, whole, before its tokens, equal to one forward of the prompt,
whether its prompt was computed in chunks, moved to another executor halfway (recomputed: no entry twice) or
preempted; a request asking for them takes no prefix-cache hit while one that does not still hits its pages; a fork
parent (n > 1) computes them for its forks. Top log-probabilities go with every token, through the stream's
coalescing. Then the wire's checks of an executor's log-probability lists, the refusals of the public fields, and the
client's resume bookkeeping of the prompt message."""

from __future__ import annotations

import asyncio
from collections import deque

import pytest
import torch

from pagedkv.api.v1 import api_pb2 as api
from pagedkv.bounds import InvalidRequest
from pagedkv.executor.v1 import executor_pb2 as pb
from pagedkv.resumable_stream import StreamProgress
from scheduler_svc.logprobs import PromptLogprobs
from scheduler_svc.outputs import deliver
from scheduler_svc.request import Output, Request
from scheduler_svc.responses import prompt_message, response
from scheduler_svc.validation import Limits, check_sampling
from tests.support.fake_executor import add_sample, make_request
from tests.support.inprocess import InProcessServer

pytestmark = pytest.mark.unit

TOL = 1e-4  # fp32: the same model, other batch shapes (chunks, paged attention)


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    """prompt -> log_softmax of the model's logits at each of its positions, from one forward of the prompt."""
    from tests.unit.test_logprobs import _full_logprobs

    runner = InProcessServer(tiny_llama_dir, num_pages=32).runner
    return lambda prompt: _full_logprobs(runner, prompt)


def _prompt(seed: int, n: int) -> list[int]:
    return [1] + [3 + (seed * 31 + i * 17) % 250 for i in range(n - 1)]


def _request(i: int, prompt: list[int], max_tokens: int = 3, prompt_k: int | None = None, top: int = 0,
             **kw) -> Request:
    req = make_request(i, 0, max_tokens, prompt=prompt, **kw)
    req.sampling.ignore_eos = True
    req.sampling.logprobs, req.sampling.top_logprobs, req.sampling.prompt_logprobs = bool(top), top, prompt_k
    if prompt_k is not None:
        req.prompt_logprobs = PromptLogprobs(len(prompt), prompt_k)
    return req


def _run(server: InProcessServer) -> None:
    """Plans, runs and applies steps until nothing is left, two plans in flight (async scheduling, as the engine),
    every message delivered to its stream (outputs.deliver, as the engine)."""
    s, in_flight = server.scheduler, deque()
    while True:
        plan, outs = s.schedule()
        deliver(outs)
        if plan is None and not in_flight:
            if not s.has_work:
                return
            continue
        if plan is not None:
            in_flight.append(server.step(plan))
        if len(in_flight) > 1 or plan is None:
            deliver(s.process(in_flight.popleft()))
        s.check_integrity()


def _messages(req: Request) -> list[Output]:
    out = []
    while not req.outbox.empty():
        out.append(req.outbox.get_nowait())
    return out


def _check_prompt(msgs: list[Output], prompt: list[int], ref: torch.Tensor, k: int) -> None:
    """One prompt message, first, whole, equal to ``ref`` (its top k too)."""
    prompts = [m for m in msgs if m.prompt is not None]
    assert len(prompts) == 1 and msgs[0] is prompts[0] and not msgs[0].token_ids
    held = prompts[0].prompt
    assert held.complete and len(held.logprobs) == len(prompt) - 1
    want = [float(ref[t - 1][prompt[t]]) for t in range(1, len(prompt))]
    assert held.logprobs == pytest.approx(want, abs=TOL)
    ranks = [int((ref[t - 1] > ref[t - 1][prompt[t]]).sum()) + 1 for t in range(1, len(prompt))]
    assert sum(abs(a - b) for a, b in zip(held.ranks, ranks)) <= 2  # (a near-tie may swap two ranks)
    if k:
        top = [torch.topk(ref[t - 1], k) for t in range(1, len(prompt))]
        assert [list(ids) for ids, _ in held.top] == [t.indices.tolist() for t in top]
        for (_, values), t in zip(held.top, top):
            assert list(values) == pytest.approx(t.values.tolist(), abs=TOL)


def test_chunked_prompt_logprobs_come_once_before_the_tokens_and_skip_the_prefix_cache(tiny_llama_dir, reference):
    server = InProcessServer(tiny_llama_dir, num_pages=64, max_num_batched_tokens=16)
    prompt = _prompt(1, 45)
    first = _request(0, prompt)  # fills the prefix cache
    server.scheduler.add(first)
    _run(server)
    asking = _request(1, prompt, max_tokens=4, prompt_k=2, top=3)
    plain = _request(2, prompt)
    for r in (asking, plain):
        server.scheduler.add(r)
    _run(server)
    assert asking.num_cached_tokens == 0 and plain.num_cached_tokens == 32  # (its two full pages: a hit)
    msgs = _messages(asking)
    _check_prompt(msgs, prompt, reference(prompt), 2)
    tokens = [t for m in msgs for t in m.token_ids]
    tops = [t for m in msgs for t in m.top_logprobs]
    lps = [x for m in msgs for x in m.logprobs]
    assert len(tokens) == len(tops) == len(lps) == 4
    ref = reference(prompt + tokens[:-1])
    for j, (token, (ids, values), lp) in enumerate(zip(tokens, tops, lps)):
        row = ref[len(prompt) - 1 + j]
        assert lp == pytest.approx(float(row[token]), abs=TOL) and token == int(row.argmax())  # (greedy)
        assert list(ids) == torch.topk(row, 3).indices.tolist()
        assert list(values) == pytest.approx(torch.topk(row, 3).values.tolist(), abs=TOL)
    assert all(m.prompt is None for m in _messages(plain))


def test_a_request_moved_halfway_through_its_prompt_sends_each_entry_once(tiny_llama_dir, reference):
    """The executor is lost after two chunks (its requests go elsewhere: here, back to the same planner, their KV
    recomputed): the entries of the chunks computed twice are counted once."""
    server = InProcessServer(tiny_llama_dir, num_pages=64, max_num_batched_tokens=16)
    prompt = _prompt(2, 50)
    req = _request(0, prompt, max_tokens=2, prompt_k=1)
    s = server.scheduler
    s.add(req)
    for _ in range(2):
        plan, _ = s.schedule()
        s.process(server.step(plan))
    assert 0 < req.prompt_logprobs.missing < len(prompt) - 1
    moved, _ = s.evacuate()
    server.runner.reset()
    s.reconnected(kept=False)
    for r in moved:
        s.add(r, front=True)
    _run(server)
    _check_prompt(_messages(req), prompt, reference(prompt), 1)


def test_preempted_requests_send_their_prompt_logprobs_once(tiny_llama_dir, reference):
    server = InProcessServer(tiny_llama_dir, num_pages=9, max_num_seqs=4, max_num_batched_tokens=32)
    prompts = [_prompt(10 + i, 30 + 7 * i) for i in range(4)]
    reqs = [_request(i, p, max_tokens=24, prompt_k=0) for i, p in enumerate(prompts)]
    for r in reqs:
        server.scheduler.add(r)
    _run(server)
    assert sum(r.num_preemptions for r in reqs) > 0, "the pool was meant to be too small for all four"
    for r, p in zip(reqs, prompts):
        msgs = _messages(r)
        _check_prompt(msgs, p, reference(p), 0)
        assert sum(len(m.token_ids) for m in msgs) == 24


def test_a_fork_parent_computes_the_prompt_logprobs_of_its_forks(tiny_llama_dir, reference):
    server = InProcessServer(tiny_llama_dir, num_pages=64, max_num_batched_tokens=16)
    prompt = _prompt(3, 37)
    parent = _request(0, prompt, max_tokens=3, prompt_k=4, n=3)
    server.scheduler.add(parent)
    _run(server)
    msgs = _messages(parent)
    _check_prompt(msgs, prompt, reference(prompt), 4)
    assert msgs[0].index == 0 and sorted(m.index for m in msgs if m.finish is not None) == [0, 1, 2]


# ---- the wire, the API, the client ----------------------------------------------------------------
def _one_plan():
    from tests.support.scheduler_helpers import new_prefix_scheduler

    s = new_prefix_scheduler()
    asking = _request(0, list(range(3, 40)), prompt_k=2, top=2)
    plain = _request(1, list(range(3, 12)))
    s.add(asking)
    s.add(plain)
    plan, _ = s.schedule()
    assert plan.new_requests[0].sampling.prompt_logprobs and not plan.new_requests[1].sampling.prompt_logprobs
    assert plan.new_requests[0].sampling.prompt_top_logprobs == 2 and plan.new_requests[0].sampling.top_logprobs == 2
    return s, plan


def test_the_wire_refuses_log_probability_lists_that_are_not_the_plans():
    s, plan = _one_plan()

    def result(**prompt) -> pb.StepResult:
        r = pb.StepResult(step_id=plan.step_id)
        add_sample(r, 1, 7)
        if prompt:
            r.prompt_logprobs.add(**prompt)
        return r
    assert s.malformed(result()) == ""
    assert s.malformed(result(row=0, first_token=1, logprobs=[-1.0], top_token_ids=[3, 4],
                              top_logprobs=[-1.0, -2.0])) == ""
    bad = {"did not ask": dict(row=1, first_token=1, logprobs=[-1.0]),
           "are not in its prompt": dict(row=0, first_token=0, logprobs=[-1.0], top_token_ids=[3, 4],
                                         top_logprobs=[-1.0, -2.0]),
           "top entries for 1 tokens x 2": dict(row=0, first_token=5, logprobs=[-1.0], top_token_ids=[3],
                                                top_logprobs=[-1.0]),
           "outside the vocabulary": dict(row=0, first_token=5, logprobs=[-1.0], top_token_ids=[3, 9999],
                                          top_logprobs=[-1.0, -2.0])}
    for why, entry in bad.items():
        assert why in s.malformed(result(**entry), vocab_size=300)
    tops = result()
    tops.sampled_top_token_ids.extend([1, 2])  # row 1's request asked for none
    tops.sampled_top_logprobs.extend([-1.0, -2.0])
    assert "ask for 0" in s.malformed(tops)


def test_the_public_fields_are_refused_past_their_limits_naming_them():
    limits = Limits(max_model_len=64, vocab_size=300, max_logprobs=5)
    ok = check_sampling(api.SamplingParams(logprobs=True, top_logprobs=5, prompt_logprobs=0, echo=True), 4, limits)
    assert (ok.top_logprobs, ok.prompt_logprobs, ok.echo) == (5, 0, True)
    assert check_sampling(api.SamplingParams(), 4, limits).prompt_logprobs is None
    cases = {"sampling.top_logprobs: 6; must be in [0, 5] (--max-logprobs=5)": dict(logprobs=True, top_logprobs=6),
             "sampling.top_logprobs: -1; must be in [0, 5]": dict(logprobs=True, top_logprobs=-1),
             "sampling.top_logprobs: 2 needs sampling.logprobs": dict(top_logprobs=2),
             "sampling.prompt_logprobs: 9; must be in [0, 5] (--max-logprobs=5)": dict(prompt_logprobs=9),
             "sampling.prompt_logprobs: -1": dict(prompt_logprobs=-1)}
    for message, fields in cases.items():
        with pytest.raises(InvalidRequest, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")
                           .replace("]", r"\]")):
            check_sampling(api.SamplingParams(**fields), 4, limits)
    small = Limits(max_model_len=64, vocab_size=3, max_logprobs=20)
    with pytest.raises(InvalidRequest, match=r"must be in \[0, 3\] \(the vocabulary's size\)"):
        check_sampling(api.SamplingParams(logprobs=True, top_logprobs=4), 4, small)


def test_messages_carry_tops_and_the_prompt_and_the_client_resumes_without_them_again():
    out = Output("ab", [5, 6], [-0.5, -0.25], top_logprobs=[((5, 9), (-0.5, -1.0)), ((6, 2), (-0.25, -2.0))])
    msg = response("c", out)
    assert [list(t.token_ids) for t in msg.top_logprobs] == [[5, 9], [6, 2]]
    held = PromptLogprobs(3, 1)
    assert not held.add(2, [-3.0], [4], [-0.1]) and held.add(1, [-2.0, -9.0], [7, 8], [-0.2, -0.3])
    assert held.logprobs == [-2.0, -3.0] and held.top == [((7,), (-0.2,)), ((4,), (-0.1,))]  # (first values kept)
    first = response("c", Output("", [], [], prompt=held))
    assert list(first.prompt.logprobs) == [-2.0, -3.0] and list(first.prompt.top_logprobs[1].token_ids) == [4]
    sampling = api.SamplingParams(echo=True)
    assert prompt_message([1, 2, 3], sampling, False, "abc") == api.Prompt(num_tokens=3, token_ids=[1, 2, 3],
                                                                           text="abc")
    assert prompt_message([1, 2, 3], sampling, True, "abc") == api.Prompt(num_tokens=3)
    assert prompt_message([1, 2, 3], api.SamplingParams(), False, "abc") == api.Prompt(num_tokens=3)
    progress = StreamProgress(api.GenerateRequest(text="x", sampling=api.SamplingParams(echo=True, n=2)))
    progress.add(api.GenerateResponse(seed=5, prompt=api.Prompt(num_tokens=3)))
    assert not progress.received  # (the prompt's size alone: a plain resend would send nothing twice)
    progress.add(api.GenerateResponse(prompt=api.Prompt(num_tokens=3, token_ids=[1, 2, 3], text="abc")))
    again = progress.next_request()
    assert again.continuation.prompt_received and [list(f.token_ids) for f in again.continuation.forks] == [[], []]


def test_top_logprobs_stay_aligned_through_the_streams_coalescing():
    from scheduler_svc.request import Finish, Outbox

    box = Outbox()
    for i in range(3):
        box.token(0, "x", i, -1.0 * i, ((i,), (-1.0 * i,)))
    box.put_nowait(Output("y", [9], [-9.0], Finish.STOP, index=0, top_logprobs=[((9,), (-9.0,))]))
    (msg,) = asyncio.run(_drain(box))
    assert msg.token_ids == [0, 1, 2, 9] and [t[0] for t in msg.top_logprobs] == [(0,), (1,), (2,), (9,)]


async def _drain(box) -> list[Output]:
    out = []
    while not box.empty():
        out.append(await box.get())
    return out
