"""Making room for a tenant below its fair share: which running requests of tenants above theirs give back a
seat (max_num_seqs) or pages, so that the request fairness would admit next can start.

The victims are chosen first, on paper, and preempted only if together they make the room: a preemption that
leaves the request still unable to start frees nothing for it, and its victims would come straight back (a
livelock the page-accounting state machine found). ``victims_for_head`` only reads the scheduler; the
scheduler preempts what it returns.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from scheduler_svc.admission import first_chunk
from scheduler_svc.request import Request

if TYPE_CHECKING:
    from scheduler_svc.scheduler import Scheduler


def victims_for_head(s: Scheduler) -> list[Request]:
    """The requests to preempt so that the head of the wait queue can start ([] when none need to, or when
    preempting would not make the room)."""
    if not s.config.fairness or not s.tenants.multi or not s.waiting:
        return []
    req = s.waiting.head()
    if req is None:
        return []
    hits = s.kv.find_hits(req)
    if s.kv.waits_for_inflight(req, len(hits)):
        return []
    if s.limits.at_seat_limit(req.tenant, req.n):
        return []  # its own limit holds it back: taking from others would not help
    hits, n = first_chunk(s, req, hits, s.config.max_num_batched_tokens)
    need = s.kv.pages_to_admit(hits, n)
    if s.limits.over_quota(s.limits.get(req.tenant), need):
        return []
    now = s.step_id + 1
    victims = _seat_victims(s, req, now)
    if victims is not None:
        victims = _page_victims(s, req, need, victims, now)
    return victims or []


def _page_victims(s: Scheduler, req: Request, need: int, victims: list[Request], now: int) -> list[Request] | None:
    """victims (those giving up a seat) plus the requests of tenants above their fair share of pages that must
    give theirs back for req to start, while its tenant holds less than its share; None when even that would
    not make room."""
    shares = s.limits.fair_shares()
    preview = s.kv.release_preview()
    used_elsewhere = {t: s.limits.used_pages(t) - s.pool.used_by[t] for t in shares}

    def fits() -> bool:
        slack = s.watermark_pages if len(s.running) > len(victims) else 0
        reserved = s.limits.reserved_for_others(req.tenant, preview.used)
        # NOTE: the running requests that stay are scheduled (and grow) before anything is admitted: room they
        # would take is no room for req (another livelock the state machine found).
        tokens = s.config.max_num_batched_tokens
        growth = sum(s.kv.pages_to_grow(r, s.kv.window_chunk_limit(r, min(r.num_uncomputed, tokens)))
                     for r in s.running if r not in victims)
        return need + slack + reserved + growth <= preview.free

    for victim in victims:
        preview.add(victim)
    if fits():
        return victims
    if s.limits.used_pages(req.tenant) >= shares.get(req.tenant, 0):
        return None
    while not fits():
        over = {t for t, share in shares.items() if t != req.tenant and used_elsewhere[t] + preview.used[t] > share}
        victim = _next_victim(s, req, over, victims, now)
        if victim is None:
            return None
        victims.append(victim)
        preview.add(victim)
    return victims


def _seat_victims(s: Scheduler, req: Request, now: int) -> list[Request] | None:
    """Requests of tenants above their share of this executor's seats (max_num_seqs, split by weight) that must
    give theirs up for req to start: [] when a seat is free, None when none can be made for it."""
    seats: dict[str, int] = {}
    for r in s.running:
        seats[r.tenant] = seats.get(r.tenant, 0) + r.n
    limit = s.config.max_num_seqs
    if sum(seats.values()) + req.n <= limit:
        return []
    active = set(seats) | {req.tenant}
    total = sum(s.limits.get(t).weight for t in active)
    share = {t: limit * s.limits.get(t).weight / total for t in active}
    if seats.get(req.tenant, 0) + req.n > share[req.tenant]:
        return None  # its tenant already has its share of seats
    victims: list[Request] = []
    while sum(seats.values()) + req.n > limit:
        over = {t for t in seats if t != req.tenant and seats[t] > share[t]}
        victim = _next_victim(s, req, over, victims, now)
        if victim is None:
            return None
        victims.append(victim)
        seats[victim.tenant] -= victim.n
    return victims


def _next_victim(s: Scheduler, req: Request, over: set[str], victims: list[Request], now: int) -> Request | None:
    """The next running request of a tenant in ``over`` to preempt for req (None: no candidate): not one
    already chosen, nor one fair order would bring straight back ahead of req."""
    candidates = [r for r in s.running if r.tenant in over and r not in victims and not _requeued_first(s, r, req)]
    return s.policy.pick_victim(candidates, now) if candidates else None


def _requeued_first(s: Scheduler, victim: Request, req: Request) -> bool:
    """Whether fair order would admit victim, preempted and back at the front of its tenant's queue, before req.
    Taking its seat or pages for req would only bring it straight back, step after step (a livelock the
    page-accounting state machine found: a recompute victim re-admitted from its cached prefix each step, its
    last prompt token never computed)."""
    q = s.waiting
    service = q.service(victim.tenant)
    if not q.tenant_len(victim.tenant):  # it would return from idle: lifted to the least backlogged service
        others = [q.service(t) for t, w in q.queues.items() if w and t != victim.tenant]
        if others:
            service = max(service, min(others))
    return (service, victim.arrival) <= (q.service(req.tenant), req.arrival)
