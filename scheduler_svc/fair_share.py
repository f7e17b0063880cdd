"""Making room for a tenant below its fair share: which running requests of tenants above theirs give back a
seat (max_num_seqs) or pages, so that the request fairness would admit next can start.

The victims are chosen first, on paper, and preempted only if together they make the room: a preemption that
leaves the request still unable to start frees nothing for it, and its victims would come straight back (a
livelock the page-accounting state machine found). ``victims_for_head`` is a pure function of the planner's
read-only view; the planner preempts what it returns.
"""

from __future__ import annotations

from scheduler_svc.pages import PagePool, held
from scheduler_svc.plan_view import PlanView, first_chunk
from scheduler_svc.request import Request
from scheduler_svc.tenant_limits import TenantLimits


def victims_for_head(view: PlanView) -> list[Request]:
    """The requests to preempt so that the head of the wait queue can start ([] when none need to, or when
    preempting would not make the room)."""
    waiting, ledger, kv = view.queues.waiting, view.ledger, view.kv
    if not view.config.fairness or not ledger.tenants.multi or not waiting:
        return []
    req = waiting.head()
    if req is None:
        return []
    hits = kv.find_hits(req)
    if kv.waits_for_inflight(req, len(hits)):
        return []
    if view.limits.at_seat_limit(req.tenant, req.n):
        return []  # its own limit holds it back: taking from others would not help
    hits, n = first_chunk(view, req, hits, view.config.max_num_batched_tokens)
    need = kv.pages_to_admit(hits, n)
    if ledger.over_quota(ledger.tenants.get(req.tenant), need):
        return []
    victims = _seat_victims(view, req)
    if victims is not None:
        victims = _page_victims(view, req, need, victims)
    return victims or []


class ReleasePreview:
    """What preempting some requests would give back, on paper: free device pages, and pages per tenant
    (a page other requests still hold stays used)."""

    def __init__(self, pool: PagePool) -> None:
        self._pool = pool
        self.free = pool.num_free
        self.used = pool.used_by.copy()
        self._holders: dict[int, int] = {}

    def used_pages(self, tenant: str) -> int:
        """The tenant's pages in this pool once the previewed victims gave theirs back."""
        return self.used[tenant]

    def fits(self, limits: TenantLimits, tenant: str, pages: int) -> bool:
        """Whether ``pages`` more for the tenant fit the free pages then, other tenants' reserves left free."""
        return pages + limits.reserved_for_others(tenant, self.used) <= self.free

    def add(self, victim: Request) -> None:
        pool, holders = self._pool, self._holders
        for p in held(victim.page_table):
            holders[p] = holders.get(p, 0) + 1
            if holders[p] == pool.refcount(p):
                self.free += 1
                self.used[pool.owner_of(p)] -= 1


def _page_victims(view: PlanView, req: Request, need: int, victims: list[Request]) -> list[Request] | None:
    """victims (those giving up a seat) plus the requests of tenants above their fair share of pages that must
    give theirs back for req to start, while its tenant holds less than its share; None when even that would
    not make room."""
    ledger, kv, running = view.ledger, view.kv, view.queues.running
    shares = ledger.fair_shares()
    preview = ReleasePreview(kv.pool)
    used_elsewhere = {t: ledger.used_pages(t) - kv.pool.used_by[t] for t in shares}

    def fits() -> bool:
        slack = view.watermark_pages if len(running) > len(victims) else 0
        reserved = view.limits.reserved_for_others(req.tenant, preview.used)
        # NOTE: the running requests that stay are scheduled (and grow) before anything is admitted: room they
        # would take is no room for req (another livelock the state machine found).
        tokens = view.config.max_num_batched_tokens
        growth = sum(kv.pages_to_grow(r, kv.window_chunk_limit(r, min(r.num_uncomputed, tokens)))
                     for r in running if r not in victims)
        return need + slack + reserved + growth <= preview.free

    for victim in victims:
        preview.add(victim)
    if fits():
        return victims
    if ledger.used_pages(req.tenant) >= shares.get(req.tenant, 0):
        return None
    while not fits():
        over = {t for t, share in shares.items() if t != req.tenant and used_elsewhere[t] + preview.used[t] > share}
        victim = _next_victim(view, req, over, victims)
        if victim is None:
            return None
        victims.append(victim)
        preview.add(victim)
    return victims


def _seat_victims(view: PlanView, req: Request) -> list[Request] | None:
    """Requests of tenants above their share of this executor's seats (max_num_seqs, split by weight) that must
    give theirs up for req to start: [] when a seat is free, None when none can be made for it."""
    seats = view.queues.seats()
    limit = view.config.max_num_seqs
    if sum(seats.values()) + req.n <= limit:
        return []
    tenants = view.ledger.tenants
    active = set(seats) | {req.tenant}
    total = sum(tenants.get(t).weight for t in active)
    share = {t: limit * tenants.get(t).weight / total for t in active}
    if seats.get(req.tenant, 0) + req.n > share[req.tenant]:
        return None  # its tenant already has its share of seats
    victims: list[Request] = []
    while sum(seats.values()) + req.n > limit:
        over = {t for t in seats if t != req.tenant and seats[t] > share[t]}
        victim = _next_victim(view, req, over, victims)
        if victim is None:
            return None
        victims.append(victim)
        seats[victim.tenant] -= victim.n
    return victims


def _next_victim(view: PlanView, req: Request, over: set[str], victims: list[Request]) -> Request | None:
    """The next running request of a tenant in ``over`` to preempt for req (None: no candidate): not one
    already chosen, nor one fair order would bring straight back ahead of req."""
    candidates = [r for r in view.queues.running
                  if r.tenant in over and r not in victims and not _requeued_first(view, r, req)]
    return view.policy.pick_victim(candidates, view.now) if candidates else None


def _requeued_first(view: PlanView, victim: Request, req: Request) -> bool:
    """Whether fair order would admit victim, preempted and back at the front of its tenant's queue, before req.
    Taking its seat or pages for req would only bring it straight back, step after step (a livelock the
    page-accounting state machine found: a recompute victim re-admitted from its cached prefix each step, its
    last prompt token never computed)."""
    q = view.queues.waiting
    service = q.service(victim.tenant)
    if not q.tenant_len(victim.tenant):  # it would return from idle: lifted to the least backlogged service
        others = [q.service(t) for t in q.backlogged() if t != victim.tenant]
        if others:
            service = max(service, min(others))
    return (service, victim.arrival) <= (q.service(req.tenant), req.arrival)
