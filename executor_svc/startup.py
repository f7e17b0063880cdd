"""What an executor builds at start-up from its flags: the device, the model, the attention backend, the device
and host page pools (sized from --num-pages / --kv-cache-gb / --swap-space and the memory there is), CUDA graphs,
the start-up costs, and the Describe answer the scheduler reads. LoRA adapters' weights take the pool's last pages
(executor_svc/lora/pages.py): Describe's num_device_pages counts the KV pages only."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import torch

from executor_svc.args import DEFAULT_GRAPH_MAX_BATCH, MAX_SWAP_RATIO
from executor_svc.attention import BACKENDS, cpu_kernel, select_backend
from executor_svc.costs import cached_costs, cost_key
from executor_svc.cuda_graphs import DecodeGraphs, graph_blocker
from executor_svc.generation_config import sampling_defaults
from executor_svc.grammar import GrammarEngine
from executor_svc.grammar_jobs import Matchers
from executor_svc.host_memory import keep_freed_memory
from executor_svc.kv_quant import KvFormat, parse_kv_dtype
from executor_svc.kv_tail import ExactTail, slab_slots, slot_bytes, tail_pages
from executor_svc.lora.pages import check_kv_left, plan_pages
from executor_svc.lora.stack import LoraStack, load_adapters, lora_slots
from executor_svc.lora.store import AdapterStore
from executor_svc.memory_fit import check_kv_fits, kv_flag, weights_bytes
from executor_svc.model import load_model
from executor_svc.model_config import ModelConfig, parse_dtype
from executor_svc.pages import DevicePagePool, GiB, HostPagePool, page_bytes, pages_for_budget
from executor_svc.runner import ModelRunner
from executor_svc.threads import torch_threads
from pagedkv import start_phases
from pagedkv.executor.v1 import executor_pb2 as pb
from pagedkv.models import resolve_model
from pagedkv.proc_tree import interruptible_start
from pagedkv.wire import EXECUTOR_PROTOCOL

HOST_MEMORY_SHARE = 0.5  # the default host tier takes at most this share of the available host memory


def _grammars(args, path: Path, vocab_size: int) -> tuple[GrammarEngine, Matchers]:
    """Structured outputs: the compile workers and cache, the matcher threads and their budgets (the flags)."""
    for flag, value, least in (("--grammar-compile-timeout", args.grammar_compile_timeout, 1e-3),
                               ("--grammar-compile-memory-mb", args.grammar_compile_memory_mb, 0),
                               ("--grammar-compile-workers", args.grammar_compile_workers, 0),
                               ("--grammar-compiles-per-tenant", args.grammar_compiles_per_tenant, 1),
                               ("--grammar-threads", args.grammar_threads, 1),
                               ("--grammar-step-budget-ms", args.grammar_step_budget_ms, 1e-3),
                               ("--grammar-tenant-step-budget-ms", args.grammar_tenant_step_budget_ms, 1e-3)):
        if not value >= least:
            raise ValueError(f"{flag} {value}: must be >= {least:g}")
    engine = GrammarEngine(path, vocab_size, args.grammar_compile_timeout, args.grammar_compile_workers,
                           args.grammar_compile_memory_mb, args.grammar_compiles_per_tenant)
    return engine, Matchers(args.grammar_threads, args.grammar_step_budget_ms, args.grammar_tenant_step_budget_ms)


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


def _tail_plan(args, cfg: ModelConfig, kv: KvFormat, backend: str, num_pages: int,
               per_page: int) -> tuple[int, int, int]:
    """The exact tail (executor_svc/kv_tail.py): (its pages a request, the slab's slots, the pages the slab takes
    from a pool sized by a budget: none from --num-pages)."""
    pages = tail_pages(getattr(args, "kv_exact_tail_pages", None), kv.name, backend,
                       getattr(args, "kv_exact_tail_slots", None))
    if not pages:
        return 0, 0, 0
    one = slot_bytes(cfg.num_layers, args.block_size, cfg.num_kv_heads, cfg.head_dim)
    slots = slab_slots(getattr(args, "kv_exact_tail_slots", None), pages, num_pages * per_page, one, args.block_size)
    taken = 0 if args.num_pages is not None else -(-slots * one // per_page)
    if taken >= num_pages:
        raise ValueError(f"the exact tail's {slots} slots ({slots * one} bytes) take the whole KV budget of "
                         f"{num_pages} pages: lower --kv-exact-tail-slots or --kv-exact-tail-pages, or raise "
                         "--kv-cache-gb")
    return pages, slots, taken


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
    """Everything the executor serves with. SIGINT/SIGTERM meanwhile end what it started (pip, the compiler) and
    raise StartInterrupted: each temporary folder is removed on the way out (proc_tree.interruptible_start)."""
    with interruptible_start(log):
        return _build(args, log)


def _build(args, log) -> tuple[ModelRunner, pb.DescribeResponse]:
    kept_memory = keep_freed_memory()  # before the first big allocation
    threads = torch_threads(args.threads)
    if threads:
        torch.set_num_threads(threads)
    device = _device(args.device)
    dtype = parse_dtype(args.dtype)
    kv = parse_kv_dtype(getattr(args, "kv_cache_dtype", "auto"), dtype)  # before loading: refuse 4-bit early
    path = resolve_model(args.model)
    cfg = ModelConfig.from_dir(path)
    if cfg.unknown_fields:  # no supported family defines them: transformers ignores them too
        log.warning("config_fields_ignored", fields=list(cfg.unknown_fields), model=str(path))
    defaults = sampling_defaults(cfg.generation_defaults, f"model {path}: generation_config.json")
    if device.type == "cpu" and cpu_kernel.unavailable_reason() is None:
        cpu_kernel.load()  # (a phase of its own: the first start builds it; the model's layers use it)
    adapters = load_adapters(getattr(args, "lora_modules", None), cfg, getattr(args, "max_lora_rank", 64))
    with start_phases.phase("weights", f"loading the weights of {args.model}", log, dtype=str(dtype)):
        model = load_model(cfg, device, dtype)
    backend, why = select_backend(args.attention_backend, device, dtype, cfg.head_dim, kv.quantized)
    attention = BACKENDS[backend](cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, model.scale)
    graphs_off = _graphs_off_reason(args, device, model, kv)
    num_pages = _num_pages(args, cfg, dtype, device, kv)
    per_page = page_bytes(cfg, args.block_size, dtype, kv)
    tail_len, tail_slots, taken = _tail_plan(args, cfg, kv, backend, num_pages, per_page)
    num_pages -= taken
    check_kv_fits(kv_flag(args), (num_pages + 1 + taken) * per_page, device,
                  weights_bytes(model), available_host_memory())  # before allocating (+1: the scratch page)
    shape, slots = lora_slots(args, adapters, cfg)
    held = plan_pages(shape, cfg, dtype, num_pages, per_page, slots) if slots else None  # the pool's last pages
    if held is not None:
        check_kv_left(held, num_pages, shape.rank, cfg, args.block_size, kv_flag(args))
    pool = DevicePagePool(cfg, num_pages + (graphs_off is None), args.block_size, dtype, device, kv)  # + scratch
    pool.copier = attention.copy_pages
    if tail_len:
        pool.attach_tail(ExactTail(pool.num_pages, cfg.num_layers, args.block_size, cfg.num_kv_heads, cfg.head_dim,
                                   tail_len, tail_slots, device))
        log.info("kv_exact_tail", pages=tail_len, slots=tail_slots, slab_bytes=pool.tail.slab_bytes,
                 pages_taken_from_kv=taken)
    store = None
    if held is not None:  # the slots are views of the held pages (executor_svc/lora/pages.py)
        model.lora = LoraStack([], cfg, device, dtype, memory=held.carve(pool, dtype), shape=shape, slots=slots)
        model.lora.pages = held.per_adapter()
        store = AdapterStore(model.lora, cfg, getattr(args, "max_lora_rank", 64), getattr(args, "lora_root", None),
                             pin=device.type == "cuda")
        for k, adapter in enumerate(adapters):
            store.hold(adapter, runtime=False)
            if k < slots:
                store.page_in(adapter.name, k)
        log.info("lora_adapters", adapters=[f"{a.name} (r={a.rank}, {a.num_bytes(dtype)} bytes)" for a in adapters],
                 slots=slots, slot_pages=held.each, slot_rank=shape.rank, pages=held.total, kv_pages=held.first,
                 runtime_root=str(store.root) if store.root else None, stacked_bytes=model.lora.held_bytes())
    kv_pages = num_pages - (held.total if held is not None else 0)
    host_pool = HostPagePool(pool, _num_host_pages(args, kv_pages, pool.page_bytes, log))
    graphs = None if graphs_off else DecodeGraphs(model, pool, attention, device, _graph_max_batch(args),
                                                 scratch_page=num_pages)
    runner = ModelRunner(model, pool, attention, device, host_pool, graphs, store)
    runner.mirror.grammars, runner.matchers = _grammars(args, path, cfg.vocab_size)
    log.info("cuda_graphs", on=graphs is not None, buckets=graphs.buckets if graphs else [],
             eager=graphs_off or "prefill and mixed steps, decode steps above the largest bucket")
    with start_phases.phase("costs", "measuring prefill and swap costs (kept for later starts)", log) as done:
        costs, kept = cached_costs(runner, _costs_key(path, runner, dtype, pool, host_pool, backend),
                                   cpu_kernel.cache_dir().parent / "costs")
        done["kept"] = kept
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
        default_temperature=defaults.temperature, default_top_p=defaults.top_p, default_top_k=defaults.top_k,
        default_repetition_penalty=defaults.repetition_penalty, default_min_p=defaults.min_p,
        model_sliding_window=cfg.model_window, protocol=EXECUTOR_PROTOCOL,
        adapters=store.describe() if store is not None else [], lora_slots=slots,
        lora_slot_pages=held.each if held is not None else 0, lora_max_rank=shape.rank if slots else 0,
        lora_modules=sorted({m for t in shape.targets for m in t}) if slots else [],
        lora_runtime=store is not None and store.root is not None,
        exact_tail_pages=pool.tail.pages if pool.tail is not None else 0,
    )
    log.info("executor_built", model=args.model, path=str(path), device=str(device), dtype=describe.dtype,
             kv_dtype=describe.kv_dtype, kv_bytes_per_token=describe.kv_bytes_per_token,
             block_size=args.block_size, num_pages=runner.num_pages, num_host_pages=host_pool.num_pages,
             page_bytes=pool.page_bytes, backend=backend, backend_choice=why,
             swap_gb_per_s=round(costs.swap_bytes_per_second / 1e9, 2),
             prefill_us_per_token=round(costs.prefill_seconds_per_token * 1e6, 1),
             costs="kept from an earlier start" if kept else "measured",
             freed_memory="kept in the process" if kept_memory is None else f"returned ({kept_memory})")
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
                     f"tail{pool.tail.pages}x{pool.tail.num_slots}" if pool.tail is not None else "",
                     str(cpu_kernel.unavailable_reason()), torch.__version__])
