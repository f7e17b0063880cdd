"""Preemption, swap and the host tier at the scheduler level: victim order, swap vs recompute by cost, swapped
requests resume without recomputing, prefix pages spilled to the host come back.

A FakeExecutor models page contents (tests/support/fake_executor.py): every step checks that each request reads
back exactly the KV it wrote, through swap-outs, swap-ins, spills and copies in the executor's order.
"""

from __future__ import annotations

import random

import pytest

from scheduler_svc.pages import PagePool
from scheduler_svc.policy import Mode, PreemptionConfig, PreemptionCosts, PreemptionPolicy
from scheduler_svc.request import Finish, Status
from scheduler_svc.scheduler import SchedulerConfig
from tests.support.driven import driven
from tests.support.fake_executor import FakeExecutor, drive, make_request
from tests.support.scheduler_helpers import BS, CHEAP_SWAP, assert_empty, new_scheduler

pytestmark = pytest.mark.unit


def test_preemption_picks_the_newest_and_everything_still_finishes():
    pool = PagePool(num_pages=10, block_size=4)
    s = driven(pool, SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=40, watermark=0),
                  [2])
    reqs = [make_request(i, 6, 20) for i in range(4)]
    for r in reqs:
        s.add(r)
    finished = drive(s)
    assert len(finished) == 4 and s.counters.preemptions > 0
    assert reqs[0].num_preemptions == 0, "the oldest request is never the victim while newer ones run"
    assert pool.num_used == 0


@pytest.mark.parametrize("mode", [Mode.SWAP, Mode.AUTO, Mode.RECOMPUTE])
@pytest.mark.parametrize("caching", [True, False])
def test_overload_finishes_everything_with_contents_intact(mode, caching):
    rng = random.Random(3)
    s = new_scheduler(mode=mode, caching=caching)
    shared = [rng.randrange(3, 200) for _ in range(9)]
    reqs = []
    for i in range(12):
        prompt = (shared if i % 2 else []) + [rng.randrange(3, 200) for _ in range(rng.randint(1, 12))]
        reqs.append(make_request(i, 0, rng.randint(4, 30), prompt=prompt))
        s.add(reqs[-1])
    finished = drive(s)  # checks KV contents and both tiers' accounting after every step
    assert len(finished) == 12 and all(r.finish is Finish.LENGTH for r in finished)
    assert s.counters.preemptions > 0
    if mode is Mode.RECOMPUTE:
        assert s.counters.swap_preemptions == 0 and s.counters.pages_swapped_out == s.counters.spilled_pages
    else:
        assert s.counters.swap_preemptions > 0 and s.counters.pages_swapped_in > 0
    assert_empty(s)


def test_no_host_tier_means_recompute_only():
    s = new_scheduler(host_pages=0)
    for i in range(6):
        s.add(make_request(i, 10, 20))
    drive(s)
    assert s.counters.preemptions > 0 and s.counters.swap_preemptions == 0
    assert_empty(s)


def test_swap_resumes_without_recomputing():
    """A swapped request computes nothing again: total tokens computed equal those of an unconstrained run."""
    def total(pages, mode):
        s = new_scheduler(pages=pages, mode=mode, caching=False)
        for i in range(5):
            s.add(make_request(i, 11, 25, prompt=[10 + i] * 11))
        drive(s)
        assert_empty(s)
        return s.counters.computed_tokens, s.counters.swap_preemptions, s.counters.recompute_preemptions

    free_run, _, _ = total(200, Mode.SWAP)
    swapped, n_swap, n_rec = total(16, Mode.SWAP)
    recomputed, _, n_rec2 = total(16, Mode.RECOMPUTE)
    assert n_swap > 0 and n_rec == 0 and n_rec2 > 0
    assert swapped == free_run < recomputed


def test_cost_rule_picks_the_cheaper_way():
    policy = PreemptionPolicy(PreemptionConfig(mode=Mode.AUTO), CHEAP_SWAP)
    assert policy.should_swap(pages_to_copy=4, tokens_to_recompute=16)
    slow_copy = PreemptionCosts(page_bytes=65536, swap_bytes_per_second=1e6, prefill_seconds_per_token=1e-6)
    assert not PreemptionPolicy(PreemptionConfig(mode=Mode.AUTO), slow_copy).should_swap(4, 16)
    assert not policy.should_swap(pages_to_copy=None, tokens_to_recompute=10_000)  # no room on the host
    assert not PreemptionPolicy(PreemptionConfig(mode=Mode.RECOMPUTE), CHEAP_SWAP).should_swap(1, 10_000)
    assert PreemptionPolicy(PreemptionConfig(mode=Mode.SWAP), slow_copy).should_swap(4, 1)
    assert not policy.should_swap(pages_to_copy=4, tokens_to_recompute=0)  # all of it cached elsewhere


def test_victim_order_cold_then_priority_then_newest():
    policy = PreemptionPolicy(PreemptionConfig(hot_steps=64, cold_steps=512), CHEAP_SWAP)
    now = 1000
    hot_new = make_request(9, 4, 4, last_scheduled=now - 1)
    warm_old = make_request(1, 4, 4, last_scheduled=now - 100)
    cold_oldest = make_request(0, 4, 4, last_scheduled=now - 600)
    assert policy.pick_victim([hot_new, warm_old, cold_oldest], now) is cold_oldest
    assert policy.pick_victim([hot_new, warm_old], now) is warm_old
    hot_a = make_request(2, 4, 4, last_scheduled=now - 1, priority=5)
    hot_b = make_request(3, 4, 4, last_scheduled=now - 1)
    assert policy.pick_victim([hot_a, hot_b], now) is hot_a  # the highest priority value goes first
    assert policy.pick_victim([hot_b, hot_new], now) is hot_new  # then the newest


def test_a_cold_request_is_swapped_before_a_hot_one():
    """Three running requests; the oldest needs a page. The old rule took the newest (hot); now the cold
    one in the middle goes, and it is swapped."""
    s = new_scheduler(pages=9, hot=2, cold=4)
    a, b, c = (make_request(i, 12, 20, prompt=[20 + i] * 12) for i in range(3))  # 8 pages each at most
    for r in (a, b, c):
        s.add(r)
    ex = FakeExecutor(BS)
    plan, _ = s.schedule()
    s.process(ex.step(plan))
    assert [r.status for r in (a, b, c)] == [Status.RUNNING] * 3 and s.pool.num_free == 0
    b.last_scheduled -= 10  # b has not been scheduled for a while (say its tokens did not fit the budget)
    plan, _ = s.schedule()  # a needs a fourth page for its 13th token
    assert b.status is Status.SWAPPED and c.status is Status.RUNNING and a.status is Status.RUNNING
    assert [(op.src, op.dst) for op in plan.page_ops.swap_out] and b.request_id in plan.forget
    s.process(ex.step(plan))
    drive(s, executor=ex)
    assert all(r.finish is Finish.LENGTH for r in (a, b, c))
    assert_empty(s)


def test_spilled_prefix_comes_back_from_the_host():
    s = new_scheduler(pages=10, host_pages=20, mode=Mode.SWAP)
    prefix = list(range(30, 58))  # 7 pages
    first = make_request(0, 0, 2, prompt=prefix + [3])
    s.add(first)
    drive(s)
    assert s.pool.num_cached >= 7
    for i in range(1, 3):  # other prompts push the prefix out of the device tier
        s.add(make_request(i, 0, 2, prompt=[100 + i] * 33))
        drive(s)
    assert s.counters.spilled_pages >= 7 and all(s.pool.lookup(h) is None for h in first.page_hashes[:7])
    before = s.counters.computed_tokens
    again = make_request(9, 0, 2, prompt=prefix + [4])
    s.add(again)
    drive(s)
    assert s.counters.spill_hits == 7 and again.num_cached_tokens == 28
    assert s.counters.computed_tokens - before == 1 + 1  # the last prompt token and one decode
    assert_empty(s)


@pytest.mark.parametrize("seed", range(6))
def test_random_mix_of_forks_prefixes_aborts_and_swaps(seed):
    """Property test: whatever mix arrives, every request ends, KV contents stay exact, nothing leaks."""
    rng = random.Random(seed)
    s = new_scheduler(pages=rng.choice([12, 16, 24]), host_pages=rng.choice([4, 16, 32]), mode=Mode.AUTO,
                      budget=rng.choice([8, 16, 64]), seqs=rng.choice([3, 8]), hot=rng.choice([0, 2, 64]),
                      cold=64, max_wait=rng.choice([0, 4, 64]))
    prefixes = [[rng.randrange(3, 250) for _ in range(rng.randint(4, 14))] for _ in range(3)]
    reqs = []
    arrivals = iter(range(10_000))

    ticks = iter(range(10_000))

    def feed(sched):
        if next(ticks) < 150 and rng.random() < 0.3:
            i = next(arrivals)
            prompt = rng.choice(prefixes + [[]]) + [rng.randrange(3, 250) for _ in range(rng.randint(1, 8))]
            req = make_request(i, 0, rng.randint(1, 16), prompt=prompt, n=rng.choice([1, 1, 1, 2]),
                               tenant=rng.choice(["a", "b"]), priority=rng.choice([0, 0, 1]))
            reqs.append(req)
            sched.add(req)
        if sched.requests and rng.random() < 0.03:
            sched.abort(rng.choice(list(sched.requests.values())).group)

    drive(s, on_step=feed, feed_ticks=150)
    assert len(reqs) > 20
    assert all(r.status is Status.FINISHED or (r.n > 1 and r.compute_target == 0) for r in reqs)  # (forked at once)
    assert_empty(s)
