"""The executor gRPC service: Describe, and one Run stream of StepPlan -> StepResult."""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid

import grpc
import torch
from google.protobuf.message import DecodeError

from executor_svc import metrics
from executor_svc.args import BLOCK_SIZES, DEFAULT_GRAPH_MAX_BATCH, MAX_SWAP_RATIO, add_args  # noqa: F401 - add_args: the CLI's entry
from executor_svc.attention import BACKENDS, cpu_kernel, select_backend
from executor_svc.costs import cached_costs, cost_key
from executor_svc.cuda_graphs import DecodeGraphs, graph_blocker
from executor_svc.generation_config import sampling_defaults
from executor_svc.kv_quant import KvFormat, parse_kv_dtype
from executor_svc.model import load_model
from executor_svc.model_config import ModelConfig, parse_dtype
from executor_svc.pages import DevicePagePool, GiB, HostPagePool, page_bytes, pages_for_budget
from executor_svc.runner import ModelRunner
from pagedkv import grpc_common, logs, runtime, security
from pagedkv.executor.v1 import executor_pb2 as pb
from pagedkv.executor.v1 import executor_pb2_grpc as pb_grpc
from pagedkv.models import resolve_model
from pagedkv.wire import EXECUTOR_PROTOCOL, PAGES_FRESH, PAGES_HEADER, PAGES_KEPT, SESSION_HEADER

SERVICE = pb.DESCRIPTOR.services_by_name["Executor"].full_name
HOST_MEMORY_SHARE = 0.5  # the default host tier takes at most this share of the available host memory


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
        self.session: str | None = None  # the Run-stream session whose KV the pages hold
        self.idle_drain = asyncio.Event()  # draining with no request left: end the Run stream
        self.detached = asyncio.Event()  # the Run stream ended (or there was none)
        self.detached.set()

    async def Describe(self, request, context):  # noqa: N802
        return self.describe

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
        session = dict(context.invocation_metadata()).get(SESSION_HEADER, "")
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "this executor is draining (shutting down)")
        if not await self._wait_detached():
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "this executor is already driven by a scheduler (one Run stream at a time)")
        self.busy = True
        self.detached.clear()
        drained = asyncio.ensure_future(self.idle_drain.wait())
        try:
            kept = self._attach(session)
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

    def _attach(self, session: str) -> bool:
        """Request state always starts empty. Page contents stay only for the session that wrote them: any other
        (or none) gets zeroed pages first, so it can read nothing an earlier scheduler left. Returns kept."""
        self.runner.reset()
        if session and session == self.session:
            return True
        self.session = session or None
        if self.runner.wipe_pages():
            self.log.info("pages_wiped", reason="a new Run-stream session" if session else "no session given")
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
        metrics.observe_step(plan, result, len(self.runner.requests))
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


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: CUDA is not available on this machine")
    return dev


def _num_pages(args, cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
               kv: KvFormat | None = None) -> int:
    if kv is not None and not kv.quantized:
        dtype, kv = kv.storage, None
    per_page = page_bytes(cfg, args.block_size, dtype, kv)
    if args.num_pages is not None:
        if args.num_pages < 1:
            raise ValueError(f"--num-pages must be >= 1, got {args.num_pages}")
        return args.num_pages
    if args.kv_cache_gb is not None:
        budget = int(args.kv_cache_gb * GiB)
    elif device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = int(free - (1 - args.gpu_memory_utilization) * total)
    else:
        budget = GiB
    pages = pages_for_budget(budget, per_page)
    if pages < 1:
        raise ValueError(f"KV budget of {budget} bytes holds no page of {per_page} bytes")
    return pages


def available_host_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def _num_host_pages(args, num_device_pages: int, per_page: int, log) -> int:
    """The host tier: bounded (at most MAX_SWAP_RATIO x the device KV) because an unbounded swap turns
    a 3 s P99 into 20 s (seeds, practice note 3)."""
    limit = int(MAX_SWAP_RATIO * num_device_pages)
    device_gib = num_device_pages * per_page / GiB
    if args.num_host_pages is not None:
        pages, asked = args.num_host_pages, f"--num-host-pages {args.num_host_pages}"
    elif args.swap_space is not None:
        pages, asked = int(args.swap_space * GiB // per_page), f"--swap-space {args.swap_space:g} GiB"
        if args.swap_space > 0 and pages == 0:
            raise ValueError(f"{asked} holds no page of {per_page} bytes")
    else:
        avail = available_host_memory()
        pages = min(num_device_pages, int(HOST_MEMORY_SHARE * avail) // per_page)
        if pages < num_device_pages:
            log.warning("swap_space_capped", host_pages=pages, device_pages=num_device_pages,
                        available_host_bytes=avail, hint="the default host tier takes at most half the "
                        "available host memory; set --swap-space to choose")
        return pages
    if pages < 0:
        raise ValueError(f"{asked}: must be >= 0")
    if pages > limit:
        raise ValueError(
            f"{asked} is {pages} pages ({pages * per_page / GiB:.3g} GiB), above {MAX_SWAP_RATIO:g}x the device "
            f"KV cache ({num_device_pages} pages, {device_gib:.3g} GiB): at most {limit} pages. An unbounded "
            "swap tier trades a short queue for long tail latency; give the device more KV instead")
    avail = available_host_memory()
    if pages * per_page > avail:
        raise ValueError(f"{asked} needs {pages * per_page / GiB:.3g} GiB of host memory but only "
                         f"{avail / GiB:.3g} GiB is available")
    return pages


def _graph_max_batch(args) -> int:
    value = getattr(args, "cuda_graph_max_batch", None)
    value = DEFAULT_GRAPH_MAX_BATCH if value is None else value
    if value < 1:
        raise ValueError(f"--cuda-graph-max-batch must be >= 1, got {value}")
    return value


def _graphs_off_reason(args, device: torch.device, model, kv) -> str | None:
    """Why decode steps run eager on this executor (None: CUDA graphs for decode-only steps)."""
    _graph_max_batch(args)
    if getattr(args, "enforce_eager", False):
        return "--enforce-eager"
    if device.type != "cuda":
        return f"CUDA graphs need a CUDA device (this executor runs on {device})"
    if kv.quantized:
        return "8-bit KV pages"
    return graph_blocker(model, None)


def build(args, log) -> tuple[ModelRunner, pb.DescribeResponse]:
    if args.threads:
        torch.set_num_threads(args.threads)
    device = _device(args.device)
    dtype = parse_dtype(args.dtype)
    kv = parse_kv_dtype(getattr(args, "kv_cache_dtype", "auto"), dtype)  # before loading: refuse 4-bit early
    path = resolve_model(args.model)
    cfg = ModelConfig.from_dir(path)
    if cfg.unknown_fields:  # no supported family defines them: transformers ignores them too
        log.warning("config_fields_ignored", fields=list(cfg.unknown_fields), model=str(path))
    temperature, top_p, top_k = sampling_defaults(cfg.generation_defaults, f"model {path}: generation_config.json")
    model = load_model(cfg, device, dtype)
    backend, why = select_backend(args.attention_backend, device, dtype, cfg.head_dim, kv.quantized)
    attention = BACKENDS[backend](cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, model.scale)
    graphs_off = _graphs_off_reason(args, device, model, kv)
    num_pages = _num_pages(args, cfg, dtype, device, kv)
    pool = DevicePagePool(cfg, num_pages + (graphs_off is None), args.block_size, dtype, device, kv)  # + scratch
    pool.copier = attention.copy_pages
    host_pool = HostPagePool(pool, _num_host_pages(args, num_pages, pool.page_bytes, log))
    graphs = None if graphs_off else DecodeGraphs(model, pool, attention, device, _graph_max_batch(args),
                                                 scratch_page=num_pages)
    runner = ModelRunner(model, pool, attention, device, host_pool, graphs)
    log.info("cuda_graphs", on=graphs is not None, buckets=graphs.buckets if graphs else [],
             eager=graphs_off or "prefill and mixed steps, decode steps above the largest bucket")
    costs, kept = cached_costs(runner, _costs_key(path, runner, dtype, pool, host_pool, backend),
                               cpu_kernel.cache_dir().parent / "costs")
    describe = pb.DescribeResponse(
        model=args.model, model_path=str(path), num_layers=cfg.num_layers, num_heads=cfg.num_heads,
        num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, hidden_size=cfg.hidden_size,
        vocab_size=cfg.vocab_size, max_position_embeddings=cfg.max_position_embeddings,
        dtype=str(dtype).removeprefix("torch."), kv_dtype=pool.kv_dtype,
        kv_bytes_per_token=pool.page_bytes // args.block_size,
        block_size=args.block_size, num_device_pages=runner.num_pages, num_host_pages=host_pool.num_pages,
        page_bytes=pool.page_bytes, attention_backend=backend, device=str(device),
        eos_token_ids=list(cfg.eos_token_ids), executor_id=uuid.uuid4().hex,
        swap_bytes_per_second=costs.swap_bytes_per_second, prefill_seconds_per_token=costs.prefill_seconds_per_token,
        default_temperature=temperature, default_top_p=top_p, default_top_k=top_k,
        model_sliding_window=cfg.model_window, protocol=EXECUTOR_PROTOCOL,
    )
    log.info("executor_built", model=args.model, path=str(path), device=str(device), dtype=describe.dtype,
             kv_dtype=describe.kv_dtype, kv_bytes_per_token=describe.kv_bytes_per_token,
             block_size=args.block_size, num_pages=runner.num_pages, num_host_pages=host_pool.num_pages,
             page_bytes=pool.page_bytes, backend=backend, backend_choice=why,
             swap_gb_per_s=round(costs.swap_bytes_per_second / 1e9, 2),
             prefill_us_per_token=round(costs.prefill_seconds_per_token * 1e6, 1),
             costs="kept from an earlier start" if kept else "measured")
    return runner, describe


def _costs_key(path, runner: ModelRunner, dtype: torch.dtype, pool: DevicePagePool, host_pool: HostPagePool,
               backend: str) -> str:
    """What the start-up costs depend on: the model's files, the dtypes and page layout, the device, the
    threads, the attention backend and kernels, torch and the CPU (costs.cached_costs)."""
    files = sorted(path.glob("*.safetensors")) + [path / "config.json"]
    stats = [f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files if f.exists()]
    device = runner.device
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_kernel.cpu_signature()
    return cost_key([str(path.resolve()), *stats, str(dtype), pool.kv_dtype, str(pool.page_bytes),
                     str(runner.block_size), str(host_pool.num_pages > 0), str(device), name,
                     str(torch.get_num_threads()), backend, cpu_kernel.build_name(),
                     str(cpu_kernel.unavailable_reason()), torch.__version__])


def link_security(args, log) -> tuple[list, grpc.ServerCredentials | None]:
    """The interceptors (the secret check) and TLS credentials of the executor's port, checked before the
    model loads: an executor with no secret refuses to start unless --insecure."""
    secret = security.load_executor_secret(args.executor_secret_file)
    credentials = security.server_credentials(args.tls_cert, args.tls_key)
    if secret:
        return [security.SecretInterceptor(secret, log)], credentials
    if not args.insecure:
        raise ValueError(f"no executor secret: give {security.SECRET_FILE_FLAG} PATH (or set "
                         f"${security.EXECUTOR_SECRET_ENV}) with the secret your scheduler holds, so that only it "
                         "can drive this executor; --insecure runs without one (development only)")
    exposed = not security.is_loopback(args.host)
    (log.error if exposed else log.warning)(
        "executor_unauthenticated", address=f"{args.host}:{args.port}", exposed_beyond_loopback=exposed,
        risk="--insecure: any process that reaches this port can drive this executor and read what its pages "
        "hold" + (", from other machines too" if exposed else " (local processes)"),
        hint=f"development only; give {security.SECRET_FILE_FLAG} in production")
    return [], credentials


async def serve(args) -> None:
    log = logs.configure("executor", json=logs.wants_json(args.log_format))
    interceptors, credentials = link_security(args, log)
    runner, describe = build(args, log)
    server = grpc_common.new_server(interceptors=interceptors)
    service = ExecutorService(runner, describe, log)
    metrics.DEVICE_PAGES.set(describe.num_device_pages)
    metrics.HOST_PAGES.set(describe.num_host_pages)
    pb_grpc.add_ExecutorServicer_to_server(service, server)
    health = grpc_common.add_health_and_reflection(server, [SERVICE])
    port = grpc_common.bind(server, args.host, args.port, credentials)
    security.warn_if_exposed(log, "executor", args.host, port, tls=credentials is not None)
    if args.metrics_port:
        import prometheus_client

        prometheus_client.start_http_server(args.metrics_port, addr=args.metrics_host or args.host)
    runtime.settle_gc()  # (the model's modules and parameters, frozen; young collections less often: as the scheduler)
    await server.start()
    await grpc_common.set_serving(health, [SERVICE], True)
    log.info("executor_ready", address=f"{args.host}:{port}", pid=os.getpid(), tls=credentials is not None,
             authenticated=bool(interceptors))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    # Drain: the scheduler moves this executor's requests to others (or lets them finish), then closes the
    # stream; past --drain-timeout the executor exits anyway and the scheduler recomputes what was left.
    await grpc_common.set_serving(health, [SERVICE], False)
    service.start_drain()
    stop.clear()  # a second signal: exit now
    log.info("executor_draining", requests=len(runner.requests), drain_timeout_s=args.drain_timeout)
    waits = [asyncio.ensure_future(service.detached.wait()), asyncio.ensure_future(stop.wait())]
    done, _ = await asyncio.wait(waits, timeout=args.drain_timeout, return_when=asyncio.FIRST_COMPLETED)
    for w in waits:
        w.cancel()
    drained = service.detached.is_set()
    await server.stop(grace=1.0)
    log.info("executor_stopped", drained=drained, requests_left=len(runner.requests))
