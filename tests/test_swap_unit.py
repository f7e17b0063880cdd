"""Swap, the host tier and the preemption policy at the scheduler level.

A FakeExecutor models page contents (tests/fake_executor.py): every step checks that each request reads
back exactly the KV it wrote, through swap-outs, swap-ins, spills and copies in the executor's order.
"""

from __future__ import annotations

import random

import pytest

from pagedkv.executor.v1 import executor_pb2 as pb
from scheduler_svc.pages import PagePool
from scheduler_svc.policy import Mode, PreemptionConfig, PreemptionCosts, PreemptionPolicy
from scheduler_svc.request import Finish, Status
from scheduler_svc.scheduler import Scheduler, SchedulerConfig
from tests.fake_executor import FakeExecutor, drive, make_request, scheduled

BS = 4
# PreemptionCosts that make swap clearly cheaper than recompute (as on the CPU: ~4 GB/s, ~70 us per token)
CHEAP_SWAP = PreemptionCosts(page_bytes=65536, swap_bytes_per_second=4e9, prefill_seconds_per_token=70e-6)


def new_scheduler(pages=16, host_pages=32, mode=Mode.SWAP, caching=True, budget=64, seqs=8, max_len=64,
                  hot=64, cold=512, max_wait=64, costs=CHEAP_SWAP, tenants=None, fair=True) -> Scheduler:
    cfg = SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=budget, max_model_len=max_len, watermark=0,
                          enable_prefix_caching=caching, fairness=fair,
                          preemption=PreemptionConfig(mode=mode, hot_steps=hot, cold_steps=cold,
                                                      swap_in_max_wait=max_wait))
    host = PagePool(host_pages, BS, min_pages=0) if host_pages else None
    return Scheduler(PagePool(pages, BS), cfg, [2], host_pool=host, costs=costs, tenants=tenants)


def assert_empty(s: Scheduler) -> None:
    s.check_integrity()
    assert s.pool.num_used == 0 and not s.requests
    if s.host is not None:
        assert s.host.num_used == 0


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


def test_swapped_request_finishes_under_a_steady_stream_of_new_prefills():
    """New prefills go first, but a swapped request waits at most swap_in_max_wait steps."""
    def run(max_wait: int):
        s = new_scheduler(pages=12, host_pages=24, budget=16, seqs=4, max_wait=max_wait, caching=False)
        long_req = make_request(0, 8, 20, prompt=[5] * 8, priority=1)  # the first victim whenever pages run out
        s.add(long_req)
        arrivals = iter(range(1, 10_000))
        stream_steps = 300
        finished_at = {}

        def feed(sched):
            if sched.step_id < stream_steps and len(sched.waiting) < 3:
                i = next(arrivals)
                sched.add(make_request(i, 6, 6, prompt=[(7 * i) % 250 + 3] * 6))
            if long_req.finish is not None and "long" not in finished_at:
                finished_at["long"] = sched.step_id

        drive(s, on_step=feed)
        assert_empty(s)
        return long_req, finished_at["long"]

    bounded, at = run(max_wait=8)
    assert bounded.num_preemptions > 0 and bounded.finish is Finish.LENGTH
    assert at < 300, f"the swapped request only finished at step {at}, after the stream of new work ended"
    starved, at_unbounded = run(max_wait=10**9)
    assert starved.num_preemptions > 0 and at_unbounded >= 300, "without the bound new work starves it"


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


def test_rejected_plan_resends_its_swaps_alone_and_first():
    s = new_scheduler(pages=9, hot=0, cold=0)
    reqs = [make_request(i, 12, 20, prompt=[40 + i] * 12) for i in range(3)]
    for r in reqs:
        s.add(r)
    ex = FakeExecutor(BS)
    plan, _ = s.schedule()
    s.process(ex.step(plan))
    plan, _ = s.schedule()
    assert plan.page_ops.swap_out
    ops = [(c.src, c.dst) for c in plan.page_ops.swap_out]
    s.process(pb.StepResult(step_id=plan.step_id, error="desync"))
    again, _ = s.schedule()
    assert [(c.src, c.dst) for c in again.page_ops.swap_out] == ops
    assert not again.new_requests and not again.continuing and not again.decodes
    s.check_integrity()
    s.process(ex.step(again))
    drive(s, executor=ex)
    assert_empty(s)


def test_abort_and_executor_failure_free_both_tiers():
    s = new_scheduler(pages=9, hot=0, cold=0)
    reqs = [make_request(i, 12, 20, prompt=[60 + i] * 12) for i in range(3)]
    for r in reqs:
        s.add(r)
    ex = FakeExecutor(BS)
    for _ in range(3):
        plan, _ = s.schedule()
        s.process(ex.step(plan))
    swapped = [r for r in reqs if r.status is Status.SWAPPED]
    assert swapped and s.host.num_used > 0
    s.abort(swapped[0].group)
    plan, outs = s.schedule()
    assert any(o.finish is Finish.ABORT for _, o in outs)
    s.check_integrity()
    outs = s.fail_all("executor gone")
    assert all(o.error for _, o in outs)
    assert_empty(s)
    assert s.host.num_cached == 0 and s.pool.num_cached == 0


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


def test_host_tier_keeps_tenants_apart():
    s = new_scheduler(pages=10, host_pages=20)
    prefix = list(range(30, 58))  # 7 pages
    s.add(make_request(0, 0, 2, prompt=prefix + [3], tenant="a"))
    drive(s)
    for i in range(1, 3):
        s.add(make_request(i, 0, 2, prompt=[100 + i] * 33, tenant="a"))
        drive(s)
    assert s.counters.spilled_pages >= 7
    other = make_request(8, 0, 2, prompt=prefix + [4], tenant="b")
    s.add(other)
    drive(s)
    assert other.num_cached_tokens == 0 and s.counters.spill_hits == 0
    same = make_request(9, 0, 2, prompt=prefix + [4], tenant="a")
    s.add(same)
    drive(s)
    # (b's own pages spilled meanwhile and pushed some of a's out of the host LRU)
    assert same.num_cached_tokens >= 16 and s.counters.spill_hits >= 4
    assert_empty(s)


def test_a_request_the_executor_keeps_rejecting_fails_alone():
    """Plans with swaps in them are rejected because of one request: its plans fail three times and it
    is aborted; the rejected page operations still run (resent alone) and nothing else fails."""
    from scheduler_svc.executor_session import MAX_PLAN_RETRIES

    s = new_scheduler(pages=9, hot=0, cold=0, seqs=4)
    reqs = [make_request(i, 12, 12, prompt=[80 + i] * 12) for i in range(4)]
    for r in reqs:
        s.add(r)
    ex = FakeExecutor(BS)
    bad = reqs[1].request_id
    rejected = 0
    for _ in range(500):
        plan, _ = s.schedule()
        if plan is None and not s.has_work:
            break
        ids = {rid for rid, _ in scheduled(plan)}
        if bad in ids:
            rejected += 1
            s.process(pb.StepResult(step_id=plan.step_id, error=f"{bad} is cursed", desynced_request_ids=[bad]))
        else:
            s.process(ex.step(plan))
        s.check_integrity()
    assert rejected == MAX_PLAN_RETRIES and reqs[1].finish is Finish.ABORT
    assert all(r.finish is Finish.LENGTH for r in reqs if r is not reqs[1])
    assert_empty(s)


def test_page_operations_rejected_again_and_again_end_the_executor_session():
    from scheduler_svc.executor_session import PlanLoopError

    s = new_scheduler(pages=9, hot=0, cold=0)
    for i in range(3):
        s.add(make_request(i, 12, 20, prompt=[90 + i] * 12))
    ex = FakeExecutor(BS)
    plan, _ = s.schedule()
    s.process(ex.step(plan))
    plan, _ = s.schedule()
    assert plan.page_ops.swap_out
    with pytest.raises(PlanLoopError):
        for _ in range(10):
            s.process(pb.StepResult(step_id=plan.step_id, error="bad page id"))
            plan, _ = s.schedule()
    s.fail_all("executor state lost")
    assert_empty(s)


def test_counters_survive_a_new_pool_geometry():
    s = new_scheduler(pages=9, hot=0, cold=0)
    for i in range(3):
        s.add(make_request(i, 12, 20, prompt=[70 + i] * 12))
    drive(s)
    swaps = (s.counters.pages_swapped_out, s.counters.pages_swapped_in)
    assert swaps[0] > 0
    s.fail_all("executor restarted")
    s.reset_pool(20, BS, num_host_pages=10, costs=CHEAP_SWAP)
    assert (s.counters.pages_swapped_out, s.counters.pages_swapped_in) == swaps and s.host.num_pages == 10


# ---- page budgets and attention windows ---------------------------------------------------------
def windowed(i: int, prompt_len: int, max_tokens: int, budget: int = 0, window: int = 0, sink: int = 0,
             overflow: str = "window", **kw):
    return make_request(i, prompt_len, max_tokens, prompt=[(7 * i + j) % 240 + 3 for j in range(prompt_len)],
                        page_budget=budget, window_tokens=window, sink_tokens=sink, overflow=overflow, **kw)


def test_window_budget_is_never_exceeded_and_keeps_the_sink():
    """Budget 5 pages of 4 tokens, sink one page: window (5 - 1 - 1) x 4 = 12 tokens. A 60-token prompt and
    40 outputs run in a pool that could hold it all; the request never holds more than 5 pages, its first
    page stays, and the executor is told which pages left."""
    s = new_scheduler(pages=64, host_pages=0, budget=64, max_len=200)
    req = windowed(0, 60, 40, budget=5, window=12, sink=4)
    s.add(req)
    ex = FakeExecutor(BS)
    first_page, peak, dropped = None, 0, 0
    while s.has_work:
        plan, _ = s.schedule()
        dropped += sum(len(c.dropped_page_indices) for c in plan.continuing)
        if req.page_table and first_page is None:
            first_page = req.page_table[0]
        if req.page_table:
            assert req.page_table[0] == first_page
        peak = max(peak, sum(1 for p in req.page_table if p != -1))
        s.process(ex.step(plan))  # KV read back only where the window lets the queries look
        s.check_integrity()  # asserts the budget too
    assert req.finish is Finish.LENGTH and len(req.output_ids) == 40
    assert peak == 5 and dropped == 25 - 5 and s.stats("default").budget_hits == 1
    assert_empty(s)


def test_stop_policy_ends_the_request_at_its_budget():
    s = new_scheduler(pages=64, host_pages=0)
    req = windowed(0, 10, 40, budget=4, overflow="stop")  # KV of 16 tokens fits: 10 prompt + 6 outputs,
    s.add(req)  # and the 7th output is sampled from them
    finished = drive(s)
    assert finished == [req] and req.finish is Finish.LENGTH and len(req.output_ids) == 7
    assert s.stats("default").budget_hits == 1
    assert_empty(s)


def test_sliding_window_frees_pages_as_it_goes():
    s = new_scheduler(pages=64, host_pages=0, max_len=200)
    req = windowed(0, 30, 50, window=8, sink=2)
    s.add(req)
    ex = FakeExecutor(BS)
    most = 0
    while s.has_work:
        plan, _ = s.schedule()
        most = max(most, sum(1 for p in req.page_table if p != -1))
        s.process(ex.step(plan))
        s.check_integrity()
    assert most <= 1 + 4 + -(-64 // BS) and s.pool.num_used == 0  # the first chunk is the prompt (8 pages)
    assert sum(1 for p in req.page_table if p != -1) == 0  # released at the end


@pytest.mark.parametrize("seed", range(4))
def test_windows_budgets_swaps_and_forks_together(seed):
    rng = random.Random(100 + seed)
    s = new_scheduler(pages=rng.choice([16, 24]), host_pages=rng.choice([0, 16, 32]), mode=Mode.AUTO,
                      budget=rng.choice([8, 16, 64]), seqs=rng.choice([3, 8]), hot=rng.choice([0, 2]))
    reqs = []
    for i in range(14):
        budget = rng.choice([0, 4, 6])
        sink = rng.choice([0, 4]) if budget else rng.choice([0, 3])
        sp = -(-sink // BS) if budget else 0
        window = (budget - max(sp, 1) - 1) * BS if budget else rng.choice([0, 6, 9])
        if budget and not sink:
            sink = BS
        req = windowed(i, rng.randint(2, 40), rng.randint(1, 30), budget=budget, window=window, sink=sink,
                       n=rng.choice([1, 1, 2]))
        reqs.append(req)
        s.add(req)
    drive(s)
    assert_empty(s)
