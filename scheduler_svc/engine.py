"""One executor's loop: plan a step, send it, apply the result, stream outputs to clients. Each executor has its
own ``Engine``, with its ``Scheduler`` (the planner), its ``StepStream`` (the wire: plans in flight, resends) and its
Run stream. With async scheduling (the default) step N+1's plan goes out before step N's result is read, so the
executor finds it waiting; planning, result processing and client streaming run while the executor computes. The
``Cluster`` places requests on the engines and moves them when an executor fails or drains; an engine reaches back
only through the callbacks in ``EngineHooks`` (engine.py does not import cluster.py).

States::

    connecting ──Describe + Run──▶ up ──step fails / stream ends──▶ down ──reconnect──▶ up
                                    │                                 ▲
                                    └──executor says draining──▶ draining ──no requests left──┘
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

from scheduler_svc import metrics
from scheduler_svc.constraint_hold import ConstraintHold
from scheduler_svc.engine_link import join
from scheduler_svc.engine_types import EngineHooks, EngineInfo, State
from scheduler_svc.executor_client import ExecutorClient, ExecutorUnavailable
from scheduler_svc.grammar_gate import GrammarGate
from scheduler_svc.outputs import deliver
from scheduler_svc.plan_clock import StepClock, wait_to_plan
from scheduler_svc.request import Request, Status
from scheduler_svc.scheduler import Scheduler
from scheduler_svc.step_stream import StepStream

RECONNECT_POLL = 2.0  # seconds one reconnect attempt waits for the executor (engine_link.join)
SYNC_AFTER_REJECTION = 64  # steps planned one at a time after the executor rejected a plan
IDLE_CHECK_AFTER = 0.05  # seconds idle before the page accounting is checked


class Engine:
    def __init__(self, hooks: EngineHooks, client: ExecutorClient, log, check_every_step: bool = False,
                 drain_timeout: float = 30.0, async_scheduling: bool = True,
                 grammars: GrammarGate | None = None) -> None:
        self.hooks = hooks
        self.hold = ConstraintHold(self, grammars or GrammarGate())  # constrained requests until the grammar is here
        self.client = client
        self.address = client.address
        self.log = log.bind(executor=client.address)
        self.check_every_step = check_every_step
        self.drain_timeout = drain_timeout
        self._scheduler: Scheduler | None = None
        self._stream: StepStream | None = None  # the wire to it (one per planner)
        self._state = State.CONNECTING
        self._info = EngineInfo()  # the executor on the other end (its Describe) and the counts
        self.vocab_size = 0  # the executor's (Describe): a sampled token outside it is a malformed result
        self.wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.drain_deadline = 0.0
        self._removed = False  # no longer configured: drain, then stop for good
        self.stopping = False  # stop() was called: the loop ends at its next turn
        self._counted: dict[str, int] = {}
        # Async scheduling: the next plan is built and sent while the executor runs the last one, so the
        # executor finds it waiting when it ends a step (plans in flight: at most 2; 1 without).
        self.depth = 2 if async_scheduling else 1
        # After a rejected plan, plans go one at a time for a while: a rejection with the next plan in flight can
        # only drop the stream, and a request the executor keeps refusing must reach the resend protocol's limit
        # (MAX_PLAN_RETRIES, then it ends with the error) instead of being recomputed forever.
        self.sync_steps = 0
        self.last_read_at = 0.0
        self.clock = StepClock()  # when the step in flight should end: the next plan is built just before

    # ---- what the cluster reads ---------------------------------------------------------------
    @property
    def scheduler(self) -> Scheduler | None:
        """This executor's planner (None until it first answered)."""
        return self._scheduler

    @property
    def state(self) -> State:
        return self._state

    def info(self) -> EngineInfo:
        return replace(self._info)  # (a copy)

    @property
    def removed(self) -> bool:
        """No longer configured: it drains, then stops for good."""
        return self._removed

    # ---- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"engine {self.address}")

    async def stop(self) -> None:
        # NOTE: on Python 3.11 asyncio.wait_for can swallow a cancellation that lands as its inner await completes (the
        # step's read, say): a single cancel() may never end the loop (seen as a scheduler whose shutdown hung with an
        # idle event loop). So the loop also checks a flag, and the cancel is repeated until the task is done.
        self.stopping = True
        self.hold.stop()
        self.wake.set()
        while self._task is not None and not self._task.done():
            self._task.cancel()
            await asyncio.wait({self._task}, timeout=1.0)
        if self._task is not None and not self._task.cancelled() and self._task.exception() is not None:
            self.log.error("engine_stopped_with_error", error=repr(self._task.exception()))
        await self.client.close()

    def check_integrity(self) -> None:
        """Every page accounted for, and the plans in flight agree with what the requests count."""
        self._stream.check_integrity()

    def wake_up(self) -> None:
        """Something changed that the loop must look at (new limits, a new request)."""
        self.wake.set()

    @property
    def stopped(self) -> bool:
        """The loop has ended (removed and drained, or stopped)."""
        return self._task is not None and self._task.done()

    @property
    def accepts(self) -> bool:
        """New requests may be placed here."""
        return self._state is State.UP and not self._removed

    @property
    def executor_id(self) -> str:
        """The executor process it is connected to (its Describe's id; another after a restart)."""
        return self._info.executor_id

    def add_request(self, req: Request, front: bool = False) -> None:
        if self.hold.holds(req, front):  # (its executor does not hold its grammar yet: added once it does)
            return
        self._scheduler.add(req, front=front)
        self._info.num_placed += 1
        self.wake.set()

    def abort(self, group: str) -> None:
        self.hold.abort(group)
        if self._scheduler is not None:
            self._scheduler.abort(group)
            self.wake.set()

    async def _run(self) -> None:
        while not self.stopping:
            if self._state in (State.CONNECTING, State.DOWN):
                if self._removed:
                    if self._stream is not None:  # (a lost executor's pages stayed findable for its return: no more)
                        deliver(self._stream.drained())
                    return
                await self._connect()
                continue
            try:
                await self._iteration()
            except asyncio.CancelledError:
                raise
            except Exception as err:  # noqa: BLE001 - a bug must not leave every client stream hanging
                self.log.exception("engine_error")
                self._internal_error(f"internal error in the scheduler: {err!r}")

    async def _connect(self) -> None:
        """Until the executor answers and may serve (or this engine is removed), then up: engine_link.join."""
        joined = await join(self.client, self.hooks, self.log, self._scheduler, self._info, self._state,
                            lambda: self._removed or self.stopping, RECONNECT_POLL, on_stream_end=self.wake.set)
        if joined is None:
            return  # (refused or removed: the loop's next turn decides)
        if joined.planner is not self._scheduler:
            self._scheduler, self._stream = joined.planner, StepStream(joined.planner)
            joined.planner.clock = self.clock
        self._state, self._info, self.vocab_size = State.UP, joined.info, joined.describe.vocab_size
        metrics.adapter_pages(self.address, [(a.name, a.num_pages) for a in joined.describe.adapters if a.slot >= 0])
        self.hooks.up(self)

    # ---- one step ------------------------------------------------------------------------------
    async def _iteration(self) -> None:
        await self.wake.wait()
        stream, client = self._stream, self.client
        if stream.in_flight and client.has_stream and client.stream_ended:
            await self._receive()  # results the executor sent before its stream ended are read first
            return
        if client.stream_ended:
            if self._state is State.DRAINING and not self._scheduler.live_requests():
                self._drained()  # the executor ended the stream itself once nothing was left on it
            else:
                self._executor_lost("the executor closed its Run stream")
            return
        if self._state is State.DRAINING or self._removed:
            if stream.in_flight:  # nothing moves while a plan computes for it
                await self._receive()
                return
            if self._drain_step():
                return
        if self.depth > 1 and not self.sync_steps and await wait_to_plan(self.clock, stream, client, self.last_read_at):
            await self._receive()  # (the step in flight ended before the next plan's time: planned after it)
            return
        t0 = time.perf_counter()
        plan, outputs = stream.next_plan(rides=not self.sync_steps)
        deliver(outputs)
        self._counted = metrics.count_since(self._counted, self._scheduler.snapshot())
        if plan is None:
            if stream.in_flight:
                await self._receive()
            elif not stream.has_work:
                self.wake.clear()
                self.hooks.gauges(True)
                try:  # (a request that comes as the last one ends is planned first: the check takes milliseconds)
                    await asyncio.wait_for(self.wake.wait(), IDLE_CHECK_AFTER)
                except asyncio.TimeoutError:
                    stream.check_integrity()  # idle a while: every page must be accounted for
            else:
                await asyncio.sleep(0.001)
            return
        t1 = time.perf_counter()
        stream.sent(t1, t1 - t0)
        try:
            await client.send(plan)
        except ExecutorUnavailable as err:
            self._executor_lost(str(err))
            return
        if stream.in_flight >= (1 if self.sync_steps else self.depth):
            await self._receive()

    async def _receive(self) -> None:
        """Reads and applies the result of the oldest plan in flight."""
        stream = self._stream
        sent = stream.oldest
        step_id, sent_at = sent.step_id, sent.sent_at
        try:
            result = await self.client.receive(step_id)
        except ExecutorUnavailable as err:
            self._executor_lost(str(err))
            return
        problem = stream.malformed(result, self.vocab_size)
        if problem:  # (the plans in flight are void: its requests are recomputed, here or elsewhere)
            self._executor_lost(f"the executor's result for step {step_id} is malformed: {problem}")
            return
        if result.error:
            self.sync_steps = SYNC_AFTER_REJECTION
            if stream.in_flight > 1 or sent.rides:
                # The plan after it was built on what this one would have done (or this one's requests share pages
                # it was to compute: rides.py): void. As for a lost stream, the requests are recomputed (the
                # executor forgets them all when the stream is dropped).
                ahead = f"with step {step_id + 1} in flight" if stream.in_flight > 1 else "(requests riding on it)"
                self._executor_lost(f"the executor rejected step {step_id} {ahead}: {result.error}")
                return
        elif self.sync_steps:
            self.sync_steps -= 1
        t2 = time.perf_counter()
        started = max(sent_at, self.last_read_at)  # (with async scheduling: when the executor could start it)
        self.last_read_at = t2
        self.clock.observe_step(sent, result, started, t2)
        deliver(stream.apply(result))
        if result.draining and self._state is State.UP:
            self._start_drain("the executor is shutting down")
        if self.check_every_step:
            stream.check_integrity()
        self._info.steps += 1
        self.hooks.gauges(False)
        metrics.STEP_SECONDS.labels("plan").observe(sent.plan_seconds)
        metrics.STEP_SECONDS.labels("process").observe(time.perf_counter() - t2)
        metrics.STEP_SECONDS.labels("executor").observe(t2 - sent_at)
        metrics.STEP_SECONDS.labels("prepare").observe(result.timings.prepare_ms / 1e3)
        metrics.STEP_SECONDS.labels("forward").observe(result.timings.forward_ms / 1e3)
        metrics.STEP_SECONDS.labels("rpc").observe(max(0.0, t2 - started - result.timings.total_ms / 1e3))
        metrics.STEP_SECONDS.labels("executor_idle").observe(result.timings.wait_ms / 1e3)

    # ---- leaving: drain or failure ---------------------------------------------------------------
    def _start_drain(self, why: str) -> None:
        self._state = State.DRAINING
        self.drain_deadline = time.monotonic() + self.drain_timeout
        snap = self._scheduler.snapshot()
        self.log.info("executor_draining", reason=why, running=snap.num_running,
                      queued=snap.num_waiting + snap.num_swapped, drain_timeout_s=self.drain_timeout)
        self.wake.set()

    def begin_removal(self) -> None:
        """The executor is no longer configured (DNS, executors file): drain it, then stop."""
        self._removed = True
        if self._state is State.UP:
            self._start_drain("no longer configured")
        self.wake.set()

    def _drain_step(self) -> bool:
        """Moves what has not started (and, past the deadline, everything) to other executors; running
        requests finish here meanwhile. Returns True once nothing is left and the stream is closed."""
        s = self._scheduler
        if self._state is State.UP:  # removed while up
            self._start_drain("no longer configured")
        overdue = time.monotonic() >= self.drain_deadline
        movable = [r for r in s.live_requests() if not r.aborted and (overdue or r.status is not Status.RUNNING)]
        if movable:
            for req in movable:
                s.detach(req)
            self._migrated(movable, "drain")
        if s.live_requests():
            return False
        self._drained()
        return True

    def _drained(self) -> None:
        """Nothing is left on a draining executor: close the stream (it exits) and forget its pages."""
        deliver(self._stream.drained())  # a process that comes back at this address starts empty
        self.client.drop()
        self._state = State.DOWN
        self.log.info("executor_drained", steps=self._info.steps)
        self.hooks.down(self)
        self.hooks.gauges(True)

    def _executor_lost(self, error: str) -> None:
        """The Run stream is lost: the requests move to the other executors (recomputed there: their state on
        the executor went with the stream). Published pages stay findable, but only once the executor is up
        again (nothing is placed here meanwhile): engine_link.adopt forgets them if another process answers."""
        self.client.drop()
        was = self._state
        self._state = State.DOWN
        if self._scheduler is None:
            return
        moved, ended = self._stream.lost(keep_cache=True)
        deliver(ended)
        try:
            self._stream.check_integrity()
        except AssertionError:
            self.log.exception("integrity_after_failure")
        if was is not State.DRAINING or moved:
            self.log.error("executor_failed", error=error, requests_moved=len(moved))
        self.hooks.down(self)  # (first: the moved requests are placed under the limits of the executors that serve)
        self._migrated(moved, "failure")
        self.hooks.gauges(True)

    def _internal_error(self, error: str) -> None:
        """A scheduler bug mid-step: which tokens reached which client is uncertain, so the requests on this
        executor end with the error instead of moving (a move could recompute a token no client saw)."""
        self.client.drop()  # the executor's request state goes with the stream
        self._state = State.DOWN
        if self._scheduler is not None:
            deliver(self._stream.fail_all(error))
            self.hooks.down(self)
        self.hooks.gauges(True)

    def _migrated(self, moved: list[Request], cause: str) -> None:
        if not moved:
            return
        self._info.num_migrated_out += len(moved)
        metrics.MIGRATIONS.labels(cause).inc(len(moved))
        self.log.info("requests_migrating", cause=cause, count=len(moved),
                      request_ids=[r.client_id for r in moved[:256]])
        self.hooks.relocate(moved, self)
