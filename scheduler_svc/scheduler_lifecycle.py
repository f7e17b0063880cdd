"""The planner's part of its executor's lifecycle: whether the executor serves (``serving``), the planner it gets when
it is back (``reconnected``), a plan it rejected (``rejected``), a request taken away to another executor
(``detach``), and every live request given back when the executor is gone or drained (``evacuate``). A base of
``Scheduler`` (scheduler.py), kept apart so that the planner's module stays within its size."""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeVar

from scheduler_svc.pages import tier_pools
from scheduler_svc.policy import PreemptionCosts, PreemptionPolicy
from scheduler_svc.request import Finish, Output, Request, Status
from scheduler_svc.step import InFlight, PageOps

if TYPE_CHECKING:
    from scheduler_svc.config import SchedulerConfig
    from scheduler_svc.kv_manager import KVManager
    from scheduler_svc.pages import PagePool
    from scheduler_svc.queues import RequestQueues
    from scheduler_svc.retention import KvRetention
    from scheduler_svc.snapshot import Counters
    from scheduler_svc.tenant_ledger import TenantLedger
    from scheduler_svc.tenant_limits import TenantLimits

Outputs = list[tuple[Request, Output]]
Planner = TypeVar("Planner", bound="ExecutorLifecycle")


class ExecutorLifecycle:
    """Uses the planner's parts (below), its ``finish`` and ``live_requests``, and its constructor (a new planner)."""

    config: SchedulerConfig
    queues: RequestQueues
    kv: KVManager
    retained: KvRetention
    limits: TenantLimits
    ledger: TenantLedger
    counters: Counters
    step_id: int
    _pool: PagePool
    _policy: PreemptionPolicy
    _eos_token_ids: list[int]
    _deferred: Outputs

    def reconnected(self: Planner, num_pages: int, block_size: int, num_host_pages: int,
                    costs: PreemptionCosts | None, kept: bool) -> Planner:
        """The executor is back (nothing live here): the planner for it from now on. ``kept``: the same process kept its
        pages (else the prefix cache forgets them all); ``costs``: its measured ones (None: as before). Another pool
        geometry gets a new planner that keeps the counters, the tenants' counts and the ledger."""
        assert not self.queues, "reconnected with live requests"
        if (num_pages, block_size, num_host_pages) == (self._pool.num_pages, self._pool.block_size,
                                                       self.kv.host.num_pages if self.kv.host else 0):
            if not kept:
                self.retained.clear()
                self.kv.forget_cached()
            if costs is not None:
                self._policy = PreemptionPolicy(self.config.preemption, costs)
            return self
        self.limits.leave()
        self.kv.forget_cached()  # (these pools go: nothing they held is findable any more)
        pool, host = tier_pools(num_pages, block_size, num_host_pages, self._pool.events)
        planner = type(self)(pool, self.config, self._eos_token_ids, host, costs or self._policy.costs, None,
                             self.ledger, self.counters, self.limits.stats_by_tenant)
        planner.step_id = self.step_id
        return planner

    def use_adapters(self: Planner, slots) -> None:
        """The executor's LoRA device slots (adapter_slots.py; None: it has none), as its Describe says they are."""
        self.adapters = slots
        self.limits.adapters = slots

    def serving(self, on: bool) -> None:
        """Whether this executor's pages count for its tenants' limits: while it serves (up or draining), not while
        it is down (then the quotas, reserves and fair shares are of the executors that serve)."""
        if on:
            self.limits.join()
        else:
            self.limits.leave()

    def rejected(self, sent: InFlight, ended: list[Request], error: str) -> Outputs:
        """The executor ran nothing of ``sent``: what it counted is taken back and the ids it told the executor to
        forget go again; ``ended`` (the requests the wire gave up on) end with the executor's error."""
        for req, n, samples in sent.scheduled:
            req.uncount(n, samples)
            if req.status is Status.RUNNING:  # (an ended request's count went with its pages)
                req.num_computed -= n
        self.queues.forget_again(sent.forget)
        return [(req, self.finish(req, Finish.ABORT, error=f"executor rejected plan: {error}")) for req in ended]

    def detach(self, req: Request) -> None:
        """Takes a live request away, to be placed on another executor (its KV recomputed there): its pages here are
        freed and the executor told to forget it. Only between steps (never while a plan holding it is in flight)."""
        assert not req.in_flight, f"{req.request_id}: detached while a plan in flight computes for it"
        self.queues.detach(req)
        self.kv.release(req)
        req.num_pages_sent = -1
        req.dropped_pending = []
        req.num_migrations += 1

    def evacuate(self, unanswered: list[InFlight], unconfirmed: list[PageOps], keep_cache: bool = False,
                 error: str = "") -> tuple[list[Request], Outputs]:
        """The executor is gone (or drained), and its pages with it; the plans ``unanswered`` never will be
        (``unconfirmed``: their page operations, and a rejected plan's). Its live requests come back to be placed
        elsewhere, oldest first (their samplers continue: draws are numbered by output position), aborted ones end;
        with ``error`` every live request ends with it. All pages return; the prefix cache forgets every page, unless
        ``keep_cache``: only the Run stream was lost, and the same process may come back with its pages (those that
        unconfirmed page operations were filling are forgotten: whether those ran is unknown)."""
        unsure = [*unconfirmed, self.kv.ops] if keep_cache else None
        for sent in unanswered:
            for req, n, samples in sent.scheduled:
                req.uncount(n, samples)
        for ops in [*unconfirmed, self.kv.take_ops()]:
            self.kv.confirm(ops)  # drops the host references they held
        live = self.live_requests()
        if error:
            ended, moved = [(r, self.finish(r, Finish.ABORT, error=error)) for r in live], []
        else:
            ended = [(r, self.finish(r, Finish.ABORT)) for r in live if r.aborted]
            moved = sorted((r for r in live if not r.aborted), key=lambda r: r.arrival)
            for req in moved:
                self.detach(req)
        ended += self._deferred
        self._deferred = []
        self.kv.take_ops()
        self.queues.reset_forget()
        if unsure is None:
            self.retained.clear()
            self.kv.forget_cached()
        else:
            self.kv.unpublish_written(unsure)
        return moved, ended
