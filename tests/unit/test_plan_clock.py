"""Just-in-time plan-ahead (scheduler_svc/plan_clock.py): the step-time model, and through the real Generate handler,
Cluster, Engine and wire against FakeExecutors whose steps take a fixed time: with async scheduling a request that
arrives while a step runs joins the plan after it (not the one after that) once the clock has learnt the step time;
a step that ends sooner than predicted has the next plan built after its result; the tokens are the same."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from pagedkv.client import Client
from scheduler_svc import metrics, plan_clock
from scheduler_svc.api import GenerationService
from scheduler_svc.plan_clock import MIN_SAMPLES, StepClock, step_features
from scheduler_svc.validation import Limits
from tests.support.fake_cluster import Box, FakeClient, install_fake_clients, up_cluster
from tests.support.fake_executor import NullTokenizer, make_request
from tests.support.fake_grpc import Context
from tests.support.recording_log import RecordingLog

pytestmark = pytest.mark.unit


def _count(metric) -> float:
    return next(s.value for m in metric.collect() for s in m.samples if s.name.endswith(("_count", "_total")))


def _features(tokens: int, rows: int, context: int) -> np.ndarray:
    reqs = [(make_request(i, context, 4), tokens // rows, False) for i in range(rows)]
    for req, _n, _ in reqs:
        req.num_computed = context
    return step_features(reqs)


def test_the_clock_learns_step_times_and_holds_until_just_before_the_end():
    clock = StepClock()
    rng = np.random.default_rng(0)

    def seconds(tokens, rows, context):  # a linear machine: fixed cost, per token, per row, per attention pair
        n = tokens // rows  # (each row's n tokens over ``context`` read n * (context - (n - 1) / 2) pairs)
        return 0.004 + 2e-5 * tokens + 1e-4 * rows + 3e-9 * tokens * (context - (n - 1) / 2)
    shapes = [(int(rng.integers(1, 2048)), int(rng.integers(1, 64)), int(rng.integers(16, 2048)))
              for _ in range(40)]
    feats = _features(*shapes[0])
    assert clock.predict(feats) is None and clock.hold(feats, 0.0, 0.0) == 0.0  # nothing seen: plan now
    for k, shape in enumerate(shapes):
        tokens, rows, _ = shape
        shape = (tokens - tokens % rows, rows, shape[2])
        clock.observe(_features(*shape), seconds(*shape), overhead=0.001)
        assert (clock.predict(_features(*shape)) is None) == (k + 1 < MIN_SAMPLES)
    for shape in [(1024, 8, 512), (64, 64, 1500), (2000, 1, 100)]:
        assert clock.predict(_features(*shape)) == pytest.approx(seconds(*shape), rel=0.02)
    assert clock.lead == pytest.approx(plan_clock.MIN_LEAD + 0.001, abs=1e-4)  # (no error left to cover)
    feats = _features(1024, 8, 512)
    end = 10.0 + seconds(1024, 8, 512)  # the step started at 10.0
    assert clock.hold(feats, 10.0, 10.0) == pytest.approx(end - clock.lead - 10.0, abs=1e-4)
    assert clock.hold(feats, 10.0, end) == 0.0  # past its time: plan now
    clock.observe(feats, seconds(1024, 8, 512) + 0.05, overhead=0.001)  # a slower step widens the lead
    assert clock.lead > plan_clock.MIN_LEAD + 0.001 + 2 * 0.1 * 0.04


async def _arrive_during_a_step(step_s: float, shorter_s: float | None = None) -> tuple[list, list[int], int]:
    """A background request decodes (steps of ``step_s``) until the clock predicts its steps; then a second request
    arrives while a step runs (inside the hold when there is one; else just after the plan ahead went out). Steps
    then take ``shorter_s`` when given. The log lines, the second request's tokens and the step running when it
    arrived."""
    box = FakeClient.boxes["a:1"] = Box(256)
    box.delay = step_s
    c = await up_cluster({"a:1"}, async_scheduling=True)
    log = RecordingLog()
    service = GenerationService(c, NullTokenizer(), Limits(max_model_len=2048, vocab_size=300), {}, log)
    holding = asyncio.Event()
    within = FakeClient.result_within

    async def result_within(self, timeout):
        holding.set()
        return await within(self, timeout)
    FakeClient.result_within = result_within
    try:
        background = service.Generate(Client.build_request([1, 5, 6], max_tokens=2000, ignore_eos=True), Context())
        for _ in range(MIN_SAMPLES + 4):
            await background.__anext__()
        engine = next(iter(c.engines.values()))
        assert engine.clock.predict(engine._stream.oldest.features) == pytest.approx(step_s, abs=0.02)
        holding.clear()
        if engine.clock.hold(engine._stream.oldest.features, 0.0, 0.0) > 0:
            await holding.wait()  # the engine holds the next plan now
        if shorter_s is not None:
            box.delay = shorter_s
        running = engine._stream.oldest.step_id
        stream = service.Generate(Client.build_request([1, 9, 9, 9], max_tokens=3, ignore_eos=True), Context())
        tokens = [t for m in [m async for m in stream] for t in m.token_ids]
        await background.aclose()
        return log.lines, tokens, running
    finally:
        FakeClient.result_within = within
        await c.stop()


def test_an_arrival_during_a_step_joins_the_next_plan(monkeypatch):
    install_fake_clients(monkeypatch)
    held = _count(metrics.PLAN_HOLD_SECONDS)
    lines, tokens, running = asyncio.run(_arrive_during_a_step(0.15))
    first = [f for e, f in lines if e == "request_first_token"][-1]
    assert first["chunks"][0][0] == running + 1  # planned into the step after the one running
    assert tokens == [7, 7, 7]
    assert _count(metrics.PLAN_HOLD_SECONDS) > held


def test_without_the_hold_an_arrival_waits_behind_the_plan_ahead(monkeypatch):
    """The same arrival with the next plan built as soon as the last went out (the hold off): one step more."""
    install_fake_clients(monkeypatch)
    monkeypatch.setattr(StepClock, "hold", lambda *_: 0.0)
    lines, tokens, running = asyncio.run(_arrive_during_a_step(0.15))
    first = [f for e, f in lines if e == "request_first_token"][-1]
    assert first["chunks"][0][0] == running + 2  # the step after the one running was planned before it came
    assert tokens == [7, 7, 7]


def test_a_step_shorter_than_predicted_has_the_next_plan_built_after_its_result(monkeypatch):
    install_fake_clients(monkeypatch)
    late = _count(metrics.PLANNED_AFTER_RESULT)
    lines, tokens, _ = asyncio.run(_arrive_during_a_step(0.3, shorter_s=0.01))
    assert _count(metrics.PLANNED_AFTER_RESULT) > late  # the result came before the hold's end
    assert tokens == [7, 7, 7]
    assert not [f for e, f in lines if e in ("engine_error", "executor_failed")]
