"""The planner's part of its executor's lifecycle: a request taken away to another executor (``detach``), and every
live request given back when the executor is gone or drained (``evacuate``). A base of ``Scheduler`` (scheduler.py),
kept apart so that the planner's module stays within its size."""

from __future__ import annotations

from typing import TYPE_CHECKING

from scheduler_svc.plan_view import uncount
from scheduler_svc.request import Finish, Output, Request
from scheduler_svc.step import InFlight, PageOps

if TYPE_CHECKING:
    from scheduler_svc.kv_manager import KVManager
    from scheduler_svc.queues import RequestQueues
    from scheduler_svc.retention import KvRetention

Outputs = list[tuple[Request, Output]]


class ExecutorLifecycle:
    """Uses the planner's ``queues``, ``kv``, ``retained``, ``_deferred``, ``finish`` and ``live_requests``."""

    queues: RequestQueues
    kv: KVManager
    retained: KvRetention
    _deferred: Outputs

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
            uncount(sent.scheduled)
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
