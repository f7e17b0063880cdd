"""Requests that no executor that is up can hold, held by the cluster until one can, for up to ``unplaced_timeout``
seconds each: then they end with an error (``expire``). At shutdown every one ends (``fail``); a client that went
away takes its own out (``abort``); an executor that comes up takes them all (``take_all``) to place them again.
The cluster's placement (cluster.py) decides when a request is held here (``hold``)."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from scheduler_svc import metrics
from scheduler_svc.outputs import Ending, deliver, final
from scheduler_svc.request import Finish, Request


class UnplacedQueue:
    """Held requests, oldest first, each with its deadline (``time.monotonic``)."""

    def __init__(self, timeout: float, log) -> None:
        self.timeout = timeout  # seconds a request is held before it ends
        self._log = log
        self._held: deque[tuple[Request, float]] = deque()

    def __len__(self) -> int:
        return len(self._held)

    def hold(self, req: Request, front: bool = False, deadline: float | None = None) -> None:
        """Holds a request no executor can take now: at the front (a moved one, ahead of new work) or the back, until
        ``deadline`` (None: the timeout from now)."""
        entry = (req, deadline if deadline is not None else time.monotonic() + self.timeout)
        if front:
            self._held.appendleft(entry)
        else:
            self._held.append(entry)
        metrics.UNPLACED.set(len(self._held))
        self._log.warning("request_unplaced", request_id=req.client_id, timeout_s=self.timeout,
                          hint="no executor that is up can hold it")

    def take_all(self) -> list[tuple[Request, float]]:
        """Every held request with its deadline, oldest first, none held any more (to be placed again)."""
        taken, self._held = list(self._held), deque()
        return taken

    def queued(self, tenant_id: str) -> tuple[int, int]:
        """Held requests: the tenant's and everyone's."""
        if not self._held:
            return 0, 0
        return sum(1 for r, _ in self._held if r.tenant == tenant_id), len(self._held)

    def abort(self, group: str) -> None:
        """A client went away: its requests are no longer held (nothing is said to it)."""
        kept = deque((r, t) for r, t in self._held if r.group != group)
        if len(kept) != len(self._held):
            self._held = kept
            metrics.UNPLACED.set(len(self._held))

    def expire(self, now: float) -> None:
        """Ends the requests held past their deadline, with an error."""
        if self._held and self._held[0][1] <= now:
            self.fail(lambda deadline: deadline <= now,
                      f"no executor that can hold this request was available for {self.timeout:g}s")

    def fail(self, expired: Callable[[float], bool], error: str) -> None:
        """Ends the held requests whose deadline ``expired`` says so, with ``error``."""
        kept = deque()
        for req, deadline in self._held:
            if expired(deadline):
                deliver([(req, final(req, Finish.ABORT, error=error, ending=Ending.UNPLACED))])
            else:
                kept.append((req, deadline))
        self._held = kept
        metrics.UNPLACED.set(len(self._held))
