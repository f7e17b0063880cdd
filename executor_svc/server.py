"""The executor gRPC service: Describe, and one Run stream of StepPlan -> StepResult."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import uuid

import grpc
import torch

from executor_svc.attention import BACKENDS
from executor_svc.model import load_model
from executor_svc.model_config import ModelConfig, parse_dtype
from executor_svc.pages import DevicePagePool, GiB, page_bytes, pages_for_budget
from executor_svc.runner import ModelRunner
from pagedkv import grpc_common, logs
from pagedkv.executor.v1 import executor_pb2 as pb
from pagedkv.executor.v1 import executor_pb2_grpc as pb_grpc
from pagedkv.models import resolve_model

SERVICE = pb.DESCRIPTOR.services_by_name["Executor"].full_name
BLOCK_SIZES = (8, 16, 32)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny-llama", help="built-in name (tiny-llama) or a local HF directory")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50061)
    p.add_argument("--block-size", type=int, default=16, choices=BLOCK_SIZES, help="tokens per KV page")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--num-pages", type=int, help="number of device KV pages")
    size.add_argument("--kv-cache-gb", type=float, help="device KV memory in GiB (default: 1 on CPU, "
                      "--gpu-memory-utilization of free memory after weights on CUDA)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16 (fp32/bf16/fp16)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--attention-backend", default="auto", choices=["auto", *BACKENDS],
                   help="paged attention implementation (auto: torch until the CUDA kernels land)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--metrics-port", type=int, default=0, help="Prometheus metrics HTTP port (0: off)")
    p.add_argument("--log-format", choices=["auto", "json", "console"], default="auto",
                   help="auto: readable on a terminal, JSON lines otherwise (services, containers)")


class ExecutorService(pb_grpc.ExecutorServicer):
    def __init__(self, runner: ModelRunner, describe: pb.DescribeResponse, log) -> None:
        self.runner = runner
        self.describe = describe
        self.log = log
        self.busy = False

    async def Describe(self, request, context):  # noqa: N802
        return self.describe

    async def Run(self, request_iterator, context):  # noqa: N802
        if self.busy:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "this executor is already driven by a scheduler (one Run stream at a time)")
        self.busy = True
        self.log.info("scheduler_attached", peer=context.peer())
        try:
            async for plan in request_iterator:
                # NOTE: the step runs on the event loop thread. Handing it to a worker thread cost ~10%
                # of end-to-end throughput on CPU (GIL hand-offs between the two threads every step);
                # the price is that health checks wait for the current step to end.
                result = self.runner.step(plan)
                if result.error:
                    self.log.warning("plan_rejected", step_id=plan.step_id, error=result.error)
                yield result
        finally:
            self.runner.reset()
            self.busy = False
            self.log.info("scheduler_detached", peer=context.peer())


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: CUDA is not available on this machine")
    return dev


def _num_pages(args, cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> int:
    per_page = page_bytes(cfg, args.block_size, dtype)
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


def build(args, log) -> tuple[ModelRunner, pb.DescribeResponse]:
    if args.threads:
        torch.set_num_threads(args.threads)
    device = _device(args.device)
    dtype = parse_dtype(args.dtype)
    path = resolve_model(args.model)
    cfg = ModelConfig.from_dir(path)
    model = load_model(cfg, device, dtype)
    backend = "torch" if args.attention_backend == "auto" else args.attention_backend
    attention = BACKENDS[backend](cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, model.scale)
    pool = DevicePagePool(cfg, _num_pages(args, cfg, dtype, device), args.block_size, dtype, device)
    describe = pb.DescribeResponse(
        model=args.model, model_path=str(path), num_layers=cfg.num_layers, num_heads=cfg.num_heads,
        num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, hidden_size=cfg.hidden_size,
        vocab_size=cfg.vocab_size, max_position_embeddings=cfg.max_position_embeddings,
        dtype=str(dtype).removeprefix("torch."), kv_dtype=str(dtype).removeprefix("torch."),
        block_size=args.block_size, num_device_pages=pool.num_pages, num_host_pages=0,
        page_bytes=pool.page_bytes, attention_backend=backend, device=str(device),
        eos_token_ids=list(cfg.eos_token_ids), executor_id=uuid.uuid4().hex,
    )
    log.info("executor_built", model=args.model, path=str(path), device=str(device), dtype=describe.dtype,
             block_size=args.block_size, num_pages=pool.num_pages, page_bytes=pool.page_bytes, backend=backend)
    return ModelRunner(model, pool, attention, device), describe


async def serve(args) -> None:
    log = logs.configure("executor", json=logs.wants_json(args.log_format))
    runner, describe = build(args, log)
    server = grpc_common.new_server()
    pb_grpc.add_ExecutorServicer_to_server(ExecutorService(runner, describe, log), server)
    health = grpc_common.add_health_and_reflection(server, [SERVICE])
    port = grpc_common.bind(server, args.host, args.port)
    if args.metrics_port:
        import prometheus_client

        prometheus_client.start_http_server(args.metrics_port, addr=args.host)
    await server.start()
    await grpc_common.set_serving(health, [SERVICE], True)
    log.info("executor_ready", address=f"{args.host}:{port}", pid=os.getpid())
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await grpc_common.set_serving(health, [SERVICE], False)
    await server.stop(grace=2.0)
    log.info("executor_stopped")
