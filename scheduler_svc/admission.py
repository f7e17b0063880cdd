"""Admission: which waiting or swapped requests start this step, within the token budget, the seats
(max_num_seqs), the free pages and their tenants' limits.

Order: swapped requests that waited too long first (nothing else is admitted until they fit); then new and
recompute-preempted requests in fair order (VTC across tenants; one whose shared prefix another request is
computing waits); then the other swapped requests, in swap-out order (TTFT first). A step that preempted
admits nothing, except new requests of tenants below their reserved minimum.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from scheduler_svc.request import Finish, Request, Status

if TYPE_CHECKING:
    from scheduler_svc.scheduler import Scheduler


def first_chunk(s: Scheduler, req: Request, hits: list, budget: int) -> tuple[list, int]:
    """The cache hits a request admitted now uses and the tokens its first step computes: with a page
    budget (or a window's page limit) at most limit - 1 pages come from the cache, the rest fit it."""
    limit = req.page_budget or req.page_limit
    if limit:
        hits = hits[: limit - 1]
    n = min(req.compute_target - len(hits) * s.pool.block_size, budget)
    if limit:
        n = min(n, (limit - len(hits)) * s.pool.block_size)
    return hits, n


def admit(s: Scheduler, budget: int, scheduled: list[tuple[Request, int]], only_reserved: bool = False) -> None:
    """Swapped requests that waited too long first (nothing else is admitted until they fit); then new
    and recompute-preempted requests in fair order (one whose shared prefix another request is computing
    waits); then the other swapped requests, in swap-out order. only_reserved: just new requests of
    tenants below their reserved minimum (a step that preempted admits nothing else)."""
    if not s.waiting and not s.swapped:
        return
    seats = sum(r.n for r in s.running)  # a parent that has not forked yet holds n seats
    if only_reserved:
        skip = {t for t in s.waiting.queues if s.limits.used_pages(t) >= s.limits.get(t).reserved_pages}
        _admit_waiting(s, budget, scheduled, seats, skip)
        return
    now = s.step_id + 1
    wait = s.policy.config.swap_in_max_wait
    for req in [r for r in s.swapped if now - r.swapped_at >= wait]:
        if budget <= 0:
            break
        n = _swap_in(s, req, budget, seats, scheduled)
        if n == 0:
            return  # an overdue request waits for room: nothing else goes ahead of it
        if n is not None:
            seats += req.n
            budget -= n
    budget, seats, blocked = _admit_waiting(s, budget, scheduled, seats, set())
    for req in list(s.swapped):
        if blocked or budget <= 0:
            break
        n = _swap_in(s, req, budget, seats, scheduled)
        if n == 0:
            break
        if n is not None:
            seats += req.n
            budget -= n


def _swap_in(s: Scheduler, req: Request, budget: int, seats: int, scheduled: list[tuple[Request, int]]) -> int | None:
    """Brings a swapped request back if it fits; returns the tokens it takes, 0 when the pool or the
    seats are short (wait), None when its own tenant's limits hold it back (others may go)."""
    if seats + req.n > s.config.max_num_seqs:
        return 0
    if s.limits.at_seat_limit(req.tenant, req.n) or req.in_flight:  # (swapped out under a plan in flight)
        return None
    s.drop_outside_window(req)  # host pages outside the window are not worth copying back
    n = s.kv.window_chunk_limit(req, min(req.num_uncomputed, budget))
    need = s.kv.pages_to_swap_in(req, n)
    capacity = s.limits.capacity(req.tenant)
    if need > capacity:  # it can never come back (e.g. a quota lowered by reload)
        s.deferred_outputs.append((req, s.finish(
            req, Finish.ABORT,
            error=f"request needs {need} pages; tenant {req.tenant} can hold at most {capacity}")))
        return None
    if not s.limits.can_take(req.tenant, need, s.watermark_pages if s.running else 0):
        return None if s.limits.over_quota(s.limits.get(req.tenant), need) else 0
    s.swapped.remove(req)
    s.kv.swap_in(req, n)
    req.status = Status.RUNNING
    s.running.append(req)
    scheduled.append((req, n))
    return n


def _admit_waiting(s: Scheduler, budget: int, scheduled: list[tuple[Request, int]], seats: int,
                   skip_tenants: set[str]) -> tuple[int, int, bool]:
    """New and recompute-preempted requests in fair order; returns (budget, seats, blocked). Tenants in
    skip_tenants (and those reaching their quota or concurrency limit) are passed over."""
    skip: set[int] = set()  # requests waiting for another's in-flight prefix pages
    running_by_tenant = s.limits.seats()  # (on every executor: the concurrency limit is the sum's)
    blocked = False
    while budget > 0:
        req = s.waiting.head(skip, skip_tenants)
        if req is None:
            break
        if seats + req.n > s.config.max_num_seqs:
            blocked = True
            break
        if req.in_flight:  # preempted under a plan in flight: its sample comes first
            skip.add(id(req))
            continue
        tenant = s.limits.get(req.tenant)
        if s.limits.at_seat_limit(req.tenant, req.n, running_by_tenant.get(req.tenant, 0)):
            skip_tenants.add(req.tenant)
            continue
        hits = s.kv.find_hits(req)
        if s.kv.waits_for_inflight(req, len(hits)):
            skip.add(id(req))
            continue
        hits, n = first_chunk(s, req, hits, budget)
        need = s.kv.pages_to_admit(hits, n)
        slack = s.watermark_pages if s.running else 0
        if not s.limits.can_take(req.tenant, need, slack):
            if s.limits.over_quota(tenant, need) or s.pool.can_allocate(need + slack):
                skip_tenants.add(req.tenant)  # its quota, or other tenants' reserves: others may go
                continue
            blocked = True
            break
        s.waiting.remove(req)
        s.kv.admit(req, hits, n)
        if req.num_preemptions == 0:  # weighted service: the prompt tokens it will compute
            s.waiting.charge(req.tenant, prompt_tokens=req.compute_target - len(hits) * s.pool.block_size)
        req.status = Status.RUNNING
        if req.admitted_at_step < 0:
            req.admitted_at_step = s.step_id + 1
        s.running.append(req)
        running_by_tenant[req.tenant] = running_by_tenant.get(req.tenant, 0) + req.n
        seats += req.n
        scheduled.append((req, n))
        budget -= n
    return budget, seats, blocked
