"""Scheduler bugs the page-accounting state machine found, as fixed scenarios.

Two livelocks (they need a rare mix: a
request with a page budget and a window, which takes at most budget - 1 pages from the prefix cache, so a
recompute-preempted one starts over each time; and fair share making room for another tenant).

1. A victim that fair order re-admits first: preempted for a seat, it was re-admitted at once (ahead of the
   request the seat was for), computed one chunk, and was preempted again, step after step.
2. Preemption that could not make enough room (another tenant's reserved pages): the victim gave its pages
   back, the request still did not fit, and the victim came back, step after step.

And two hangs after a reload: one that lowered a tenant's max_concurrent_requests below a waiting request's n,
and one that lowered its quota below a request's page budget, left that request (and every request of its
tenant queued behind it) waiting forever. The API refuses both up front; a reload ends them the same way.
"""

from __future__ import annotations

import pytest

from pagedkv.tenancy import Tenant, Tenants
from scheduler_svc.pages import PagePool
from scheduler_svc.policy import Mode, PreemptionConfig
from scheduler_svc.scheduler import SchedulerConfig
from tests.support.driven import Driven, driven
from tests.support.fake_executor import drive, make_request

pytestmark = pytest.mark.unit

BS = 4


def scheduler(pages: int, tenants: list[Tenant], seqs: int, token_budget: int) -> Driven:
    cfg = SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=token_budget, max_model_len=64, watermark=0,
                          preemption=PreemptionConfig(hot_steps=0, cold_steps=4))
    return driven(PagePool(pages, BS), cfg, [2], tenants=Tenants(tenants))


def windowed(i: int, tenant: str, prompt_len: int, budget: int, **kw):
    """A page budget with the 'window' policy, as the API builds it: the first page is the sink, the window
    what the rest of the budget holds, less one page."""
    prompt = [(5 * i + j) % 200 + 3 for j in range(prompt_len)]
    return make_request(i, 0, 6, prompt=prompt, tenant=tenant, page_budget=budget, sink_tokens=BS,
                        window_tokens=(budget - 2) * BS, **kw)


def assert_all_finish(s: Driven, reqs, steps: int = 400) -> None:
    drive(s, max_steps=steps)
    stuck = [(r.request_id, r.status.value, r.num_computed, r.compute_target) for r in reqs if r.finish is None]
    assert not stuck, f"not finished after {steps} steps (preempted {s.counters.preemptions} times): {stuck}"
    assert s.pool.num_used == 0


def test_a_seat_is_not_taken_from_a_request_fair_order_brings_straight_back():
    s = scheduler(pages=32, tenants=[Tenant("x"), Tenant("y")], seqs=2, token_budget=4)
    forks = windowed(0, "x", 14, budget=3, n=2)  # needs both seats; its prompt takes 4 chunks
    s.add(forks)
    drive(s, max_steps=2)
    other = make_request(1, 6, 4, tenant="y")  # y comes back from idle with x's service: a tie, x is older
    s.add(other)
    assert_all_finish(s, [other])
    assert forks.num_preemptions == 0


def test_no_preemption_that_cannot_make_room():
    """10 pages; c reserves 2. d's windowed request holds 2 or 3, a's 5 (above a's fair share of 10/3). b's
    request needs 7: even with a's 5 back, 7 + c's 2 > 8 free while d runs. Taking a's pages would not let b start; it
    only made a start over (it can take at most 4 of its pages from the cache) every step."""
    s = scheduler(pages=10, tenants=[Tenant("a"), Tenant("b"), Tenant("c", reserved_pages=2), Tenant("d")], seqs=4,
                  token_budget=64)
    steady = windowed(0, "d", 6, budget=3)
    steady.sampling.max_tokens = 40
    hog = windowed(1, "a", 30, budget=5)
    s.add(steady)
    s.add(hog)
    drive(s, max_steps=2)
    big = make_request(2, 26, 1, tenant="b")
    s.add(big)
    s.waiting.counters["b"] = s.waiting.counters["a"] - 1  # b has had less service: fair order puts b first
    drive(s, max_steps=10)
    assert hog.num_preemptions == 0, "a's pages taken although b could not start with them"
    assert_all_finish(s, [steady, hog, big])


def test_reload_ends_a_request_wider_than_the_new_concurrency_limit():
    s = scheduler(pages=32, tenants=[Tenant("a"), Tenant("d", max_concurrent_requests=2)], seqs=4, token_budget=8)
    blocker = make_request(0, 4, 30, tenant="d", n=2)  # takes d's two seats
    wide = make_request(1, 6, 4, tenant="d", n=2)  # waits for them
    s.add(blocker)
    s.add(wide)
    drive(s, max_steps=2)
    ended = s.set_tenants(Tenants([Tenant("a"), Tenant("d", max_concurrent_requests=1)]))
    assert [(r, o.error) for r, o in ended] == [(wide, "tenant d's new limits allow 1 concurrent sequences; this "
                                                 "request asked for n=2")]
    assert_all_finish(s, [])
    assert not s.requests


def test_reload_ends_a_request_whose_budget_the_new_quota_cannot_hold():
    s = scheduler(pages=32, tenants=[Tenant("a"), Tenant("b", page_quota=8)], seqs=4, token_budget=4)
    running = windowed(0, "b", 20, budget=6)
    queued = make_request(1, 5, 4, tenant="b")  # fits the new quota: it must not wait behind the other for ever
    s.add(running)
    s.add(queued)
    drive(s, max_steps=2)
    ended = s.set_tenants(Tenants([Tenant("a"), Tenant("b", page_quota=5)]))
    assert [(r, o.error) for r, o in ended] == [(running, "tenant b's new limits hold 5 pages; this request needs "
                                                          "more")]
    assert_all_finish(s, [queued])


def test_forks_do_not_take_turns_preempting_each_other():
    """Two forks of one request (same arrival) that each need pages the other holds: the victim used to be the
    first of equals in list order, so they preempted each other in turn and neither finished. The fork index
    now breaks the tie: the last fork waits, the first finishes."""
    cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=16, max_model_len=64, watermark=0,
                          preemption=PreemptionConfig(mode=Mode.RECOMPUTE, hot_steps=64, cold_steps=64))
    s = driven(PagePool(9, BS), cfg, [2])
    req = windowed(0, "default", 15, budget=6, n=2)
    req.sampling.max_tokens = 28
    s.add(req)
    drive(s, max_steps=400)
    assert not s.has_work, f"not finished after 400 steps (preempted {s.counters.preemptions} times)"
    assert s.pool.num_used == 0
