"""Admission: which waiting or swapped requests start this step, within the token budget, the seats
(max_num_seqs), the free pages and their tenants' limits.

Order: swapped requests that waited too long first (nothing else is admitted until they fit; under the priority
policy, not ahead of a more important request of their own tenant); then new and recompute-preempted requests in
fair order (VTC across tenants, each tenant's in priority order under the priority policy; one whose shared prefix
another request is computing waits); then the other swapped requests, in swap-out order (TTFT first). A step that
preempted admits nothing, except new requests of tenants below their reserved minimum. When pages are short for one
of them, the oldest retention of KV that would free some ends first (``Reclaim``; the tenant's own when its quota
is short).

``admissions`` reads the planner's state through a ``PlanView`` and yields decisions, one at a time; the planner
applies each before the next is decided (as mini-sglang's PrefillAdder and vLLM's SchedulerOutput do), so each
decision sees the pages and seats the ones before it took.
"""

from __future__ import annotations

from collections.abc import Generator, Iterator
from dataclasses import dataclass

from scheduler_svc.kv_manager import Hit
from scheduler_svc.plan_view import PlanView, first_chunk
from scheduler_svc.request import Request
from scheduler_svc.wait_queue import WaitQueue


@dataclass(slots=True)
class Admit:
    """A waiting request starts: with these prefix-cache hits, computing n tokens."""

    req: Request
    hits: list[Hit]
    n: int


@dataclass(slots=True)
class SwapIn:
    """A swapped request comes back, computing n tokens."""

    req: Request
    n: int


@dataclass(slots=True)
class Trim:
    """Drop a swapped request's pages outside its window first (host pages not worth copying back)."""

    req: Request


@dataclass(slots=True)
class Reclaim:
    """Pages are short: end this retention of KV first (retention.py; before anything running is preempted)."""

    key: tuple[str, str]


@dataclass(slots=True)
class Refuse:
    """A swapped request can never come back here (e.g. its tenant's quota was lowered): it ends with error."""

    req: Request
    error: str


@dataclass(slots=True)
class PageIn:
    """A request about to run needs its LoRA adapter in a device slot: page it into ``slot`` (adapter_slots.py;
    the least recently used adapter there, idle, goes back to host memory)."""

    adapter: str
    slot: int


@dataclass(slots=True)
class Evict:
    """A tenant's own idle adapter leaves its slot, to make room in the tenant's quota."""

    adapter: str


Decision = Admit | SwapIn | Trim | Reclaim | Refuse | PageIn | Evict
_Decisions = Generator[Decision, None, None]


def admissions(view: PlanView, budget: int, only_reserved: bool = False) -> Iterator[Decision]:
    """Swapped requests that waited too long first (nothing else is admitted until they fit); then new
    and recompute-preempted requests in fair order (one whose shared prefix another request is computing
    waits); then the other swapped requests, in swap-out order. only_reserved: just new requests of
    tenants below their reserved minimum (a step that preempted admits nothing else)."""
    queues = view.queues
    if not queues.waiting and not queues.swapped:
        return
    seats = sum(r.n for r in queues.running)  # a parent that has not forked yet holds n seats
    if only_reserved:
        ledger = view.ledger
        skip = {t for t in queues.waiting.backlogged()
                if ledger.used_pages(t) >= ledger.tenants.get(t).reserved_pages}
        yield from _admit_waiting(view, budget, seats, skip)
        return
    wait, waiting = view.policy.config.swap_in_max_wait, queues.waiting
    for req in [r for r in queues.swapped if view.now - r.swapped_at >= wait and not _outranked(waiting, r)]:
        if budget <= 0:
            break
        n = yield from _swap_in(view, req, budget, seats)
        if n == 0:
            return  # an overdue request waits for room: nothing else goes ahead of it
        if n is not None:
            seats += req.n
            budget -= n
    budget, seats, blocked = yield from _admit_waiting(view, budget, seats, set())
    for req in list(queues.swapped):
        if blocked or budget <= 0:
            break
        n = yield from _swap_in(view, req, budget, seats)
        if n == 0:
            break
        if n is not None:
            seats += req.n
            budget -= n


def _outranked(waiting: WaitQueue, req: Request) -> bool:
    """Under the priority policy, whether a more important request of its tenant waits: an overdue swapped request
    does not go ahead of it (it was likely swapped out to make room for it)."""
    first = waiting.first(req.tenant) if waiting.by_priority else None
    return first is not None and first.priority < req.priority


def _swap_in(view: PlanView, req: Request, budget: int, seats: int) -> Generator[Decision, None, int | None]:
    """Brings a swapped request back if it fits; returns the tokens it takes, 0 when the pool or the
    seats are short (wait), None when its own tenant's limits hold it back (others may go)."""
    limits, kv = view.limits, view.kv
    if seats + req.n > view.config.max_num_seqs:
        return 0
    if limits.at_seat_limit(req.tenant, req.n) or req.in_flight:  # (swapped out under a plan in flight)
        return None
    slot = view.adapter_slot(req)
    if slot == -1:  # every adapter slot is in use: others may go
        return None
    yield Trim(req)
    n = kv.window_chunk_limit(req, min(req.num_uncomputed, budget))
    tier = kv.host_tier  # (a swapped request: there is one)
    need = tier.pages_to_swap_in(req, n)
    capacity = limits.capacity(req.tenant)
    if need > capacity:  # it can never come back (e.g. a quota lowered by reload)
        yield Refuse(req, f"request needs {need} pages; tenant {req.tenant} can hold at most {capacity}")
        return None
    charge = view.adapters.charge(req.adapter) if slot is not None else 0
    while not limits.can_take(req.tenant, need, view.slack(), charge):
        over = view.ledger.over_quota(view.ledger.tenants.get(req.tenant), need + charge)
        if over and (idle := _idle_adapter(view, req)):
            yield Evict(idle)
            continue
        key = view.retained.reclaimable(req.tenant if over else None)
        if key is None:
            return None if over else 0
        yield Reclaim(key)
        need = tier.pages_to_swap_in(req, n)
    if slot is not None:
        yield PageIn(req.adapter, view.adapter_slot(req))  # (an eviction above may have freed another slot)
    yield SwapIn(req, n)
    return n


def _idle_adapter(view: PlanView, req: Request) -> str | None:
    """An idle adapter of req's tenant in a slot (not req's own): it goes before the tenant's KV waits."""
    if view.adapters is None:
        return None
    return view.adapters.idle_owned(req.tenant, view.queues.running_adapters() | {req.adapter})


def _admit_waiting(view: PlanView, budget: int, seats: int,
                   skip_tenants: set[str]) -> Generator[Decision, None, tuple[int, int, bool]]:
    """New and recompute-preempted requests in fair order; returns (budget, seats, blocked). Tenants in
    skip_tenants (and those reaching their quota or concurrency limit) are passed over."""
    kv, limits, ledger, waiting = view.kv, view.limits, view.ledger, view.queues.waiting
    skip: set[int] = set()  # requests waiting for another's in-flight prefix pages
    running_by_tenant = ledger.seats()  # (on every executor: the concurrency limit is the sum's)
    blocked = False
    while budget > 0:
        req = waiting.head(skip, skip_tenants)
        if req is None:
            break
        if seats + req.n > view.config.max_num_seqs:
            blocked = True
            break
        if req.in_flight:  # preempted under a plan in flight: its sample comes first
            skip.add(id(req))
            continue
        if limits.at_seat_limit(req.tenant, req.n, running_by_tenant.get(req.tenant, 0)):
            skip_tenants.add(req.tenant)
            continue
        slot = view.adapter_slot(req)
        if slot == -1:  # every adapter slot is in use by running requests: it waits, others may go
            skip.add(id(req))
            continue
        hits = kv.find_hits(req)
        if kv.waits_for_inflight(req, len(hits)):
            skip.add(id(req))
            continue
        hits, n = first_chunk(view, req, hits, budget)
        need = kv.pages_to_admit(hits, n)
        slack = view.slack()
        charge = view.adapters.charge(req.adapter) if slot is not None else 0
        if not limits.can_take(req.tenant, need, slack, charge):
            over = ledger.over_quota(ledger.tenants.get(req.tenant), need + charge)
            if over and (idle := _idle_adapter(view, req)):
                yield Evict(idle)  # an idle adapter of its own first; then it is looked at again
                continue
            key = view.retained.reclaimable(req.tenant if over else None, [p for p, on_host in hits if not on_host])
            if key is not None:  # retained pages first (not those it would hit); then it is looked at again
                yield Reclaim(key)
                continue
            if over or kv.pool.can_allocate(need + slack):
                skip_tenants.add(req.tenant)  # its quota, or other tenants' reserves: others may go
                continue
            blocked = True
            break
        if slot is not None:
            yield PageIn(req.adapter, slot)
        yield Admit(req, hits, n)
        running_by_tenant[req.tenant] = running_by_tenant.get(req.tenant, 0) + req.n
        seats += req.n
        budget -= n
    return budget, seats, blocked
