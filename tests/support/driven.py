"""A planner driven in this process through its wire, as an Engine drives it over gRPC (scheduler_svc/engine.py):
``schedule()`` is the next StepPlan (``StepStream.next_plan``), ``process(result)`` applies a StepResult. The tests of
the planner, the in-process server and the benchmarks' planning loops use it; what the engine adds (the network,
timings, draining) is not here."""

from __future__ import annotations

from scheduler_svc.pages import PagePool
from scheduler_svc.policy import PreemptionCosts
from scheduler_svc.scheduler import Scheduler
from scheduler_svc.step_stream import StepStream


class Driven:
    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.stream = StepStream(scheduler)  # the wire

    # ---- the loop ------------------------------------------------------------------------------
    def schedule(self):
        return self.stream.next_plan()

    def process(self, result):
        return self.stream.apply(result)

    def malformed(self, result, vocab_size: int = 0) -> str:
        return self.stream.malformed(result, vocab_size)

    @property
    def has_work(self) -> bool:
        return self.stream.has_work

    def check_integrity(self) -> None:
        self.stream.check_integrity()

    # ---- the executor goes away or comes back --------------------------------------------------
    def evacuate(self, keep_cache: bool = False):
        return self.stream.lost(keep_cache)

    def fail_all(self, error: str):
        return self.stream.fail_all(error)

    def drained(self):
        return self.stream.drained()

    def reconnected(self, num_pages: int | None = None, block_size: int | None = None,
                    num_host_pages: int | None = None, costs: PreemptionCosts | None = None, kept: bool = True) -> None:
        """The executor is back (the same geometry unless given; ``kept``: with its pages), as engine_link.adopt
        does."""
        s = self.scheduler
        snap = s.snapshot()
        planner = s.reconnected(snap.pool.num_pages if num_pages is None else num_pages,
                                snap.block_size if block_size is None else block_size,
                                snap.host.num_pages if num_host_pages is None else num_host_pages,
                                costs, kept)
        if planner is not s:
            self.scheduler, self.stream = planner, StepStream(planner)

    # ---- the planner's parts -------------------------------------------------------------------
    @property
    def pool(self) -> PagePool:
        return self.scheduler.kv.pool

    @property
    def host(self) -> PagePool | None:
        return self.scheduler.kv.host

    @property
    def running(self):
        return self.scheduler.queues.running

    @property
    def waiting(self):
        return self.scheduler.queues.waiting

    @property
    def swapped(self):
        return self.scheduler.queues.swapped

    @property
    def requests(self):
        return self.scheduler.queues.requests

    @property
    def tenants(self):
        return self.scheduler.ledger.tenants

    def stats(self, tenant: str):
        return self.scheduler.limits.stats(tenant)

    def __getattr__(self, name: str):  # add, abort, live_requests, snapshot, set_tenants, counters, config, kv, ...
        return getattr(self.scheduler, name)


def driven(*args, **kwargs) -> Driven:
    """``Scheduler(*args, **kwargs)`` driven in this process."""
    return Driven(Scheduler(*args, **kwargs))
