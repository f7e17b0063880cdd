"""The cluster's placement, migration and drain logic in one process: real Cluster, Engine and Scheduler
objects drive FakeExecutors (which check that every step reads exactly the KV it wrote) through a stand-in
for the gRPC client. Fast and deterministic; the real processes are in test_scaleout.py. Tenant limits across
executors: test_cluster_tenants_unit.py."""

from __future__ import annotations

import asyncio

import pytest

from scheduler_svc import engine as engine_mod

# (the boxes fixture: tests/conftest.py)
from tests.support.fake_cluster import Box, FakeClient, collect, new_cluster, until, up_cluster
from tests.support.fake_executor import make_request

pytestmark = pytest.mark.unit


def test_executor_failure_moves_a_stream_with_no_token_lost_or_repeated(boxes):
    async def scenario():
        boxes.update({"a:1": Box(64), "b:1": Box(64)})
        c = await up_cluster({"a:1", "b:1"})
        boxes["a:1"].delay = boxes["b:1"].delay = 0.002
        req = make_request(1, 40, 60)
        c.add_request(req)
        first = next(a for a, e in c.engines.items() if req.request_id in e.scheduler.queues.requests)
        task = asyncio.create_task(collect(req))
        await until(lambda: len(req.output_ids) >= 20)
        boxes[first].alive = False
        tokens, error = await asyncio.wait_for(task, 5)
        other = c.engines[next(a for a in c.engines if a != first)]
        await until(lambda: other.scheduler.kv.pool.num_used == 0)
        other.check_integrity()
        await c.stop()
        return tokens, error, c.engines[first].info().num_migrated_out
    tokens, error, migrated = asyncio.run(scenario())
    assert error is None and len(tokens) == 60 and migrated == 1


def test_a_drained_executor_that_comes_back_serves_no_stale_prefix(boxes):
    """After a drain the scheduler forgets the executor's cached pages: a process restarted at the same
    address (same pool size, new executor id) holds none of them. (The FakeExecutor would fail the step
    that read stale KV.)"""
    async def scenario():
        boxes["a:1"] = Box(64)
        c = new_cluster(drain_timeout=0.2)
        c.start()
        c.set_addresses({"a:1"})
        await asyncio.wait_for(c.any_up.wait(), 2)
        engine = c.engines["a:1"]
        prompt = list(range(3, 67))
        first = make_request(1, 0, 4, prompt=prompt)
        c.add_request(first)
        assert (await collect(first))[1] is None
        boxes["a:1"].draining = True
        nudge = make_request(2, 20, 30)  # a step that reports the drain
        c.add_request(nudge)
        await until(lambda: engine.state is engine_mod.State.DOWN)
        boxes["a:1"].draining = False
        boxes["a:1"].restart()
        await until(lambda: engine.state is engine_mod.State.UP)
        again = make_request(3, 0, 4, prompt=prompt + [9])
        c.add_request(again)
        out = await asyncio.wait_for(collect(again), 3)
        nudge_out = await asyncio.wait_for(collect(nudge), 3)
        await c.stop()
        return out, again.num_cached_tokens, nudge_out
    (tokens, error), cached, (nudge_tokens, nudge_error) = asyncio.run(scenario())
    assert error is None and len(tokens) == 4 and cached == 0
    assert nudge_error is None and len(nudge_tokens) == 30  # waited for the executor to come back


def test_a_running_request_finishes_on_a_draining_executor_before_the_deadline(boxes):
    """Draining moves what waits at once, and lets what runs finish where it is (until --drain-timeout)."""
    async def scenario():
        boxes.update({"a:1": Box(64), "b:1": Box(64)})
        c = new_cluster(drain_timeout=60)
        c.start()
        c.set_addresses({"a:1"})
        await asyncio.wait_for(c.any_up.wait(), 2)
        c.set_addresses({"a:1", "b:1"})
        await until(lambda: "b:1" in c.engines and c.engines["b:1"].state is engine_mod.State.UP)
        boxes["a:1"].delay = 0.002
        running = make_request(1, 20, 40)
        c.add_request(running)
        engine = next(e for e in c.engines.values() if running.request_id in e.scheduler.queues.requests)
        task = asyncio.create_task(collect(running))
        await until(lambda: len(running.output_ids) >= 5)
        boxes[engine.address].draining = True
        tokens, error = await asyncio.wait_for(task, 5)
        await until(lambda: engine.state is engine_mod.State.DOWN)
        await c.stop()
        return tokens, error, engine.info().num_migrated_out
    tokens, error, migrated = asyncio.run(scenario())
    assert error is None and len(tokens) == 40 and migrated == 0


def test_a_moved_request_too_long_for_the_survivor_waits_then_ends_with_an_error(boxes):
    async def scenario():
        boxes.update({"a:1": Box(64), "b:1": Box(8)})  # b holds 128 tokens
        c = new_cluster(unplaced_timeout=0.5)
        c.start()
        c.set_addresses({"a:1"})
        await asyncio.wait_for(c.any_up.wait(), 2)
        c.set_addresses({"a:1", "b:1"})
        await until(lambda: c.engines["b:1"].state is engine_mod.State.UP)
        boxes["a:1"].delay = 0.002
        long = make_request(1, 100, 100)
        c.add_request(long)
        assert long.request_id in c.engines["a:1"].scheduler.queues.requests
        task = asyncio.create_task(collect(long))
        await until(lambda: len(long.output_ids) >= 40)  # 140 tokens: more than b holds
        boxes["a:1"].alive = False
        tokens, error = await asyncio.wait_for(task, 5)
        short = make_request(2, 10, 5)  # b still serves what fits
        c.add_request(short)
        short_out = await asyncio.wait_for(collect(short), 3)
        await c.stop()
        return tokens, error, short_out
    tokens, error, (short_tokens, short_error) = asyncio.run(scenario())
    assert error and "no executor that can hold this request" in error and len(tokens) >= 40
    assert short_error is None and len(short_tokens) == 5


def test_requests_moved_together_keep_their_order(boxes):
    async def scenario():
        boxes.update({"c:1": Box(64), "d:1": Box(64)})
        c = new_cluster()
        c.start()
        c.set_addresses({"c:1"})
        await asyncio.wait_for(c.any_up.wait(), 2)
        boxes["c:1"].delay = 10  # a long step keeps everything else queued on c
        reqs = [make_request(i, 40, 5) for i in range(1, 5)]
        for r in reqs:
            c.add_request(r)
        await asyncio.sleep(0.05)
        c.set_addresses({"c:1", "d:1"})
        await until(lambda: c.engines["d:1"].state is engine_mod.State.UP)
        c.engines["c:1"]._executor_lost("test")
        order = [r.request_id for r in c.engines["d:1"].scheduler.queues.waiting]
        await c.stop()
        return order
    assert asyncio.run(scenario()) == ["r1", "r2", "r3", "r4"]


def test_the_api_keeps_its_limits_while_no_executor_is_connected(boxes):
    async def scenario():
        boxes.update({"a:1": Box(64), "b:1": Box(64)})
        c = new_cluster(drain_timeout=0.1)
        c.start()
        c.set_addresses({"a:1"})
        await asyncio.wait_for(c.any_up.wait(), 2)
        boxes["b:1"].alive = False  # the replacement is still starting
        for _ in range(100):
            c.set_addresses({"b:1"})
            if "a:1" not in c.engines:
                break
            await asyncio.sleep(0.02)
        gone = "a:1" not in c.engines
        capacity, available = c.fit_limits("default").capacity, c.available
        await c.stop()
        return gone, capacity, available
    gone, capacity, available = asyncio.run(scenario())
    assert gone and capacity == 64 and not available


def test_stop_ends_the_engine_even_when_a_step_swallows_its_cancellation(boxes, monkeypatch):
    """Python 3.11's asyncio.wait_for can swallow a cancellation that lands as its inner await completes; the
    engine's loop then went on idling and a single cancel() never ended it: the scheduler's shutdown hung."""
    async def swallowing_step(self, plan):
        try:
            await asyncio.sleep(0.05)
        except asyncio.CancelledError:  # what wait_for does when the read completes as the cancel lands
            pass
        return self.box.executor.step(plan)

    async def scenario():
        boxes["a:1"] = Box(64)
        c = new_cluster()
        c.start()
        c.set_addresses({"a:1"})
        await asyncio.wait_for(c.any_up.wait(), 2)
        req = make_request(1, 20, 10_000)
        c.add_request(req)
        await until(lambda: len(req.output_ids) >= 3)
        await asyncio.wait_for(c.stop(), 10)
        return c.engines["a:1"]._task.done()

    monkeypatch.setattr(FakeClient, "step", swallowing_step)
    assert asyncio.run(scenario())


# ---- a request the executor keeps rejecting (found in review of async scheduling) ---------------------
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_request_the_executor_always_rejects_ends_with_the_error(boxes, monkeypatch, async_scheduling):
    """With async scheduling a rejection usually comes with the next plan in flight: the stream is dropped and the
    requests recomputed. Plans then go one at a time for a while, so the resend protocol's limit is reached and the
    refused request ends with the executor's error; before, it was recomputed forever and its stream never ended.
    The other request is untouched either way."""
    from pagedkv.executor.v1 import executor_pb2 as pb

    original = FakeClient.step

    async def step(self, plan):
        if any(n.request_id == "r99" for n in plan.new_requests):
            await asyncio.sleep(0.001)
            return pb.StepResult(step_id=plan.step_id, error="r99: token outside the vocabulary",
                                 desynced_request_ids=["r99"])
        return await original(self, plan)
    monkeypatch.setattr(FakeClient, "step", step)

    async def scenario():
        boxes["a:1"] = Box(64)
        c = await up_cluster({"a:1"}, async_scheduling=async_scheduling)
        boxes["a:1"].delay = 0.002
        good = make_request(1, 20, 40)
        c.add_request(good)
        t_good = asyncio.create_task(collect(good))
        await until(lambda: len(good.output_ids) >= 3)
        bad = make_request(99, 20, 5)
        c.add_request(bad)
        try:
            return await asyncio.wait_for(collect(bad), 10), await asyncio.wait_for(t_good, 10)
        finally:
            await c.stop()
    (_, bad_error), (good_tokens, good_error) = asyncio.run(scenario())
    assert bad_error and "rejected" in bad_error and "r99" in bad_error
    assert good_error is None and len(good_tokens) == 40


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_async_scheduling_sends_the_next_plan_before_reading_the_last_result(boxes, monkeypatch, async_scheduling):
    """The engine really overlaps: with async scheduling two plans are sent and unanswered at once; without, one."""
    most = {"in_flight": 0}
    original = FakeClient.send

    async def send(self, plan):
        await original(self, plan)
        most["in_flight"] = max(most["in_flight"], len(self.sent))
    monkeypatch.setattr(FakeClient, "send", send)

    async def scenario():
        boxes["a:1"] = Box(64)
        c = await up_cluster({"a:1"}, async_scheduling=async_scheduling)
        reqs = [make_request(i, 20, 30) for i in range(3)]
        for r in reqs:
            c.add_request(r)
        try:
            return [await asyncio.wait_for(collect(r), 10) for r in reqs]
        finally:
            await c.stop()
    outs = asyncio.run(scenario())
    assert all(err is None and len(tokens) == 30 for tokens, err in outs)
    assert most["in_flight"] == (2 if async_scheduling else 1)


def test_an_executor_speaking_another_protocol_version_is_refused_naming_both():
    """A scheduler and an executor of different pagedkv versions would misread each other's step messages (an
    executor from before packed samples sends them in a field this scheduler does not read: every stream would
    hang): the executor is refused, and the reason says which versions met."""
    from pagedkv.executor.v1 import executor_pb2 as pb
    from pagedkv.wire import EXECUTOR_PROTOCOL

    c = new_cluster()
    same = pb.DescribeResponse()
    same.CopyFrom(c.reference)
    assert c.check_compatible(same) == ""
    for other in (0, EXECUTOR_PROTOCOL + 1):
        same.protocol = other
        assert c.check_compatible(same).startswith(f"protocol {other} is not this scheduler's {EXECUTOR_PROTOCOL}")


@pytest.mark.parametrize("fault", ["row past the plan", "row twice", "lengths differ", "token past the vocabulary",
                                   "negative token"])
def test_a_malformed_result_is_a_lost_executor_and_no_token_is_lost_or_repeated(boxes, monkeypatch, fault):
    """A result whose samples name a row the plan does not have, name one row twice, hold a token outside the
    vocabulary, or whose packed lists differ in length is not applied (no request gets a token it was not sent):
    the executor is treated as lost, and its requests move on, each stream whole."""
    from tests.support import fake_executor

    monkeypatch.setattr(fake_executor, "SAMPLE", lambda rid, position: position)  # a repeat or a gap shows
    original = FakeClient.step
    spoiled = {"done": False}

    async def step(self, plan):
        result = await original(self, plan)
        if self.address == "a:1" and not spoiled["done"] and len(result.sampled_rows) >= 2 and plan.step_id > 12:
            spoiled["done"] = True
            if fault == "row past the plan":
                result.sampled_rows[-1] = len(plan.new_requests) + len(plan.continuing) + len(plan.decodes)
            elif fault == "row twice":
                result.sampled_rows[1] = result.sampled_rows[0]
            elif fault == "token past the vocabulary":  # (the executors' Describe: vocab_size 300)
                result.sampled_token_ids[1] = 300
            elif fault == "negative token":
                result.sampled_token_ids[0] = -1
            else:
                result.sampled_logprobs.append(0.0)
        return result
    monkeypatch.setattr(FakeClient, "step", step)

    async def scenario():
        boxes.update({"a:1": Box(64)})
        c = await up_cluster({"a:1"})
        boxes["a:1"].delay = 0.001
        reqs = [make_request(i, 20, 40) for i in range(3)]
        for r in reqs:
            c.add_request(r)
        boxes["b:1"] = Box(64)
        c.set_addresses({"a:1", "b:1"})
        try:
            return [await asyncio.wait_for(collect(r), 10) for r in reqs], c.engines["a:1"].info().num_migrated_out
        finally:
            await c.stop()
    outs, migrated = asyncio.run(scenario())
    assert spoiled["done"]
    assert all(err is None and tokens == list(range(21, 61)) for tokens, err in outs), outs
    assert migrated >= 1
