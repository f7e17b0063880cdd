"""Riding on another request's prefill (scheduler_svc/rides.py): a burst of requests with a common prefix computes
the prefix once, and the followers' suffixes go in the same step as the prefix when the budget holds them, sharing
its pages before they are confirmed. The stand-in executor checks every position each request reads holds the KV of
its own tokens, with each step's K/V written before any row attends, as the model does layer by layer."""

from __future__ import annotations

import random

import pytest

from tests.support.fake_executor import FakeExecutor, drive, make_request, scheduled
from tests.support.scheduler_helpers import PREFIX_BS as BS
from tests.support.scheduler_helpers import new_prefix_scheduler as new_scheduler

pytestmark = pytest.mark.unit


def burst(s, n: int, prefix_len: int, suffix_len: int, max_tokens: int = 3, seed: int = 0, first: int = 0) -> list:
    """n requests with one prefix and suffixes of their own, added to ``s`` (when given)."""
    rng = random.Random(seed)
    prefix = [1] + [rng.randrange(3, 259) for _ in range(prefix_len - 1)]
    reqs = [make_request(first + i, 0, max_tokens, prompt=prefix + [3 + i] + [rng.randrange(3, 259)
                                                                             for _ in range(suffix_len - 1)])
            for i in range(n)]
    for r in reqs if s is not None else ():
        s.add(r)
    return reqs


def test_followers_share_the_prefix_their_owner_computes_in_the_same_step():
    s = new_scheduler(num_pages=64, budget=256)
    reqs = burst(s, 4, prefix_len=4 * BS, suffix_len=10)
    plan, _ = s.schedule()
    assert scheduled(plan) == [("r0", 4 * BS + 10), ("r1", 10), ("r2", 10), ("r3", 10)]  # the prefix once
    owner = reqs[0]
    for r in reqs[1:]:
        assert r.page_table[:4] == owner.page_table[:4] and r.num_cached_tokens == 4 * BS
    assert s.stream.oldest.rides  # (a rejection of this plan drops the stream: engine.py)
    assert s.pool.lookup(owner.page_hashes[0]) is None  # not published before the result
    executor = FakeExecutor(BS)
    s.process(executor.step(plan))
    assert [s.pool.lookup(h) for h in owner.page_hashes[:4]] == owner.page_table[:4]  # published by the owner
    drive(s, executor=executor)  # (contents checked: the followers read the prefix written in their step)
    assert [len(r.output_ids) for r in reqs] == [3] * 4
    assert s.counters.computed_tokens == 4 * BS + 4 * 10 + 4 * 2
    assert s.pool.num_used == 0


def test_without_rides_the_followers_wait_a_step():
    s = new_scheduler(num_pages=64, budget=256)
    burst(s, 4, prefix_len=4 * BS, suffix_len=10)
    plan, _ = s.stream.next_plan(rides=False)  # (the engine's, while plans go one at a time after a rejection)
    assert scheduled(plan) == [("r0", 4 * BS + 10)]
    assert not s.stream.oldest.rides


def test_a_follower_rides_only_the_pages_planned_whole_and_then_waits():
    """The owner's prompt is chunked (53 tokens a step): a follower could take the 3 pages planned so far, but the
    next is the owner's to compute: it waits; the step after, it rides all 6 beside the owner's next chunk (a new
    row reading pages a continuing row writes in the same step)."""
    s = new_scheduler(num_pages=64, budget=53)
    reqs = burst(s, 2, prefix_len=6 * BS, suffix_len=5, max_tokens=2)
    executor = FakeExecutor(BS)
    plan, _ = s.schedule()
    assert scheduled(plan) == [("r0", 53)]
    assert s.kv.find_hits(reqs[1]) and s.kv.waits_for_inflight(reqs[1], len(s.kv.find_hits(reqs[1])))
    s.process(executor.step(plan))
    plan, _ = s.schedule()
    assert scheduled(plan) == [("r1", 5), ("r0", 48)]  # (new rows first) all 6 prefix pages: 3 confirmed, 3 riding
    assert reqs[1].page_table[:6] == reqs[0].page_table[:6] and s.stream.oldest.rides
    s.process(executor.step(plan))
    drive(s, executor=executor)
    assert [len(r.output_ids) for r in reqs] == [2, 2]
    assert s.pool.num_used == 0


@pytest.mark.parametrize("seed", range(4))
def test_random_bursts_with_aborts_keep_every_page_accounted(seed):
    """Bursts of several prefixes, budgets that chunk them, an owner aborted while its followers ride its pages:
    the contents each request reads are its own tokens' and every page comes back."""
    rng = random.Random(seed)
    s = new_scheduler(num_pages=400, budget=rng.choice([32, 64, 200]))
    reqs = []
    for k in range(3):
        reqs += burst(s, rng.randint(2, 6), prefix_len=rng.randint(1, 5) * BS + rng.randint(0, 15),
                      suffix_len=rng.randint(1, 20), max_tokens=rng.randint(1, 6), seed=100 * seed + k,
                      first=len(reqs))
    doomed = reqs[0]

    def on_step(sched):
        if doomed.page_table and not doomed.aborted:
            sched.abort(doomed.group)
    rode = _count_rides(s)
    drive(s, on_step=on_step)
    assert all(len(r.output_ids) == r.sampling.max_tokens for r in reqs if r is not doomed)
    assert s.pool.num_used == 0
    assert rode, "some follower should have ridden its owner's pages in these bursts"


def _count_rides(s) -> list:
    """The plans ``s``'s scheduler builds from now on that carry riders (Step.rides): their step ids, gathered in
    the returned list."""
    rode, plan = [], s.scheduler.plan

    def counted(*args, **kwargs):
        step, outs = plan(*args, **kwargs)
        if step is not None and step.rides:
            rode.append(step.step_id)
        return step, outs
    s.scheduler.plan = counted
    return rode


def test_a_rejected_plan_with_riders_drops_the_stream_and_every_request_is_recomputed(boxes, monkeypatch):
    """Its followers counted the prefix pages it was to write as computed: the requests are recomputed, as for a
    lost stream (one plan in flight here: without riders the plan would be resent in full instead). Plans then go
    one at a time, without rides, and every stream ends whole."""
    import asyncio

    from pagedkv.executor.v1 import executor_pb2 as pb
    from tests.support.fake_cluster import FakeClient, collect, up_cluster

    original, connect = FakeClient.step, FakeClient.connect
    seen = {"rejected": 0, "connects": 0}

    async def step(self, plan):
        if len(plan.new_requests) > 1 and not seen["rejected"]:
            seen["rejected"] += 1
            return pb.StepResult(step_id=plan.step_id, error="refused once")
        return await original(self, plan)

    async def counting_connect(self, timeout):
        seen["connects"] += 1
        return await connect(self, timeout)
    monkeypatch.setattr(FakeClient, "step", step)
    monkeypatch.setattr(FakeClient, "connect", counting_connect)

    async def scenario():
        from tests.support.fake_cluster import Box

        boxes["a:1"] = Box(64)
        c = await up_cluster({"a:1"}, async_scheduling=False)
        reqs = burst(None, 4, prefix_len=2 * 16, suffix_len=6, max_tokens=5)
        for r in reqs:
            c.add_request(r)
        try:
            return [await asyncio.wait_for(collect(r), 10) for r in reqs]
        finally:
            await c.stop()
    outs = asyncio.run(scenario())
    assert seen["rejected"] == 1 and seen["connects"] == 2  # the stream was dropped and opened again
    assert [(len(tokens), error) for tokens, error in outs] == [(5, None)] * 4
