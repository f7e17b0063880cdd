"""What happens to one executor's scheduler between steps, when the executor or the settings change: a request
moved away (detach), the executor lost (evacuate, fail_all), drained, back with another pool geometry, new tenant
limits; plus the read-only snapshot the rest of the service reads, and the integrity check.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from scheduler_svc.kv_manager import KVManager, held
from scheduler_svc.pages import PagePool
from scheduler_svc.request import Finish, Request, Status
from scheduler_svc.snapshot import PoolSnapshot, SchedulerSnapshot, TenantUsage

if TYPE_CHECKING:
    from scheduler_svc.policy import PreemptionCosts
    from scheduler_svc.scheduler import Outputs, Scheduler
    from scheduler_svc.tenancy import Tenants


def detach(s: Scheduler, req: Request) -> None:
    """Takes a live request away from the executor, to be placed on another: its pages here are freed (both
    tiers; its KV is recomputed there, prompt and the tokens streamed so far), and the executor is told to
    forget it. Only between steps (never while a plan holding it is in flight)."""
    assert not req.in_flight, f"{req.request_id}: detached while a plan in flight computes for it"
    if req.status is Status.RUNNING:
        s.running.remove(req)
        s.session.forget.append(req.request_id)
    elif req.status is Status.SWAPPED:
        s.swapped.remove(req)
    else:
        s.waiting.remove(req)
        if req.num_pages_sent >= 0:
            s.session.forget.append(req.request_id)
    s.kv.release(req)
    s.requests.pop(req.request_id, None)
    req.status = Status.WAITING
    req.num_pages_sent = -1
    req.dropped_pending = []
    req.num_migrations += 1
    if s.config.fairness and not s.ledger.has_requests(req.tenant):
        s.waiting.went_idle(req.tenant)


def fail_all(s: Scheduler, error: str) -> Outputs:
    """The executor is gone, and its pages with it (both tiers): every live request ends with an error, all
    pages return, and the prefix cache forgets every page (a restarted executor holds none)."""
    _drop_inflight(s)
    outputs = [(r, s.finish(r, Finish.ABORT, error=error)) for r in list(s.requests.values())]
    _forget_executor_state(s)
    return outputs


def evacuate(s: Scheduler, keep_cache: bool = False) -> tuple[list[Request], Outputs]:
    """The executor is gone, and its pages with it: its live requests come back ready to be placed on another
    executor (oldest first), aborted ones end; all pages return and the prefix cache forgets every page. A
    request's sampler continues there: draws are numbered by output position.

    keep_cache: only the Run stream was lost, and the same executor process may come back with its pages as
    they were (the engine forgets them all if another process answers). Published pages stay findable, except
    those that unconfirmed page operations were filling: whether those ran is unknown."""
    unsure = s.pending_ops() if keep_cache else None
    _drop_inflight(s)
    ended = s._reap_aborted() + s.deferred_outputs
    s.deferred_outputs = []
    moved = sorted(s.requests.values(), key=lambda r: r.arrival)
    for req in moved:
        detach(s, req)
    if unsure is None:
        _forget_executor_state(s)
    else:
        s.kv.take_ops()
        s.session.reset()
        s.kv.unpublish_written(unsure)
    return moved, ended


def drained(s: Scheduler) -> None:
    """Nothing is left on a draining executor that is about to close: nothing to forget, every page accounted
    for, and no prefix-cache hit may point there (a process that comes back at its address starts empty)."""
    s.session.forget = []
    _drop_inflight(s)  # (plans of the closed stream, if any, are never answered)
    check_integrity(s)
    s.kv.forget_cached()


def _drop_inflight(s: Scheduler) -> None:
    for ops in [*s.session.drop_inflight(), s.kv.take_ops()]:
        s.kv.confirm(ops)  # drops the host references they held


def _forget_executor_state(s: Scheduler) -> None:
    s.kv.take_ops()
    s.session.reset()
    s.kv.forget_cached()


def reset_pool(s: Scheduler, num_pages: int, block_size: int, num_host_pages: int = 0,
               costs: PreemptionCosts | None = None) -> None:
    """A (re)connected executor with another pool geometry; only when nothing is live. The counters go on
    ("since start"); quotas and reserves given as fractions follow the new pool."""
    assert not s.requests, "reset_pool with live requests"
    s.pool = PagePool(num_pages, block_size)
    host = PagePool(num_host_pages, block_size, min_pages=0) if num_host_pages else None
    s.kv = KVManager(s.pool, s.config.enable_prefix_caching, host, s.counters)
    s.limits.pool = s.pool
    s.ledger.resize()
    if costs is not None:
        s.set_costs(costs)
    s.watermark_pages = int(s.config.watermark * num_pages)


def set_tenants(s: Scheduler, tenants: Tenants | None = None) -> Outputs:
    """New tenant settings (a reload; None: the ledger's, already replaced): live requests get their limits
    again; those that no longer fit their tenant (a quota lowered below what they hold or need, or below their
    page budget, or n above its concurrency limit) end with an error."""
    if tenants is not None:
        s.ledger.tenants = tenants
    ended = []
    for req in list(s.requests.values()):
        s.limits.apply(req)
        capacity = s.limits.capacity(req.tenant)
        too_long = bool(s.limits.fit_error(req))  # (a budget above the capacity: it could never grow)
        seats = s.tenants.get(req.tenant).max_concurrent_requests
        if req.aborted:
            continue
        if too_long:
            ended.append((req, s.finish(req, Finish.ABORT, error=(
                f"tenant {req.tenant}'s new limits hold {capacity} pages; this request needs more"))))
        elif seats and req.n > seats:  # (a parent not yet forked: it could never be admitted again)
            ended.append((req, s.finish(req, Finish.ABORT, error=(
                f"tenant {req.tenant}'s new limits allow {seats} concurrent sequences; this request asked "
                f"for n={req.n}"))))
    return ended


# ---- reports ---------------------------------------------------------------------------------------
def _pool_snapshot(pool: PagePool | None) -> PoolSnapshot:
    if pool is None:
        return PoolSnapshot()
    return PoolSnapshot(pool.num_pages, pool.num_used, pool.num_free, pool.num_cached)


def snapshot(s: Scheduler, tenants: bool = False) -> SchedulerSnapshot:
    """The scheduler's state as frozen values; with ``tenants`` also per-tenant figures and the KV slots filled
    (these walk the requests)."""
    usage: dict[str, TenantUsage] = {}
    if tenants:
        names = set(s.limits.stats_by_tenant) | {t for t, n in s.pool.used_by.items() if n} | {
            r.tenant for r in s.requests.values()}
        shares = s.limits.fair_shares()
        for t in names:
            st = s.limits.stats(t)
            usage[t] = TenantUsage(
                used_pages=s.pool.used_by[t], host_pages=s.host.used_by[t] if s.host is not None else 0,
                peak_used_pages=st.peak_used_pages, num_running=sum(1 for r in s.running if r.tenant == t),
                num_waiting=s.waiting.tenant_len(t), num_swapped=sum(1 for r in s.swapped if r.tenant == t),
                service=s.waiting.charged(t), budget_hits=st.budget_hits,
                fair_share_preemptions=st.fair_share_preemptions,
                fair_share_pages=shares.get(t, 0.0) * s.pool.num_pages / max(1, s.ledger.total_pages))
    c = s.counters
    return SchedulerSnapshot(
        block_size=s.pool.block_size, max_num_seqs=s.config.max_num_seqs, pool=_pool_snapshot(s.pool),
        host=_pool_snapshot(s.host), num_running=len(s.running), num_waiting=len(s.waiting),
        num_swapped=len(s.swapped), counters=replace(c),
        page_bytes=s.policy.costs.page_bytes, prefix_caching=s.kv.caching,
        kv_slots_filled=s.kv.slots_filled(s.running) if tenants else 0, tenants=usage)


def check_integrity(s: Scheduler) -> None:
    """Both tiers: every page's refcount equals the tables (and pending swap-ins) holding it."""
    s.pool.check_integrity(s.held_tables())
    for r in s.running:
        if r.page_budget:
            pages = sum(1 for _ in held(r.page_table))
            assert pages <= r.page_budget, f"{r.request_id} holds {pages} pages, budget {r.page_budget}"
    if s.host is not None:
        pending = [ops.host_release for ops in s.pending_ops()]
        s.host.check_integrity([*(list(held(r.host_table)) for r in s.swapped), *pending])
    for h, owner in s.kv.inflight.items():
        assert owner.status is Status.RUNNING and h in owner.registered, "stale in-flight page claim"
    for r in s.waiting:
        assert not r.page_table and not r.host_table, f"waiting request {r.request_id} holds pages"
    for r in s.running:
        assert not r.host_table, f"running request {r.request_id} holds host pages"
    for r in s.swapped:
        assert not r.page_table and r.status is Status.SWAPPED, f"swapped request {r.request_id} holds device pages"
        assert len(r.host_table) == s.pool.pages_for(r.num_computed), f"{r.request_id}: host table size"
    assert len(s.running) + len(s.waiting) + len(s.swapped) == len(s.requests), "request lists disagree"
    tokens: dict[int, int] = {}
    samples: dict[int, int] = {}
    for sent in s.session.in_flight:
        for r, n, sampled in sent.scheduled:
            tokens[id(r)] = tokens.get(id(r), 0) + n
            samples[id(r)] = samples.get(id(r), 0) + sampled
    for r in s.requests.values():
        assert r.num_inflight_tokens == tokens.get(id(r), 0) and r.num_pending == samples.get(id(r), 0), (
            f"{r.request_id}: in-flight counts {r.num_inflight_tokens}/{r.num_pending} disagree with the plans "
            f"in flight")
