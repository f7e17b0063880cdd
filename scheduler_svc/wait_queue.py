"""The wait queue: one FIFO per tenant, and which tenant goes next (the fair order of admission).

With fairness on, the next request comes from the backlogged tenant with the least weighted service so
far: a virtual token counter per tenant (VTC, "Fairness in Serving Large Language Models", OSDI'24),
charged 1 per prompt token admitted and 2 per token generated, divided by the tenant's weight. A tenant
that returns from idle starts at the current minimum, so it cannot bank credit while away. With fairness
off, requests go in arrival order whatever their tenant (first come, first served).

Inside a tenant's queue, requests go in arrival order (``--scheduling-policy fcfs``), or (``priority``) the most
important class first (the lowest ``priority`` value, as vLLM's), in arrival order within a class: one FIFO per
class. Priority orders a tenant's own requests only: which tenant goes next is the counter's choice either way, so
no priority lets a tenant's request go ahead of another tenant's share. A recompute-preempted request goes back to
the front of its class.

Besides the counter, each tenant's own charges are kept apart (``charged``): the weighted tokens it was served,
never lifted. That is what a tenant may be shown (ModelInfo): the counter itself follows other tenants.

(The victims that make room for a tenant below its fair share of pages and seats are chosen in fair_share.py.)
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from scheduler_svc.request import Request

PROMPT_TOKEN_COST = 1.0
OUTPUT_TOKEN_COST = 2.0
GRAMMAR_MS_COST = OUTPUT_TOKEN_COST  # a millisecond of a constraint's CPU (compile or matcher) costs an output token


@dataclass(slots=True)
class VtcCounters:
    """Each tenant's weighted service so far (its virtual token counter, VTC), shared by the wait queues of every
    executor of a scheduler (the tenant ledger's), so fairness holds for the sum. ("Service" in the VTC paper's
    sense: tokens served, nothing to do with gRPC services.)"""

    counters: dict[str, float] = field(default_factory=dict)
    charged: dict[str, float] = field(default_factory=dict)  # weighted tokens charged to each tenant (its own only)
    grammar_cpu: dict[str, float] = field(default_factory=dict)  # CPU seconds its constraints cost (its own only)
    vtime: float = 0.0  # the service of the last tenant to go idle: the floor when nobody is active

    def went_idle(self, service: float) -> None:
        self.vtime = max(self.vtime, service)

    def add(self, tenant: str, cost: float, grammar_cpu_s: float = 0.0) -> None:
        """``cost`` weighted service to the tenant (``grammar_cpu_s`` of it its constraints' CPU)."""
        self.counters[tenant] = self.counters.get(tenant, 0.0) + cost
        self.charged[tenant] = self.charged.get(tenant, 0.0) + cost
        if grammar_cpu_s:
            self.grammar_cpu[tenant] = self.grammar_cpu.get(tenant, 0.0) + grammar_cpu_s


class TenantQueue:
    """One tenant's waiting requests: a FIFO per priority class, the most important class (lowest value) first.
    Under fcfs every request is in class 0: one FIFO."""

    __slots__ = ("_classes", "_order", "_len")

    def __init__(self) -> None:
        self._classes: dict[int, deque[Request]] = {}
        self._order: list[int] = []  # the classes present, most important first
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def __iter__(self) -> Iterator[Request]:
        for key in self._order:
            yield from self._classes[key]

    def oldest_arrival(self) -> int:
        """The earliest arrival among the fronts of its classes (the tenant's oldest waiting request, but for a
        requeued one behind an older one in its class)."""
        return min(q[0].arrival for q in self._classes.values())

    def contains(self, req: Request, key: int) -> bool:
        return req in self._classes.get(key, ())

    def _fifo(self, key: int) -> deque[Request]:
        q = self._classes.get(key)
        if q is None:
            q = self._classes[key] = deque()
            bisect.insort(self._order, key)
        return q

    def append(self, req: Request, key: int) -> None:
        self._fifo(key).append(req)
        self._len += 1

    def appendleft(self, req: Request, key: int) -> None:
        self._fifo(key).appendleft(req)
        self._len += 1

    def remove(self, req: Request, key: int) -> None:
        q = self._classes[key]
        q.remove(req)
        self._len -= 1
        if not q:
            del self._classes[key]
            self._order.remove(key)


class WaitQueue:
    def __init__(self, fair: bool = True, weight: Callable[[str], float] = lambda _: 1.0,
                 service: VtcCounters | None = None, by_priority: bool = False) -> None:
        """``by_priority``: each tenant's requests in priority order (``--scheduling-policy priority``), else in
        arrival order."""
        self._fair = fair
        self._weight = weight
        self._by_priority = by_priority
        self._queues: dict[str, TenantQueue] = {}
        self._shared = service if service is not None else VtcCounters()
        self._counters = self._shared.counters
        self._len = 0

    @property
    def counters(self) -> dict[str, float]:
        """Each tenant's virtual token counter (the shared VtcCounters')."""
        return self._counters

    def backlogged(self) -> list[str]:
        """Tenants with a request waiting here."""
        return [t for t, q in self._queues.items() if q]

    # ---- contents ------------------------------------------------------------------------------
    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def __iter__(self) -> Iterator[Request]:
        for q in self._queues.values():
            yield from q

    def __contains__(self, req: Request) -> bool:
        q = self._queues.get(req.tenant)
        return q is not None and q.contains(req, self.class_of(req))

    @property
    def by_priority(self) -> bool:
        return self._by_priority

    def class_of(self, req: Request) -> int:
        """The request's class in its tenant's queue: its priority under the priority policy, else 0 (one FIFO)."""
        return req.priority if self._by_priority else 0

    def _queue_for(self, tenant: str) -> TenantQueue:
        q = self._queues.get(tenant)
        if q is None:
            q = self._queues[tenant] = TenantQueue()
        if not q:  # back from idle: no credit for the time away
            counters = self._counters
            backlogged = [counters.get(t, 0.0) for t, other in self._queues.items() if other and t != tenant]
            if backlogged:
                counters[tenant] = max(counters.get(tenant, 0.0), min(backlogged))
        return q

    def append(self, req: Request) -> None:
        self._queue_for(req.tenant).append(req, self.class_of(req))
        self._len += 1

    def appendleft(self, req: Request) -> None:
        """A preempted request goes back to the front of its tenant's queue (of its class, under priority)."""
        self._queue_for(req.tenant).appendleft(req, self.class_of(req))
        self._len += 1

    def remove(self, req: Request) -> None:
        self._queues[req.tenant].remove(req, self.class_of(req))
        self._len -= 1

    def tenant_len(self, tenant: str) -> int:
        return len(self._queues.get(tenant, ()))

    def first(self, tenant: str) -> Request | None:
        """The tenant's request that goes first (its most important, under priority)."""
        return next(iter(self._queues.get(tenant, ())), None)

    # ---- order ---------------------------------------------------------------------------------
    def head(self, skip: set[int] | frozenset = frozenset(), skip_tenants: set[str] | frozenset = frozenset()
             ) -> Request | None:
        """The request to admit next, passing over requests (by id()) and tenants in the skip sets: the first of
        the tenant with the least weighted service (fairness off: the most important, then the oldest)."""
        best, best_key = None, None
        counters, fair = self._counters, self._fair
        for tenant, q in self._queues.items():
            if tenant in skip_tenants:
                continue
            req = next((r for r in q if id(r) not in skip), None)
            if req is None:
                continue
            # (without fairness, the most important class of any tenant first: max_priority bounds what each may ask)
            # NOTE: tenants with equal service go oldest first by the tenant's oldest request, not by the arrival of
            # the request its priorities put first: else a tenant's priorities would decide whose turn it is.
            if fair:
                key = (counters.get(tenant, 0.0), q.oldest_arrival() if self._by_priority else req.arrival)
            else:
                key = (self.class_of(req), req.arrival)
            if best_key is None or key < best_key:
                best, best_key = req, key
        return best

    def lift(self, tenant: str, others: set[str]) -> None:
        """A tenant with nothing running or waiting comes back: it starts at the least service among the
        tenants that are active (running or waiting), or, when none is, at the service of the last tenant
        that went idle; never below its own."""
        counters = self._counters
        floors = [counters.get(t, 0.0) for t in others if t != tenant]
        floor = min(floors) if floors else self._shared.vtime
        counters[tenant] = max(counters.get(tenant, 0.0), floor)

    def went_idle(self, tenant: str) -> None:
        self._shared.went_idle(self._counters.get(tenant, 0.0))

    # ---- service -------------------------------------------------------------------------------
    def charge(self, tenant: str, prompt_tokens: int = 0, output_tokens: int = 0, grammar_cpu_s: float = 0.0) -> None:
        """Service to the tenant: prompt tokens computed, output tokens sampled, CPU its constraints cost."""
        cost = (PROMPT_TOKEN_COST * prompt_tokens + OUTPUT_TOKEN_COST * output_tokens
                + GRAMMAR_MS_COST * 1e3 * grammar_cpu_s) / self._weight(tenant)
        self._shared.add(tenant, cost, grammar_cpu_s)

    def service(self, tenant: str) -> float:
        """The tenant's virtual token counter (it follows the other tenants: a scheduling figure only)."""
        return self._counters.get(tenant, 0.0)

    def grammar_cpu(self, tenant: str) -> float:
        """CPU seconds the tenant's constraints cost the executors so far (its own history)."""
        return self._shared.grammar_cpu.get(tenant, 0.0)

    def charged(self, tenant: str) -> float:
        """The weighted tokens charged to the tenant so far: its own history, whatever the others do."""
        return self._shared.charged.get(tenant, 0.0)
