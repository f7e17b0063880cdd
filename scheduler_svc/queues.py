"""Where each live request of one executor is: waiting, running or swapped, and the map of all of them.

``RequestQueues`` is the one owner of those lists and the only place a request's ``status`` changes. Its methods
are the transitions::

    enqueue ──▶ WAITING ──admit──▶ RUNNING ──preempt(swap)──▶ SWAPPED ──swap_in──▶ RUNNING
                   ▲                  │  └──preempt(recompute)──▶ WAITING (front of its tenant's queue)
                   │                  └──fork──▶ n children RUNNING in the parent's place (the parent FINISHED)
    any ──finish──▶ FINISHED (gone)      any ──detach──▶ WAITING (gone: placed on another executor)

A transition moves the request between lists, sets its status and, when the executor knew the request (it was
running, or its table was sent), records its id for the executor to drop with the next plan (``take_forget``).
What else goes with it (pages, fair-share service) is the planner's (scheduler.py), which calls these. The lists
are readable by anyone who holds the queues (``running``, ``swapped``, ``waiting``, ``requests``); nobody else
changes them.
"""

from __future__ import annotations

from collections import deque

from scheduler_svc.request import Finish, Request, Status
from scheduler_svc.tenant_ledger import TenantLedger
from scheduler_svc.wait_queue import WaitQueue


class RequestQueues:
    def __init__(self, fair: bool, ledger: TenantLedger, by_priority: bool = False) -> None:
        """``fair``: the wait queue admits by weighted service (VTC), counted in the ``ledger``'s (every executor's);
        a tenant that comes back from idle starts at the others' level (no credit banked while away).
        ``by_priority``: each tenant's waiting requests in priority order (--scheduling-policy priority)."""
        self._fair = fair
        self._ledger = ledger
        self._waiting = WaitQueue(fair, lambda t: ledger.tenants.get(t).weight, ledger.service, by_priority)
        self._running: list[Request] = []  # in plan order
        self._swapped: deque[Request] = deque()  # in swap-out order
        self._requests: dict[str, Request] = {}
        self._forget: list[str] = []  # ids of requests the executor drops with the next plan

    # ---- reads ---------------------------------------------------------------------------------
    @property
    def waiting(self) -> WaitQueue:
        """New and recompute-preempted requests, in fair order, each tenant's in priority order under the priority
        policy (read it; the charges are the planner's)."""
        return self._waiting

    @property
    def running(self) -> list[Request]:
        return self._running

    @property
    def swapped(self) -> deque[Request]:
        return self._swapped

    @property
    def requests(self) -> dict[str, Request]:
        """Every live request by its internal id."""
        return self._requests

    def __bool__(self) -> bool:
        return bool(self._requests)

    @property
    def has_forget(self) -> bool:
        return bool(self._forget)

    def running_adapters(self) -> set[str]:
        """The LoRA adapters running requests use (their slots may not change)."""
        return {r.adapter for r in self._running if r.adapter}

    def seats(self) -> dict[str, int]:
        """Sequences running per tenant (a parent that has not forked holds n)."""
        seats: dict[str, int] = {}
        for r in self._running:
            seats[r.tenant] = seats.get(r.tenant, 0) + r.n
        return seats

    def active_tenants(self) -> set[str]:
        """Tenants with a request running, waiting or swapped here."""
        return {r.tenant for r in self._running} | set(self._waiting.backlogged()) | {r.tenant for r in self._swapped}

    def has_tenant(self, tenant: str) -> bool:
        return any(r.tenant == tenant for r in self._requests.values())

    def counts(self, tenant: str) -> tuple[int, int, int]:
        """The tenant's requests (running, waiting, swapped)."""
        return (sum(1 for r in self._running if r.tenant == tenant), self._waiting.tenant_len(tenant),
                sum(1 for r in self._swapped if r.tenant == tenant))

    # ---- transitions ---------------------------------------------------------------------------
    def enqueue(self, req: Request, front: bool = False) -> None:
        """A new request, or one moved here from another executor (front: ahead of new work)."""
        t = req.tenant
        if self._fair and not self._waiting.tenant_len(t) and not any(r.tenant == t for r in self._running):
            self._waiting.lift(t, self._ledger.active())  # no credit banked while idle
        self._requests[req.request_id] = req
        req.status = Status.WAITING
        if front:
            self._waiting.appendleft(req)
        else:
            self._waiting.append(req)

    def admit(self, req: Request) -> None:
        self._waiting.remove(req)
        req.status = Status.RUNNING
        self._running.append(req)

    def swap_in(self, req: Request) -> None:
        self._swapped.remove(req)
        req.status = Status.RUNNING
        self._running.append(req)

    def preempt(self, req: Request, swapped: bool, now: int) -> None:
        """A running request gives up its pages: to the swapped list, or back to the front of its tenant's queue
        (it is recomputed)."""
        self._running.remove(req)
        if swapped:
            req.status = Status.SWAPPED
            req.swapped_at = now
            self._swapped.append(req)
        else:
            req.status = Status.WAITING
            self._waiting.appendleft(req)
        self._forget.append(req.request_id)

    def fork(self, parent: Request, children: list[Request]) -> None:
        """The children run in the parent's place; the parent is done (it computed their shared prompt)."""
        at = self._running.index(parent)
        for child in children:
            child.status = Status.RUNNING
            self._requests[child.request_id] = child
        self._running[at:at + 1] = children
        parent.status = Status.FINISHED
        self._requests.pop(parent.request_id, None)
        self._forget.append(parent.request_id)

    def finish(self, req: Request, finish: Finish) -> Status:
        """The request ended; returns where it was."""
        was = self._leave(req)
        req.status = Status.FINISHED
        req.finish = finish
        return was

    def detach(self, req: Request) -> Status:
        """The request leaves for another executor (it waits there); returns where it was."""
        was = self._leave(req)
        req.status = Status.WAITING
        return was

    def _leave(self, req: Request) -> Status:
        was = req.status
        if was is Status.RUNNING:
            self._running.remove(req)
        elif was is Status.SWAPPED:
            self._swapped.remove(req)  # (the executor forgot it when it was swapped out)
        elif was is Status.WAITING:
            self._waiting.remove(req)
        self._requests.pop(req.request_id, None)
        if was is Status.RUNNING or (was is Status.WAITING and req.num_pages_sent >= 0):
            self._forget.append(req.request_id)
        if self._fair and not self._ledger.has_requests(req.tenant):
            self._waiting.went_idle(req.tenant)
        return was

    # ---- what the executor drops -----------------------------------------------------------------
    def take_forget(self) -> list[str]:
        """The ids the executor drops with the next plan (they go with it)."""
        forget, self._forget = self._forget, []
        return forget

    def forget_again(self, ids: list[str]) -> None:
        """A rejected plan's ids: the executor dropped none of them; they go first with the next."""
        self._forget[:0] = ids

    def reset_forget(self) -> None:
        """The executor's request state is gone: nothing to tell it."""
        self._forget = []

    # ---- integrity -----------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Each live request is in the list its status says, once; waiting ones hold no pages, running ones no host
        pages, swapped ones no device pages."""
        for r in self._waiting:
            assert r.status is Status.WAITING, f"waiting request {r.request_id} is {r.status.value}"
            assert not r.page_table and not r.host_table, f"waiting request {r.request_id} holds pages"
        for r in self._running:
            assert r.status is Status.RUNNING, f"running request {r.request_id} is {r.status.value}"
            assert not r.host_table, f"running request {r.request_id} holds host pages"
        for r in self._swapped:
            assert not r.page_table and r.status is Status.SWAPPED, f"swapped request {r.request_id} holds device pages"
        assert len(self._running) + len(self._waiting) + len(self._swapped) == len(self._requests), (
            "request lists disagree")
