"""Where the first token's time goes (scheduler_svc/ttft_trace.py), through the real Generate handler, Cluster, Engine
and wire against FakeExecutors in one process: the parts of each request's breakdown add up to the time to first
token the handler measured (the same clock), a prompt longer than the chunk budget is spread over as many steps as
it has chunks, each chunk says what else its step ran, async scheduling's plan in flight ahead of the first chunk is
counted as a step, and the histograms count each request once. A chunk whose plan was lost is forgotten."""

from __future__ import annotations

import asyncio
import time

import pytest

from pagedkv.client import Client
from pagedkv.executor.v1 import executor_pb2 as pb
from scheduler_svc import metrics
from scheduler_svc.api import GenerationService
from scheduler_svc.plan_clock import StepClock
from scheduler_svc.validation import Limits
from tests.support.fake_cluster import Box, FakeClient, install_fake_clients, up_cluster
from tests.support.fake_executor import NullTokenizer, drive, make_request
from tests.support.fake_grpc import Context
from tests.support.recording_log import RecordingLog
from tests.support.scheduler_helpers import new_scheduler

pytestmark = pytest.mark.unit

BUDGET = 256  # new_cluster's max_num_batched_tokens
HISTOGRAMS = {"tokenize": metrics.REQUEST_TOKENIZE_SECONDS, "queue": metrics.REQUEST_QUEUE_SECONDS,
              "prefill": metrics.REQUEST_PREFILL_SECONDS, "steps": metrics.REQUEST_PREFILL_STEPS,
              "send": metrics.REQUEST_FIRST_TOKEN_SEND_SECONDS}


def _hist(h) -> tuple[float, float]:
    """(count, sum) of an unlabelled histogram."""
    samples = {s.name: s.value for m in h.collect() for s in m.samples}
    name = h._name
    return samples[f"{name}_count"], samples[f"{name}_sum"]


def _ttft_sum() -> float:
    return sum(s.value for m in metrics.TTFT_SECONDS.collect() for s in m.samples if s.name.endswith("_sum"))


async def _serve(async_scheduling: bool, prompt_len: int) -> tuple[list, float]:
    """A background request decoding while a prompt of ``prompt_len`` tokens arrives; the log lines, and the
    wall time the second client waited for its first message (perf_counter)."""
    FakeClient.boxes["a:1"] = Box(256)
    c = await up_cluster({"a:1"}, async_scheduling=async_scheduling)
    log = RecordingLog()
    limits = Limits(max_model_len=2048, vocab_size=300, max_prompt_bytes=100_000)
    service = GenerationService(c, NullTokenizer(), limits, {}, log)
    try:
        # (it decodes from here until it is cancelled: longer than the other request takes, however slow the machine)
        background = service.Generate(Client.build_request([1, 5, 6], max_tokens=2000, ignore_eos=True), Context())
        await background.__anext__()
        t0 = time.perf_counter()
        stream = service.Generate(Client.build_request([1] + [9] * (prompt_len - 1), max_tokens=2, ignore_eos=True),
                                  Context())
        await stream.__anext__()
        waited = time.perf_counter() - t0
        _ = [m async for m in stream]
        await background.aclose()  # (the client goes away: its pages are freed)
        return log.lines, waited
    finally:
        await c.stop()


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_breakdown_adds_up_and_counts_each_chunk_and_the_plan_ahead(monkeypatch, async_scheduling):
    install_fake_clients(monkeypatch)
    # (plans built as soon as the last went out, as before plan_clock.py: its hold may let the arrival join the
    # plan after the one in flight, with no plan ahead to count; tests/unit/test_plan_clock.py tests that)
    monkeypatch.setattr(StepClock, "hold", lambda *_: 0.0)
    before = {k: _hist(h) for k, h in HISTOGRAMS.items()}
    ttft_before = _ttft_sum()
    lines, waited = asyncio.run(_serve(async_scheduling, prompt_len=700))
    firsts = [f for e, f in lines if e == "request_first_token"]
    assert len(firsts) == 2  # one line per request
    b = firsts[1]  # the long prompt's
    parts = b["tokenize_s"] + b["prepare_s"] + b["queue_s"] + b["prefill_s"] + b["send_s"]
    assert parts == pytest.approx(b["ttft_s"], abs=1e-5)  # the parts add up, on the handler's own clock
    assert 0 < b["ttft_s"] <= waited
    assert all(b[k] >= 0 for k in ("tokenize_s", "prepare_s", "queue_s", "prefill_s", "behind_s", "send_s"))
    assert b["behind_s"] <= b["prefill_s"]
    # 700 tokens beside one decode row: 255 + 255 + 190, one chunk a step, each step with the decode beside it
    chunks = b["chunks"]
    assert [c[1] for c in chunks] == [BUDGET - 1, BUDGET - 1, 700 - 2 * (BUDGET - 1)]
    assert [c[2] for c in chunks] == [1, 1, 1] and [c[3] for c in chunks] == [0, 0, 0]
    assert [c[0] for c in chunks] == list(range(chunks[0][0], chunks[0][0] + 3))  # consecutive steps
    assert all(c[4] is not None and c[4] >= 0 for c in chunks)
    assert b["prefill_chunks"] == 3
    # async scheduling: the first chunk's plan waits behind the plan in flight, one step more before the token
    assert b["plans_ahead"] == (1 if async_scheduling else 0)
    assert b["prefill_steps"] == 3 + b["plans_ahead"]
    after = {k: _hist(h) for k, h in HISTOGRAMS.items()}
    assert all(after[k][0] - before[k][0] == 2 for k in HISTOGRAMS)  # each request once
    short = firsts[0]
    assert after["steps"][1] - before["steps"][1] == b["prefill_steps"] + short["prefill_steps"]
    assert after["queue"][1] - before["queue"][1] == pytest.approx(b["queue_s"] + short["queue_s"], abs=1e-5)
    assert _ttft_sum() - ttft_before == pytest.approx(b["ttft_s"] + short["ttft_s"], abs=1e-5)


def test_a_chunk_whose_plan_was_lost_is_forgotten():
    """A plan in flight when the executor went away ran nothing: its chunks leave the trace, which opens again
    for the recompute (otherwise its first token would be waited for on a step that never comes)."""
    s = new_scheduler(pages=64, budget=8, max_len=64)
    req = make_request(0, 20, 2)
    s.add(req)
    s.schedule()  # 8 tokens
    s.schedule()  # 8 more, with the first still unanswered
    assert [c.tokens for c in req.trace.chunks] == [8, 8] and req.trace.open
    moved, _ = s.evacuate()
    assert moved == [req] and req.trace.chunks == [] and req.trace.open
    s.reconnected()
    s.add(req, front=True)
    drive(s)
    assert req.output_ids and [c.tokens for c in req.trace.chunks] == [8, 8, 4]
    assert req.trace.first_token_at >= req.trace.chunks[-1].done_at > 0 and not req.trace.open
    assert req.trace.steps == 3


def test_a_chunk_of_a_rejected_plan_is_forgotten():
    """The executor rejected the plan (it ran nothing): the chunk leaves the trace and is planned again."""
    s = new_scheduler(pages=64, budget=64, max_len=64)
    req = make_request(0, 20, 2)
    s.add(req)
    plan, _ = s.schedule()
    assert [c.tokens for c in req.trace.chunks] == [20] and req.trace.sampling_step == plan.step_id
    s.process(pb.StepResult(step_id=plan.step_id, error="page table mismatch"))
    assert req.trace.chunks == [] and req.trace.open
    drive(s)
    assert [c.tokens for c in req.trace.chunks] == [20] and req.trace.first_token_at and req.trace.steps == 1
