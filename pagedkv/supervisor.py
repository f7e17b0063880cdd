"""``pagedkv serve``'s supervisor: starts its children (in order, or all at once), keeps them running, and stops
them in reverse order.

- Start: each child in list order, each waited for until ``ready()``; or, with ``start_together`` (``pagedkv
  serve``), every child at once, each then waited for until ``ready()``: the scheduler imports and loads its
  tokenizer while the executor loads the model, and connects once the executor listens. A child that exits
  before the children listed ahead of it are ready (the scheduler gave up waiting for a slow executor) is
  started again once they are; one that exits after that fails the start.
- Each child (``pagedkv.supervised_child``) runs in a session of its own, ignores SIGHUP until it handles it, dies
  with the supervisor (Linux's parent-death signal), and is ready once ``ready()`` holds and its session listens on
  its ``ports``; whatever it left in its session is ended once it is gone.
- SIGHUP: forwarded to the ``reload`` child (the scheduler re-reads its tenants file, re-resolves executors);
  the supervisor keeps running.
- A child that exits on its own is restarted after a backoff: ``backoff_start`` seconds, doubling to
  ``backoff_max``, back to the start once a child has stayed up ``stable_after`` seconds. A restarted child is
  polled with ``ready()`` again and logs ``child_ready`` once it is (as at the first start).
- SIGINT/SIGTERM: SIGTERM to each child in reverse order (the scheduler first), each given its ``stop_timeout``
  (its own graceful drain plus a margin) before SIGKILL. A second SIGINT/SIGTERM stops at once: the children
  get a second SIGTERM (their own stop-now path) and ``NOW_GRACE`` seconds.

No grpc at import: the unit tests drive this module with small stand-in children.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable

from pagedkv.supervised_child import Child, ChildSpec, describe_exit

POLL = 0.1  # seconds between looks at the children
NOW_GRACE = 5.0  # seconds children get after a second stop signal before SIGKILL


class StartError(RuntimeError):
    pass


class Supervisor:
    def __init__(self, specs: list[ChildSpec], log, *, reload: str = "", env: dict[str, str] | None = None,
                 backoff_start: float = 1.0, backoff_max: float = 30.0, stable_after: float = 60.0,
                 start_together: bool = False) -> None:
        env = dict(os.environ if env is None else env)
        self.children = [Child(s, env, backoff_start) for s in specs]
        self.log = log
        self.reload = reload
        self.start_together = start_together
        self.backoff_start, self.backoff_max, self.stable_after = backoff_start, backoff_max, stable_after
        self.stopping = False  # the first SIGINT/SIGTERM
        self.now = False  # the second one: stop at once
        self.hup = False  # a SIGHUP to forward

    def child(self, name: str) -> Child:
        return next(c for c in self.children if c.name == name)

    def run(self, on_ready: Callable[[], None] = lambda: None) -> int:
        """Until SIGINT/SIGTERM (or a failed start): 0 when every child started and stopped cleanly."""
        signals = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
        previous = {sig: signal.signal(sig, self._on_signal) for sig in signals}
        ok = False
        errors = tempfile.mkdtemp(prefix="pagedkv-serve-errors-")
        for child in self.children:
            child.error_file = os.path.join(errors, f"{child.name}.error")
        try:
            if self._start_all():
                on_ready()
                self._supervise()
            ok = True
        except StartError as err:
            self.log.error("serve_start_failed", error=str(err))
            print(f"error: {err}", file=sys.stderr, flush=True)
        finally:
            clean = self._shutdown()
            shutil.rmtree(errors, ignore_errors=True)
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        return 0 if ok and clean else 1

    # ---- signals -----------------------------------------------------------------------------------
    def _on_signal(self, signum: int, _frame) -> None:
        if signum == signal.SIGHUP:
            self.hup = True
            return
        if self.stopping:
            self.now = True
        self.stopping = True

    def _forward_hup(self) -> None:
        self.hup = False
        if not self.reload:
            return
        target = self.child(self.reload)
        if target.running():
            assert target.proc is not None
            target.signal(signal.SIGHUP)
            self.log.info("sighup_forwarded", child=target.name, pid=target.proc.pid)
        else:
            self.log.warning("sighup_not_forwarded", child=target.name,
                             reason="not running (it reads its configuration when it restarts)")

    # ---- start and supervise -----------------------------------------------------------------------
    def _start_all(self) -> bool:
        """Each child in order, until ready; False when a stop signal came first."""
        if self.start_together:
            return self._start_together()
        for i, child in enumerate(self.children):
            if self.stopping:
                return False
            child.start()
            assert child.proc is not None
            self.log.info("child_started", child=child.name, pid=child.proc.pid)
            deadline = time.monotonic() + child.spec.ready_timeout
            try:
                while not child.is_ready():
                    if self.stopping:
                        return False
                    if child.proc.poll() is not None:
                        raise StartError(child.start_failure())
                    if time.monotonic() > deadline:
                        raise StartError(f"{child.name} not ready after {child.spec.ready_timeout:.0f}s")
                    for started in self.children[:i]:  # one that crashed meanwhile is restarted as usual
                        self._look_after(started, time.monotonic())
                    time.sleep(POLL)
            finally:
                child.spec.close()
        return True

    def _start_together(self) -> bool:
        """Every child at once, then until each is ready; False when a stop signal came first."""
        for child in self.children:
            self._first_start(child)
        waiting = list(self.children)  # not ready yet, in list order
        deadline = {c.name: c.started_at + c.spec.ready_timeout for c in self.children}
        try:
            while waiting:
                if self.stopping:
                    return False
                now = time.monotonic()
                for child in list(waiting):
                    if self._look_at_starting(child, waiting[:waiting.index(child)], now, deadline):
                        waiting.remove(child)
                for child in self.children:  # one that crashed after it was ready is restarted as usual
                    if child not in waiting:
                        self._look_after(child, now)
                time.sleep(POLL)
        finally:
            for child in waiting:
                child.spec.close()
        return True

    def _look_at_starting(self, child: Child, ahead: list[Child], now: float, deadline: dict[str, float]) -> bool:
        """True once ``child`` is ready. ``ahead``: the children listed before it that are not ready yet."""
        if ahead:  # its ready_timeout counts from when they are ready (or from its start, if later)
            deadline[child.name] = max(deadline[child.name], now + child.spec.ready_timeout)
        if child.proc is None:  # it exited early: it starts again once the children ahead are ready
            if not ahead:
                child.restarts += 1
                child.start()
                assert child.proc is not None
                deadline[child.name] = child.started_at + child.spec.ready_timeout
                self.log.info("child_restarted", child=child.name, pid=child.proc.pid, restarts=child.restarts)
            return False
        if child.is_ready():
            child.spec.close()
            self.log.info("child_ready", child=child.name, pid=child.proc.pid, seconds=round(now - child.started_at, 2))
            return True
        if child.proc.poll() is not None:
            if not ahead:
                raise StartError(child.start_failure())
            self.log.warning("child_exited", child=child.name, pid=child.proc.pid,
                             status=describe_exit(child.proc.returncode),
                             restart_when=" and ".join(c.name for c in ahead) + " ready")
            child.end_leftovers(self.log)
            child.proc = None
        elif now > deadline[child.name]:
            raise StartError(f"{child.name} not ready after {child.spec.ready_timeout:.0f}s")
        return False

    def _first_start(self, child: Child) -> None:
        child.start()
        assert child.proc is not None
        self.log.info("child_started", child=child.name, pid=child.proc.pid)

    def _supervise(self) -> None:
        while not self.stopping:
            if self.hup:
                self._forward_hup()
            now = time.monotonic()
            for child in self.children:
                self._look_after(child, now)
            time.sleep(POLL)

    def _look_after(self, child: Child, now: float) -> None:
        if child.awaiting_ready and child.proc is not None and child.proc.poll() is None and child.is_ready():
            child.awaiting_ready = False
            child.spec.close()
            self.log.info("child_ready", child=child.name, pid=child.proc.pid, restarts=child.restarts,
                          seconds=round(now - child.started_at, 2))
        if child.proc is not None and child.proc.poll() is not None:
            up_for = now - child.started_at
            if up_for >= self.stable_after:
                child.backoff = self.backoff_start
            delay = child.backoff
            child.backoff = min(child.backoff * 2, self.backoff_max)
            child.restart_at = now + delay
            self.log.error("child_exited", child=child.name, pid=child.proc.pid,
                           status=describe_exit(child.proc.returncode), up_for_s=round(up_for, 1),
                           restart_in_s=round(delay, 2), restarts=child.restarts)
            child.end_leftovers(self.log)
            child.proc = None
        if child.proc is None and child.restart_at is not None and now >= child.restart_at:
            child.restarts += 1
            child.start()
            child.awaiting_ready = True
            assert child.proc is not None
            self.log.info("child_restarted", child=child.name, pid=child.proc.pid, restarts=child.restarts)

    # ---- stop --------------------------------------------------------------------------------------
    def _shutdown(self) -> bool:
        """Every running child, in reverse order; True when each exited 0 within its bound."""
        clean = True
        for child in reversed(self.children):
            child.restart_at = None
            if child.proc is not None:
                clean = self._stop(child) and clean
                child.end_leftovers(self.log)
        return clean

    def _stop(self, child: Child) -> bool:
        proc = child.proc
        assert proc is not None
        signalled = time.monotonic()
        if proc.poll() is not None:  # it had exited on its own (a restart was due): not part of this stop
            self.log.warning("child_exited", child=child.name, pid=proc.pid, status=describe_exit(proc.returncode))
            return True
        self.log.info("child_stopping", child=child.name, pid=proc.pid, timeout_s=child.spec.stop_timeout)
        child.signal(signal.SIGTERM)
        deadline = signalled + child.spec.stop_timeout
        urged = False
        while proc.poll() is None:
            now = time.monotonic()
            if self.now and not urged and now - signalled > 0.3:  # its own second signal: stop now
                urged = True
                child.signal(signal.SIGTERM)
                deadline = min(deadline, now + NOW_GRACE)
                self.log.warning("child_stopping_now", child=child.name, pid=proc.pid, timeout_s=NOW_GRACE)
            if now >= deadline:
                self.log.error("child_killed", child=child.name, pid=proc.pid,
                               reason=f"not stopped {deadline - signalled:.0f}s after SIGTERM")
                proc.kill()
                proc.wait()
                return False
            time.sleep(0.05)
        self.log.info("child_stopped", child=child.name, pid=proc.pid, status=describe_exit(proc.returncode),
                      seconds=round(time.monotonic() - signalled, 1))
        return proc.returncode in (0, -signal.SIGTERM)  # -SIGTERM: it was still starting (no handler yet)
