"""Multi-LoRA serving (#52): 32 concurrent requests spread over 8 adapters against 32 base-model requests, pagedkv
against vLLM's CPU build with ``--enable-lora``, one client for both (``vllm bench serve``, bench/peers_http.py).

1. Adapters: 8 random PEFT adapters of the served model (tests/support/lora_helpers.make_adapter: PEFT's own
   LoraConfig + save_pretrained, lora_A and lora_B drawn at random), rank ``--rank`` on q/k/v/o/gate/up/down,
   built once into ``~/.cache/pagedkv/lora-bench/<model>-r<rank>/a0..a7``.
2. Servers, side by side, fp32 weights and KV, the same KV budget (``--kv-cache-gb``: pagedkv's flag, vLLM's
   ``VLLM_CPU_KVCACHE_SPACE``): each system once without adapters and once with the 8 (pagedkv ``--lora-modules
   a0=PATH ... --max-lora-rank R``; vLLM ``--enable-lora --lora-modules ... --max-loras 8 --max-cpu-loras 8
   --max-lora-rank R'``, R' = R rounded up to a rank vLLM takes). A server that refuses to start is recorded with
   its log's error lines (the JSON and the table), not raised.
3. Arms, one workload shape (``--prompts`` random prompts of ``--input-len`` tokens, ``--output-len`` out, all at
   once): base (the server without adapters, model = the base name), adapters (the server with them, each request's
   model one adapter's name, ``--lora-assignment`` round-robin: 4 requests per adapter) and, unless
   ``--no-base-on-lora``, base requests to the server with adapters loaded. A throw-away run each, then
   ``--rounds`` rounds, the arms' order alternating, the same prompts for every arm within a round; medians.
4. Adapter load time: the executor's own loading (executor_svc/lora: load_adapters + LoraStack, as startup.py
   runs it) timed in process, and each server's start-up time (spawn to /v1/models answering) with and without the
   adapters. Pages per adapter: each adapter's weight bytes (the gRPC ModelInfo's ``adapters[].num_bytes``) over one
   KV page's (``kv_bytes_per_token`` x ``block_size``), and ``adapters[].num_pages`` where ModelInfo has it (the
   pages an adapter's weights take out of the pool, padding included). vLLM's start-ups are not like for like: its
   CPU build compiles the model (torch.compile, cached under the peer's venv) without LoRA and runs it eager with
   LoRA, so the JSON keeps each vLLM server's compilation mode and engine init time from its log (``server_notes``).

Targets (the issue's): pagedkv adapters / pagedkv base >= 0.8 and pagedkv adapters / vLLM adapters >= 1.2 (output
tok/s). Reported, never asserted.

    python bench/lora.py                                  # SmolLM2-135M-Instruct -> bench/results/lora.json
    python bench/lora.py --quick --systems pagedkv        # tiny-llama, 8 prompts, 1 round: a smoke
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import peers_http  # noqa: E402
from common import print_table, write_report  # noqa: E402
from e2e_peers import model_dir  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's --max-lora-rank choices
MIB = 2**20


@dataclasses.dataclass(frozen=True)
class LoraWorkload(peers_http.HttpWorkload):
    """An HttpWorkload whose requests each name one of ``lora_modules`` as their model (none: the base model)."""

    lora_modules: tuple[str, ...] = ()
    assignment: str = "round-robin"

    def args(self) -> list[str]:
        extra = ["--lora-modules", *self.lora_modules, "--lora-assignment", self.assignment] if self.lora_modules \
            else []
        return super().args() + extra

    def warm_up(self) -> LoraWorkload:
        return dataclasses.replace(self, prompts=super().warm_up().prompts, rate=0.0)


# ---- 1. adapters ------------------------------------------------------------------------------------------
def make_adapters(model: str, base: Path, rank: int, n: int) -> dict[str, Path]:
    """name -> directory of ``n`` PEFT adapters of ``base``, built once (seeds 1000 + i)."""
    from pagedkv.models import build_atomically, cache_dir
    from tests.support.lora_helpers import make_adapter

    root = cache_dir() / "lora-bench" / f"{model}-r{rank}"
    out = {}
    for i in range(n):
        path = root / f"a{i}"
        if not (path / "adapter_config.json").is_file():
            t0 = time.perf_counter()
            build_atomically(path, lambda d, i=i: make_adapter(base, d, rank, TARGETS, seed=1000 + i))
            print(f"  made adapter a{i} in {time.perf_counter() - t0:.1f} s: {path}", flush=True)
        out[f"a{i}"] = path
    return out


def load_in_process(base: Path, adapters: dict[str, Path], rank: int, repeats: int = 3) -> dict[str, Any]:
    """The executor's adapter loading (read + check every adapter, then stack them per layer), timed."""
    import torch

    from executor_svc.lora.stack import LoraStack, load_adapters
    from executor_svc.model_config import ModelConfig

    cfg = ModelConfig.from_dir(base)
    times, stack, loaded = [], None, []
    for _ in range(repeats):
        t0 = time.perf_counter()
        loaded = load_adapters(list(adapters.items()), cfg, rank)
        stack = LoraStack(loaded, cfg, torch.device("cpu"), torch.float32)
        times.append(time.perf_counter() - t0)
    assert stack is not None
    return dict(seconds=times, median_s=statistics.median(times), stacked_bytes=stack.held_bytes(),
                adapters=[dict(name=a.name, rank=a.rank, num_bytes=a.num_bytes(torch.float32)) for a in loaded])


# ---- 2. servers -------------------------------------------------------------------------------------------
def make_servers(systems: list[str], model: str, base: Path, adapters: dict[str, Path], rank: int,
                 kv_gb: int) -> dict[str, peers_http.HttpServer]:
    """'<system> base' and '<system> lora' (the 8 adapters loaded) for each system."""
    from pagedkv.cli import free_port

    modules = [f"{n}={p}" for n, p in adapters.items()]
    vllm_rank = next((r for r in VLLM_RANKS if r >= rank), VLLM_RANKS[-1])
    out = {}
    for system in systems:
        for lora in (False, True):
            if system == "pagedkv":
                extra = ("--kv-cache-gb", str(kv_gb), *(("--lora-modules", *modules, "--max-lora-rank", str(rank))
                                                        if lora else ()))
                srv = peers_http.make_server("pagedkv", model, base, free_port(), pagedkv_args=extra)
            else:
                srv = peers_http.make_server("vllm", model, base, free_port())
                srv.env = {"VLLM_CPU_KVCACHE_SPACE": str(kv_gb)}
                if lora:
                    srv.cmd += ["--enable-lora", "--lora-modules", *modules, "--max-loras", str(len(modules)),
                                "--max-cpu-loras", str(len(modules)), "--max-lora-rank", str(vllm_rank)]
            out[f"{system} {'lora' if lora else 'base'}"] = srv
    return out


def refusal(log: str) -> str:
    """The error lines of a server's log (its last 600 characters when none looks like one)."""
    lines = [ln.strip() for ln in log.splitlines()
             if re.search(r"(Error|Exception|error|refus|not supported|Unsupported)", ln)]
    return " | ".join(lines[-4:])[-600:] if lines else log[-600:]


def server_notes(srv: peers_http.HttpServer) -> dict[str, Any]:
    """What a server's log says about its start: vLLM's compilation mode (its CPU build compiles the model unless
    LoRA is on) and engine init time, the adapters it reports loaded; pagedkv's lora_adapters line."""
    log = srv.log()
    if srv.system == "vllm":
        mode = re.search(r"'mode': <CompilationMode\.(\w+)", log)
        init = re.search(r"init engine \(.*?\) took ([\d.]+) s", log)
        return dict(compilation_mode=mode.group(1) if mode else None, init_engine_s=float(init.group(1)) if init
                    else None, adapters_loaded=len(re.findall(r"Loaded new LoRA adapter", log)))
    line = next((ln for ln in log.splitlines() if '"lora_adapters"' in ln), "")
    return dict(lora_adapters_log=line[:600])


def adapter_pages(srv: peers_http.HttpServer) -> dict[str, Any]:
    """pagedkv's ModelInfo over gRPC: each adapter's bytes and the KV pages they equal."""
    from pagedkv.client import Client

    port = srv.cmd[srv.cmd.index("--port") + 1]

    async def info():
        async with Client(f"127.0.0.1:{port}") as c:
            return await c.model_info()

    mi = asyncio.run(info())
    page = mi.kv_bytes_per_token * mi.block_size
    return dict(kv_bytes_per_token=mi.kv_bytes_per_token, block_size=mi.block_size, page_bytes=page,
                kv_dtype=mi.kv_dtype, adapters=[dict(name=a.name, rank=a.rank, num_bytes=a.num_bytes,
                                                     pages=a.num_bytes / page, held_pages=getattr(a, "num_pages", None))
                                                for a in mi.adapters])


# ---- 3. runs ----------------------------------------------------------------------------------------------
def arms(servers: dict[str, Any], base_on_lora: bool) -> dict[str, tuple[str, bool]]:
    """arm -> (server, adapters named by the requests)."""
    out = {}
    for system in dict.fromkeys(k.split()[0] for k in servers):
        out[f"{system} base"] = (f"{system} base", False)
        out[f"{system} adapters"] = (f"{system} lora", True)
        if base_on_lora:
            out[f"{system} base, adapters loaded"] = (f"{system} lora", False)
    return out


def run_arms(servers: dict[str, peers_http.HttpServer], plan: dict[str, tuple[str, bool]], wl: LoraWorkload,
             rounds: int, tokenizer: Path, refused: dict[str, str]) -> dict[str, list[dict]]:
    live = {a: v for a, v in plan.items() if v[0] not in refused}
    runs: dict[str, list[dict]] = {a: [] for a in plan}
    by_arm = {a: wl if lora else dataclasses.replace(wl, lora_modules=()) for a, (_, lora) in live.items()}
    order = list(live)
    for k, a in enumerate(order):  # a throw-away run each, prompts of its own
        peers_http.bench(servers[live[a][0]], by_arm[a].warm_up(), tokenizer, 10_000 + k)
    for r in range(rounds):
        for a in (order if r % 2 == 0 else order[::-1]):
            res = peers_http.bench(servers[live[a][0]], by_arm[a], tokenizer, 1 + r)
            runs[a].append(res)
            print(f"  round {r + 1} {a}: " + (f"error {res['error']}" if "error" in res else
                  f"{res['output_throughput']:.1f} tok/s, TTFT p99 {res['p99_ttft_ms']:.0f} ms, TPOT p99 "
                  f"{res['p99_tpot_ms']:.1f} ms, {res['completed']} done, load {res['load_1m'][0]:.2f}"), flush=True)
    return runs


def medians(runs: list[dict]) -> dict[str, float]:
    ok = [r for r in runs if "error" not in r]
    keys = ("output_throughput", "p50_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms", "completed")
    return {k: statistics.median(r[k] for r in ok) for k in keys if all(k in r for r in ok)} | {"runs": len(ok)} \
        if ok else {"runs": 0}


# ---- report -------------------------------------------------------------------------------------------------
def tables(report: dict[str, Any]) -> None:
    arms_, refused = report["arms"], report["refused"]
    tps = {a: s["median"].get("output_throughput") for a, s in arms_.items()}

    def ratio(x: float | None, y: float | None) -> str:
        return f"{x / y:.2f}" if x and y else "-"

    rows = []
    for a, s in arms_.items():
        system, m = a.split()[0], s["median"]
        why = refused.get(s["server"]) or (s["runs"][-1]["error"] if s["runs"] and not m["runs"] else "")
        vs_peer = ratio(tps[a], tps.get("vllm adapters")) if a == "pagedkv adapters" else "-"
        rows.append((a, str(s["adapters"]), f"{tps[a]:.1f}" if tps[a] else f"refused: {why[:70]}" if why else "-",
                     ratio(tps[a], tps.get(f"{system} base")) if a != f"{system} base" else "1.00", vs_peer,
                     f"{m['p99_ttft_ms']:.0f}" if m["runs"] else "-", f"{m['p99_tpot_ms']:.1f}" if m["runs"] else "-"))
    print_table(("system", "adapters", "out tok/s", "vs base (same system)", "pagedkv/vLLM adapters",
                 "TTFT p99 ms", "TPOT p99 ms"), rows)
    print(f"targets: pagedkv adapters/base >= 0.8 (got {ratio(tps.get('pagedkv adapters'), tps.get('pagedkv base'))}),"
          f" pagedkv/vLLM adapters >= 1.2 (got {ratio(tps.get('pagedkv adapters'), tps.get('vllm adapters'))})")
    start, load, pages = report["startup_s"], report["load_in_process"], report.get("pages")
    rows = []
    for system in dict.fromkeys(k.split()[0] for k in start):
        b, lo = start.get(f"{system} base"), start.get(f"{system} lora")
        per = (pages or {}).get("adapters") if system == "pagedkv" else None
        rows.append((system, f"{b:.1f}" if b else "-", f"{lo:.1f}" if lo else "-",
                     f"{lo - b:+.1f}" if b and lo else "-",
                     f"{load['median_s']:.2f}" if system == "pagedkv" else "-",
                     f"{per[0]['num_bytes'] / MIB:.2f}" if per else "-",
                     f"{statistics.mean(p['pages'] for p in per):.1f}" if per else "-",
                     str(per[0]["held_pages"]) if per and per[0]["held_pages"] is not None else "-"))
    print_table(("system", "start s (base)", f"start s ({report['config']['adapters']} adapters)", "difference",
                 "in-process load s", "MiB per adapter", "KV pages per adapter",
                 "pages held (ModelInfo)"), rows)
    for name, n in report.get("server_notes", {}).items():
        if "compilation_mode" in n:
            print(f"({name}: compilation mode {n['compilation_mode']}, engine init {n['init_engine_s']} s, "
                  f"{n['adapters_loaded']} adapters loaded)")
    if pages:
        print(f"(one KV page: {pages['page_bytes']:,} bytes = {pages['kv_bytes_per_token']:,} B/token x "
              f"{pages['block_size']}, {pages['kv_dtype']}; stacked adapters held: {load['stacked_bytes'] / MIB:.2f} "
              f"MiB)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct", help="a registry model (default smollm2-135m-instruct)")
    ap.add_argument("--rank", type=int, default=16, help="the adapters' LoRA rank (default 16)")
    ap.add_argument("--adapters", type=int, default=8, help="adapters served (default 8)")
    ap.add_argument("--prompts", type=int, default=32, help="requests per run, all at once (default 32)")
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--lora-assignment", choices=("round-robin", "random"), default="round-robin")
    ap.add_argument("--kv-cache-gb", type=int, default=1, help="every server's KV budget in GiB (default 1)")
    ap.add_argument("--systems", default="pagedkv,vllm", help="comma-separated: pagedkv, vllm (default both)")
    ap.add_argument("--no-base-on-lora", action="store_true", help="skip base requests to the servers with adapters")
    ap.add_argument("--quick", action="store_true", help="a smoke: tiny-llama, 8 prompts of 64 + 32 tokens, 1 round")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "lora.json")
    args = ap.parse_args(argv)
    if args.quick:
        args.model, args.prompts, args.input_len, args.output_len, args.rounds = "tiny-llama", 8, 64, 32, 1
    systems = [s for s in args.systems.split(",") if s]
    report: dict[str, Any] = {"config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                              "cpus": os.cpu_count(), "skipped": {}, "refused": {}, "startup_s": {}}
    if "vllm" in systems and (why := peers_http.missing_peer("vllm")):
        print(f"vLLM skipped: {why}", flush=True)
        report["skipped"]["vllm"] = why
        systems.remove("vllm")
    base = model_dir(args.model)
    report["model_dir"] = str(base)
    adapters = make_adapters(args.model, base, args.rank, args.adapters)
    report["adapter_dirs"] = {n: str(p) for n, p in adapters.items()}
    report["load_in_process"] = load = load_in_process(base, adapters, args.rank)
    print(f"in-process adapter load ({args.adapters} adapters): {load['median_s']:.3f} s median of "
          f"{len(load['seconds'])}", flush=True)
    wl = LoraWorkload("lora", args.prompts, args.input_len, args.output_len, concurrency=args.prompts,
                      lora_modules=tuple(adapters), assignment=args.lora_assignment)
    report["workload"] = dataclasses.asdict(wl)
    servers = make_servers(systems, args.model, base, adapters, args.rank, args.kv_cache_gb)
    plan = arms(servers, not args.no_base_on_lora)
    runs: dict[str, list[dict]] = {a: [] for a in plan}
    try:
        for name, srv in servers.items():
            try:
                srv.start()
            except RuntimeError:
                report["refused"][name] = refusal(srv.log())
                print(f"  {name} refused to start: {report['refused'][name]}", flush=True)
                srv.stop()
                continue
            report["startup_s"][name] = srv.startup_s
            report.setdefault("server_notes", {})[name] = server_notes(srv)
            print(f"  {name} ready in {srv.startup_s:.1f} s", flush=True)
        if "pagedkv lora" in report["startup_s"]:
            report["pages"] = adapter_pages(servers["pagedkv lora"])
        runs = run_arms(servers, plan, wl, args.rounds, base, report["refused"])
    finally:
        for srv in servers.values():
            srv.stop()
    report["arms"] = {a: {"server": s, "adapters": len(adapters) if lora else 0, "runs": runs[a],
                          "median": medians(runs[a])} for a, (s, lora) in plan.items()}
    tps = {a: v["median"].get("output_throughput") for a, v in report["arms"].items()}
    report["ratios"] = {k: (tps.get(x) / tps.get(y) if tps.get(x) and tps.get(y) else None) for k, (x, y) in {
        "pagedkv_adapters_over_base": ("pagedkv adapters", "pagedkv base"),
        "vllm_adapters_over_base": ("vllm adapters", "vllm base"),
        "pagedkv_over_vllm_adapters": ("pagedkv adapters", "vllm adapters")}.items()}
    tables(report)
    write_report(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
