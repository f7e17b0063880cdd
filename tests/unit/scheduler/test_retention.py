"""Retained KV (GenerateRequest.retain_kv, scheduler_svc/retention.py) at the planner: a stand-in executor that checks
every read of KV, a clock the test moves."""

from __future__ import annotations

import pytest

from pagedkv.tenancy import Tenant, Tenants
from scheduler_svc.fit import shape
from scheduler_svc.pages import PagePool
from scheduler_svc.prefix_cache import tenant_root
from scheduler_svc.request import Finish, Retain
from scheduler_svc.scheduler import SchedulerConfig
from tests.support.driven import Driven, driven
from tests.support.fake_executor import FakeExecutor, drive, make_request

pytestmark = pytest.mark.unit

BS = 4


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def new(pages: int = 32, share: float = 0.5, tenants: Tenants | None = None, seqs: int = 8) -> tuple[Driven, Clock]:
    cfg = SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=256, max_model_len=256, watermark=0,
                          kv_retention_max_share=share)
    s = driven(PagePool(pages, BS), cfg, [2], tenants=tenants)
    clock = Clock()
    s.retained.clock = clock
    return s, clock


def run(s: Driven, i: int, prompt: list[int], tenant: str = "default", max_tokens: int = 3, key: str = "",
        ttl: int = 60):
    req = make_request(i, 0, max_tokens, prompt=prompt, tenant=tenant, retain=Retain(key, ttl) if key else None)
    s.add(req)
    drive(s)
    return req


def prompt_of(n: int, seed: int = 0) -> list[int]:
    return [10 + (seed * 31 + i) % 200 for i in range(n)]


def churn(s: Driven, first: int, count: int, tenant: str = "default") -> None:
    """Other conversations, each a few pages: the free cached pages are all handed out again."""
    for j in range(count):
        run(s, first + j, prompt_of(4 * BS + 1, seed=100 + first + j), tenant)


def test_retained_conversation_survives_churn_and_the_follow_up_hits_it():
    s, _ = new(pages=24)
    first = run(s, 0, prompt_of(17), key="conv")  # 17 + 3 tokens: 5 full pages, the 20th token is not computed
    kept = s.retained.get("default", "conv")
    assert kept is not None and len(kept.pages) == 4  # 19 tokens computed: 4 full pages
    assert s.pool.num_used == 4 and s.snapshot(tenants=True).tenants["default"].used_pages == 4
    churn(s, 1, 6)
    follow = run(s, 10, first.prompt_ids + first.output_ids + prompt_of(6, seed=9))
    assert follow.num_cached_tokens == 16


def test_without_retain_kv_the_same_churn_evicts_the_conversation():
    s, _ = new(pages=24)
    first = run(s, 0, prompt_of(17))
    assert s.pool.num_used == 0
    churn(s, 1, 6)
    follow = run(s, 10, first.prompt_ids + first.output_ids + prompt_of(6, seed=9))
    assert follow.num_cached_tokens == 0


def test_ttl_ends_the_retention_and_the_next_plan_zeroes_its_pages():
    s, clock = new()
    ex = FakeExecutor(BS)
    req = make_request(0, 0, 3, prompt=prompt_of(13), retain=Retain("k", 30))
    s.add(req)
    drive(s, executor=ex)
    pages = list(s.retained.get("default", "k").pages)
    clock.now += 29
    assert s.schedule()[0] is None and s.retained.get("default", "k") is not None
    clock.now += 1
    plan, _ = s.schedule()
    assert plan is not None and sorted(plan.page_ops.zero) == sorted(pages)
    s.process(ex.step(plan))
    assert s.pool.num_used == 0 and not s.retained
    assert all(s.pool.hash_of(p) is None for p in pages)  # not findable: a hit would read zeros
    assert set(list(s.pool.free_queue)[: len(pages)]) == set(pages)  # (and first to be handed out again)
    again = run(s, 1, prompt_of(13))
    assert again.num_cached_tokens == 0
    s.check_integrity()


def test_release_is_per_tenant_and_another_tenant_neither_hits_nor_releases():
    tenants = Tenants([Tenant("a"), Tenant("b")])
    s, _ = new(tenants=tenants)
    first = run(s, 0, prompt_of(17), tenant="a", key="conv")
    follow = first.prompt_ids + first.output_ids
    assert run(s, 1, follow, tenant="b").num_cached_tokens == 0
    assert s.retained.end("b", "conv") is None  # (ReleaseKv answers NOT_FOUND)
    assert run(s, 2, follow, tenant="a").num_cached_tokens == 16
    assert s.retained.end("a", "conv") == 4
    plan, _ = s.schedule()
    assert len(plan.page_ops.zero) == 4
    assert s.retained.end("a", "conv") is None


def test_a_running_request_keeps_the_pages_it_shares_when_the_retention_ends():
    s, _ = new()
    ex = FakeExecutor(BS)
    first = make_request(0, 0, 3, prompt=prompt_of(17), retain=Retain("conv", 60))
    s.add(first)
    drive(s, executor=ex)
    follow = make_request(1, 0, 8, prompt=first.prompt_ids + first.output_ids + [5])
    s.add(follow)
    plan, _ = s.schedule()  # the follow-up holds the retained pages now
    assert s.retained.end("default", "conv") == 0  # nothing went back: the follow-up holds them all
    s.process(ex.step(plan))
    drive(s, executor=ex)  # the executor checks every read: nothing it reads was zeroed
    assert follow.num_cached_tokens == 16 and len(follow.output_ids) == 8


def test_retained_pages_count_against_the_quota_and_make_room_for_their_own_tenant():
    tenants = Tenants([Tenant("a", page_quota=10), Tenant("b")])
    s, _ = new(pages=40, share=1.0, tenants=tenants)
    run(s, 0, prompt_of(17), tenant="a", key="one")  # 4 pages
    run(s, 1, prompt_of(17, seed=1), tenant="a", key="two")  # 4 more: 8 of a's 10
    assert s.pool.used_by["a"] == 8 and s.retained.pages_of("a") == 8
    big = run(s, 2, prompt_of(21, seed=2), tenant="a")  # needs 6 pages: its tenant's oldest retention goes
    assert big.finish is Finish.LENGTH and not big.num_preemptions
    assert s.retained.get("a", "one") is None and s.retained.get("a", "two") is not None


def test_the_cap_drops_the_tenants_oldest_retention_then_the_tail():
    s, _ = new(pages=20, share=0.5)  # at most 10 retained pages
    run(s, 0, prompt_of(17), key="one")  # 4
    run(s, 1, prompt_of(17, seed=1), key="two")  # 8
    run(s, 2, prompt_of(17, seed=2), key="three")  # 12 > 10: "one" goes
    assert [r.key for r in s.retained] == ["two", "three"] and s.retained.pages_of("default") == 8
    run(s, 3, prompt_of(46, seed=3), key="long")  # 12 pages alone: the others go, then its tail
    assert [r.key for r in s.retained] == ["long"] and len(s.retained.get("default", "long").pages) == 10
    s, _ = new(share=0.0)  # no share: nothing is kept
    run(s, 0, prompt_of(17), key="one")
    assert not s.retained and s.pool.num_used == 0


def test_under_pressure_free_cached_pages_go_first_then_retained_then_running_requests():
    s, _ = new(pages=12, share=1.0)
    run(s, 0, prompt_of(17), key="conv")  # 4 retained, 8 free
    run(s, 1, prompt_of(9, seed=1), max_tokens=2)  # 2 free cached pages now
    assert s.pool.num_cached == 6
    running = make_request(2, 0, 4, prompt=prompt_of(27, seed=2))  # 8 pages at its end: only the free ones
    s.add(running)
    drive(s)
    assert s.retained.get("default", "conv") is not None and not running.num_preemptions
    a = make_request(3, 0, 13, prompt=prompt_of(19, seed=3))  # 8 pages at its end
    b = make_request(4, 0, 9, prompt=prompt_of(7, seed=4))  # 4 pages at its end: both fit only without the retention
    s.add(a)
    s.add(b)
    drive(s)
    assert s.retained.get("default", "conv") is None
    assert a.num_preemptions == 0 and b.num_preemptions == 0 and s.counters.preemptions == 0


def test_a_second_retention_with_the_same_key_replaces_the_first():
    s, _ = new()
    first = run(s, 0, prompt_of(17), key="k")
    old = set(s.retained.get("default", "k").pages)
    second = run(s, 1, first.prompt_ids + first.output_ids + prompt_of(9, seed=5), key="k")
    assert second.num_cached_tokens == 16
    kept = s.retained.get("default", "k")
    assert len(s.retained) == 1 and old <= set(kept.pages) and len(kept.pages) == 7
    s.check_integrity()


def test_aborted_requests_and_errors_keep_nothing():
    s, _ = new()
    req = make_request(0, 0, 50, prompt=prompt_of(17), retain=Retain("k", 60))
    s.add(req)
    s.schedule()
    s.abort(req.group)
    drive(s)
    assert not s.retained and s.pool.num_used == 0


def test_each_retention_ends_at_its_own_ttl_also_after_another_was_released():
    s, clock = new()
    run(s, 0, prompt_of(13), key="short", ttl=10)
    run(s, 1, prompt_of(13, seed=1), key="long", ttl=100)
    run(s, 2, prompt_of(13, seed=2), key="mid", ttl=50)
    assert s.retained.end("default", "short") == 3
    assert s.kv_expiry_due(clock.now + 10)  # (a lower bound: the wake finds nothing to end, and moves on)
    clock.now += 49
    assert s.retained.expire() == 0 and len(s.retained) == 2
    clock.now += 1
    assert s.retained.expire() == 1 and [r.key for r in s.retained] == ["long"]
    assert not s.kv_expiry_due(clock.now + 49) and s.kv_expiry_due(clock.now + 50)
    drive(s)
    s.check_integrity()



def test_a_windowed_request_retains_only_the_pages_it_still_holds():
    # Its window drops its first pages, which stay findable while free: taking them back as it ends would grow its
    # tenant past the quota (found by the stateful page-accounting test with PAGEDKV_ADVERSARIAL=long).
    tenant = Tenant("a", page_quota=4, page_budget=3, overflow="window")
    s, _ = new(pages=40, share=1.0, tenants=Tenants([tenant]))
    shaped = shape(tenant, 9, 0, s.fit_limits("a"), 256)
    req = make_request(0, 0, 14, prompt=prompt_of(9), tenant="a", retain=Retain("k", 60), overflow="window",
                       page_budget=shaped.page_budget, sink_tokens=shaped.sink, window_tokens=shaped.window,
                       hash_root=tenant_root(f"a\x00window:{shaped.sink}:{shaped.window}"))
    s.add(req)
    seen = {"peak": 0, "table": []}

    def watch(s: Driven) -> None:
        seen["peak"] = max(seen["peak"], s.pool.used_by["a"])
        seen["table"] = list(req.page_table) or seen["table"]

    drive(s, on_step=watch)
    assert req.finish is Finish.LENGTH and req.budget_hit and -1 in seen["table"]  # (the window dropped pages)
    kept = s.retained.get("a", "k")
    assert kept is None or kept.pages == seen["table"][:len(kept.pages)]  # a prefix of what it held, none dropped
    assert s.pool.used_by["a"] <= 3 and seen["peak"] <= 3
