"""The executor's gRPC servicer: Describe, and one Run stream of StepPlan -> StepResult at a time.

A Run stream carries the scheduler's session id (``pagedkv.wire.SESSION_HEADER``): pages keep their contents only
for the session that wrote them. The step itself is the runner's (runner.py); this module owns the stream: who is
attached, reading plans, writing results, draining.
"""

from __future__ import annotations

import asyncio
import time

import grpc
from google.protobuf.message import DecodeError

from executor_svc import metrics
from executor_svc.grammar import CompileLimit, ConstraintError
from executor_svc.lora.store import AdapterError
from executor_svc.runner import ModelRunner
from pagedkv.executor.v1 import executor_pb2 as pb
from pagedkv.executor.v1 import executor_pb2_grpc as pb_grpc
from pagedkv.wire import PAGES_FRESH, PAGES_HEADER, PAGES_KEPT, SESSION_HEADER

ATTACH_WAIT_S = 5.0  # a new Run stream waits this long for the previous one's handler to finish


def _in_flight(coro) -> asyncio.Task:
    """A grpc call operation as a task that nothing cancels. Cancelling a read or a write while Core still
    runs it frees the buffers Core writes into; left alone, it ends when the RPC ends. Its outcome is
    consumed here, so an unawaited one logs no "Task exception was never retrieved"."""
    task = asyncio.ensure_future(coro)
    task.add_done_callback(lambda t: t.cancelled() or t.exception())
    return task


class ExecutorService(pb_grpc.ExecutorServicer):
    def __init__(self, runner: ModelRunner, describe: pb.DescribeResponse, log) -> None:
        self.runner = runner
        self.describe = describe
        self.log = log
        self.busy = False
        self.draining = False
        # the Run-stream session (pagedkv.wire.SESSION_HEADER: one per scheduler process and executor link) whose KV
        # the pages hold
        self.session_id: str | None = None
        self.idle_drain = asyncio.Event()  # draining with no request left: end the Run stream
        self.detached = asyncio.Event()  # the Run stream ended (or there was none)
        self.detached.set()

    async def Describe(self, request, context):  # noqa: N802
        store = self.runner.adapters
        if store is not None:  # (run-time loads change the list, and pages in change the slots)
            del self.describe.adapters[:]
            self.describe.adapters.extend(store.describe())
        return self.describe

    async def LoadAdapter(self, request, context):  # noqa: N802
        """Reads a run-time adapter into host memory, on a thread (the step loop goes on meanwhile)."""
        store = self.runner.adapters
        if store is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this executor serves no LoRA adapters: start "
                                "it with --lora-root DIR to load adapters at run time")
        try:
            adapter = await asyncio.to_thread(store.add, request.name, request.path)
        except AdapterError as err:
            await context.abort(getattr(grpc.StatusCode, err.code), str(err))
        metrics.ADAPTER_PAGES.labels(adapter.name).set(adapter.num_pages)
        self.log.info("lora_adapter_loaded", adapter=adapter.name, rank=adapter.rank, bytes=adapter.num_bytes)
        return adapter

    async def UnloadAdapter(self, request, context):  # noqa: N802
        store = self.runner.adapters
        if store is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"adapter {request.name[:128]!r} is not loaded")
        in_use = sorted(rid for rid, st in self.runner.requests.items()
                        if st.adapter and store.stack.names[st.adapter - 1] == request.name)
        if in_use:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"adapter {request.name!r} is in use by "
                                f"{len(in_use)} request(s) here (e.g. {in_use[0]})")
        try:
            store.remove(request.name)
        except AdapterError as err:
            await context.abort(getattr(grpc.StatusCode, err.code), str(err))
        try:
            metrics.ADAPTER_PAGES.remove(request.name)
        except KeyError:
            pass
        self.log.info("lora_adapter_unloaded", adapter=request.name)
        return pb.UnloadAdapterResponse()

    async def CheckConstraint(self, request, context):  # noqa: N802
        """Compiles a constraint into the grammar cache, in a compile worker (the step loop goes on meanwhile), and
        holds it there for the scheduler's queued request: an empty error once it is there, else why not. The
        compile is bounded by its own CPU and memory limits, never by how long it waited for a worker."""
        engine = self.runner.mirror.grammars
        if engine is None:
            return pb.CheckConstraintResponse(error="sampling.constraint: this executor has no grammar engine")
        started = time.perf_counter()
        try:
            cached = engine.cached(request)
            compiled = await asyncio.shield(asyncio.wrap_future(engine.submit(request)))  # (shared with others)
        except ConstraintError as err:
            limit = isinstance(err, CompileLimit)
            metrics.GRAMMAR_COMPILES.labels("limit" if limit else "invalid").inc()
            used = err.used if limit else 0.0
            metrics.GRAMMAR_COMPILE_CPU.inc(used)
            return pb.CheckConstraintResponse(error=str(err), compile_cpu_ms=used * 1e3)
        metrics.GRAMMAR_COMPILES.labels("cached" if cached else "compiled").inc()
        metrics.GRAMMAR_COMPILE_CPU.inc(compiled.cpu_s)
        return pb.CheckConstraintResponse(compile_ms=(time.perf_counter() - started) * 1e3, cached=cached,
                                          compile_cpu_ms=compiled.cpu_s * 1e3)

    async def Run(self, request_iterator, context):  # noqa: N802
        """One scheduler's stream of plans.

        NOTE: a coroutine on grpc's reader/writer API (context.read/write), not an async generator. A generator
        handler cancelled while its result was being written is left suspended at its ``yield``; grpc then
        releases the call, and the generator's ``finally`` ran later, from the event loop's generator
        finalizer, where ``context.peer()`` read the released call: SIGSEGV at address 0 on the next Run
        (with or without uvloop). Here the handler ends inside grpc's RPC task, reads and writes are never
        cancelled (see _in_flight), and the context is not touched once the stream has ended.
        """
        peer = context.peer()
        session_id = dict(context.invocation_metadata()).get(SESSION_HEADER, "")
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "this executor is draining (shutting down)")
        if not await self._wait_detached():
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "this executor is already driven by a scheduler (one Run stream at a time)")
        self.busy = True
        self.detached.clear()
        drained = asyncio.ensure_future(self.idle_drain.wait())
        try:
            kept = self._attach(session_id)
            pages = PAGES_KEPT if kept else PAGES_FRESH
            self.log.info("scheduler_attached", peer=peer, pages=pages)
            await asyncio.shield(_in_flight(context.send_initial_metadata(((PAGES_HEADER, pages),))))
            ended = None  # when the last result went out, if requests were left in progress
            writing = None  # the last result's write, not yet confirmed
            while (plan := await self._next_plan(context, drained)) is not None:
                waited = time.perf_counter() - ended if ended is not None else 0.0
                result = self._step(plan)
                if result is None:
                    if writing is not None:  # (the last result first: the scheduler has it before the error)
                        await asyncio.shield(writing)
                    await context.abort(grpc.StatusCode.INTERNAL, f"step {plan.step_id} failed on the executor; "
                                        "its request state is reset (see the executor's log)")
                result.timings.wait_ms = waited * 1e3
                metrics.IDLE_SECONDS.observe(waited)
                # The gap to the next step counts from here: writing this result, reading the next plan, and any
                # wait for it (none with async scheduling, where it is already queued). With no request left the
                # executor waits for new work, not for the scheduler: not counted.
                ended = time.perf_counter() if self.runner.requests else None
                if writing is not None:  # (one write at a time on a stream: the last one went out during the step)
                    await asyncio.shield(writing)
                # NOTE: the write is started, not awaited: its bytes leave at once, and the next plan (already
                # queued with async scheduling) is read and run while grpc confirms it.
                writing = _in_flight(context.write(result))
            if writing is not None:
                await asyncio.shield(writing)
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as err:  # noqa: BLE001 - the stream broke under a write: the scheduler is gone
            self.log.info("run_stream_broken", peer=peer, error=f"{type(err).__name__}: {err}")
        finally:
            drained.cancel()
            self.runner.reset()
            self.busy = False
            self.detached.set()
            self.log.info("scheduler_detached", peer=peer)

    async def _wait_detached(self) -> bool:
        """The previous stream's handler may still be finishing: its scheduler cancelled it during a step, and
        it learns so at its next await. Waits up to ATTACH_WAIT_S for it; False if the executor stays taken."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + ATTACH_WAIT_S
        while self.busy:
            try:
                await asyncio.wait_for(self.detached.wait(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                return not self.busy
        return True

    def _attach(self, session_id: str) -> bool:
        """Request state always starts empty. Page contents stay only for the session that wrote them: any other
        (or none) gets zeroed pages first, so it can read nothing an earlier scheduler left. Returns kept."""
        self.runner.reset()
        if session_id and session_id == self.session_id:
            return True
        self.session_id = session_id or None
        if self.runner.wipe_pages():
            self.log.info("pages_wiped", reason="a new Run-stream session" if session_id else "no session given")
        return False

    async def _next_plan(self, context, drained: asyncio.Future) -> pb.StepPlan | None:
        """The next plan; None once the scheduler closed the stream, or the executor is draining and idle (the
        read then stays in flight, and ends with the RPC)."""
        read = _in_flight(context.read())
        await asyncio.wait({read, drained}, return_when=asyncio.FIRST_COMPLETED)
        if not read.done():
            return None
        try:
            plan = read.result()
        except DecodeError as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"StepPlan: not a valid message ({err})")
        except Exception as err:  # noqa: BLE001 - the call ended under the read (cancelled, connection lost)
            self.log.debug("run_read_ended", error=f"{type(err).__name__}: {err}")
            return None
        return None if plan is grpc.aio.EOF else plan

    def _step(self, plan: pb.StepPlan) -> pb.StepResult | None:
        # NOTE: the step runs on the event loop thread. Handing it to a worker thread cost ~10%
        # of end-to-end throughput on CPU (GIL hand-offs between the two threads every step);
        # the price is that health checks wait for the current step to end.
        try:
            result = self.runner.step(plan)
        except Exception:  # noqa: BLE001 - a bug or a device error: refuse the stream, stay up
            self.log.exception("step_failed", step_id=plan.step_id)
            return None
        metrics.observe_step(plan, result, len(self.runner.requests), self.runner.exact_tail)
        if result.error:
            self.log.warning("plan_rejected", step_id=plan.step_id, error=result.error)
        if self.draining:
            result.draining = True
            if not self.runner.requests:
                self.idle_drain.set()
        return result

    def start_drain(self) -> None:
        """SIGTERM: take no new scheduler; tell the current one (in every step result) so it moves the
        requests elsewhere; the Run stream ends when the scheduler closes it or, idle, here."""
        self.draining = True
        metrics.DRAINING.set(1)
        if not self.runner.requests:
            self.idle_drain.set()
