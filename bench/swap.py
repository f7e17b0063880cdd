"""Swap vs recompute: one overload trace under the three preemption policies, in one run.

The workload asks for more KV than the device pool holds: ``--num-requests`` requests (64) arrive together
(``asyncio.gather``), each a distinct random prompt of 64-384 tokens (BOS, then random ids, fixed seed)
asking for 64-256 output tokens (EOS ignored, greedy). At full length they need several times the
``--num-pages`` device pages (96 of 16 tokens), so the scheduler must preempt; the host tier is twice the
device pool (``--num-host-pages 2*P``). The prompts share no prefix, so every token the executor computes
beyond an unconstrained run (prompt tokens + one per decode step) is recomputation after a preemption.

Each policy gets a fresh ``pagedkv serve`` with the same flags except ``--preemption-mode`` (and the host tier):

* ``recompute``: no host tier (``--num-host-pages 0``): a victim's pages are dropped and its prompt and
  output so far are prefilled again (prefix caching, on by default, may still find its pages on the device);
* ``swap``: a victim's pages are copied to the host tier and copied back before it runs again;
* ``auto``: per victim, whichever the executor's start-up measurements (page copy bandwidth, prefill time
  per token: its ``executor_built`` log line) say costs less.

Per policy the bench reports wall time, output tokens/s, requests/s, latency and TTFT p50/p99 (per request,
from the moment all were sent), and from ``ModelInfo`` deltas over the workload: preemptions by kind, pages
swapped out / in, bytes moved, prefix pages spilled to the host tier and served back from it, tokens the
executor computed and the recomputed share of them. After each run every device page, host page and swap
slot must be free again (no leaks). Greedy outputs must be the same under all three policies, request by
request; any difference fails the bench (exit code 1). With ``--repeat N`` the policies run round-robin N
times (each on a fresh server) and the table shows each metric's median over the uncontended trials.

With CUDA the bench also measures page DMA with the executor's own pools and mover: 512 scattered 2 MiB
pages (a Llama-8B-like page: 32 layers, 8 KV heads x 128, fp16, 16 tokens) swapped out and in, against one
contiguous pinned copy of the same bytes (target: paged >= 90% of contiguous, each way).

    python bench/swap.py            # 64 requests, 96 device pages -> bench/results/swap.json
    python bench/swap.py --quick    # smoke run: 16 requests, 32 device pages, shorter prompts and outputs
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from common import (
    ROOT,
    Machine,
    Request,
    Server,
    StreamResult,
    check_lengths,
    first_difference,
    is_contended,
    latency_summary,
    make_workload,
    pages_for,
    print_table,
    timed_streams,
    wait_idle,
    warm_up,
    write_report,
)

from pagedkv.models import resolve_model

POLICIES = ("recompute", "swap", "auto")
PROMPT_RANGE, OUTPUT_RANGE = (64, 384), (64, 256)
QUICK_PROMPT_RANGE, QUICK_OUTPUT_RANGE = (32, 128), (32, 96)
DMA_TARGET = 0.9


def page_demand(reqs: list[Request], block_size: int) -> dict[str, int]:
    """Pages the requests need at full length (KV of prompt + max_tokens - 1 tokens), all at once and
    for the largest one."""
    full = [pages_for(len(r.prompt) + r.max_tokens - 1, block_size) for r in reqs]
    return {"all_requests_pages": sum(full), "largest_request_pages": max(full)}


# ---- one policy ---------------------------------------------------------------------------------
INFO_KEYS = ("num_pages", "num_used_pages", "peak_used_pages", "num_computed_tokens", "num_cached_prompt_tokens",
             "num_preemptions", "num_host_pages", "num_used_host_pages", "num_swapped", "num_swap_preemptions",
             "num_recompute_preemptions", "num_pages_swapped_out", "num_pages_swapped_in", "num_swap_bytes",
             "num_spilled_pages", "num_spill_hits", "num_running", "num_waiting", "max_model_len", "block_size",
             "prefix_caching")
LEAK_KEYS = ("num_used_pages", "num_used_host_pages", "num_swapped")


def _info_dict(info: Any) -> dict[str, Any]:
    return {k: getattr(info, k) for k in INFO_KEYS}


async def _settled_info(client: Any, timeout_s: float) -> tuple[dict[str, Any], dict[str, Any], float]:
    """ModelInfo right after the last stream ended, and once nothing is held any more (or ``timeout_s``
    later): the last finish message may reach the client a moment before the scheduler frees its pages."""
    t0 = time.perf_counter()
    first = info = _info_dict(await client.model_info())
    while any(info[k] for k in LEAK_KEYS) and time.perf_counter() - t0 < timeout_s:
        await asyncio.sleep(0.1)
        info = _info_dict(await client.model_info())
    return first, info, time.perf_counter() - t0


async def _workload(address: str, reqs: list[Request], wait_idle_s: float) -> dict[str, Any]:
    from pagedkv.client import Client

    async with Client(address) as client:
        await warm_up(client)  # untimed
        await asyncio.to_thread(wait_idle, wait_idle_s)
        before = _info_dict(await client.model_info(reset_peak=True))
        wall, results, cpu = await timed_streams(client, reqs)
        immediate, after, settle_s = await _settled_info(client, 10.0)
    return {"wall_s": wall, "results": results, "cpu": cpu, "info_before": before,
            "info_immediate": immediate, "info_after": after, "settle_s": settle_s}


EXECUTOR_BUILT = re.compile(r"\bexecutor_built\b")
LOG_FIELDS = {"prefill_us_per_token": float, "swap_gb_per_s": float, "page_bytes": int, "device": str}


def executor_costs(log: str) -> dict[str, Any]:
    """The executor's start-up measurements from its ``executor_built`` line (console or JSON logs);
    absent fields are None."""
    out: dict[str, Any] = dict.fromkeys(LOG_FIELDS)
    line = next((ln for ln in log.splitlines() if EXECUTOR_BUILT.search(ln)), None)
    if line is None:
        return out
    for key, conv in LOG_FIELDS.items():
        m = re.search(rf'"?\b{key}"?\s*[=:]\s*"?([^\s",}}]+)', line)
        if m:
            try:
                out[key] = conv(m.group(1))
            except ValueError:
                pass
    return out


def server_args(args: argparse.Namespace, model: str, mode: str) -> list[str]:
    out = ["--model", model, "--dtype", "float32", "--block-size", str(args.block_size),
           "--num-pages", str(args.num_pages),
           # recompute-only means no host tier at all (no spill either): what a server without swap does
           "--num-host-pages", str(0 if mode == "recompute" else args.num_host_pages),
           "--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
           "--preemption-mode", mode]
    if not args.prefix_caching:
        out.append("--no-enable-prefix-caching")
    if args.check_integrity:
        out.append("--check-integrity")
    return out


def run_policy(args: argparse.Namespace, model: str, mode: str, reqs: list[Request]) -> dict[str, Any]:
    serve_args = server_args(args, model, mode)
    t_start = time.perf_counter()
    server = Server(serve_args)
    startup = time.perf_counter() - t_start
    costs = executor_costs(server.log())  # read now: the log keeps only its last lines
    try:
        raw = asyncio.run(_workload(server.address, reqs, args.wait_idle))
    except BaseException:
        print(server.log(), file=sys.stderr)
        raise
    finally:
        server.stop()
    results: list[StreamResult] = raw["results"]
    check_lengths(reqs, results, f"{mode}: request")
    before, after, wall = raw["info_before"], raw["info_after"], raw["wall_s"]

    def delta(key: str) -> int:
        return after[key] - before[key]

    prompt_tokens = sum(len(r.prompt) for r in reqs)
    decode_steps = sum(r.max_tokens - 1 for r in reqs)  # the first output token comes from the prefill
    computed = delta("num_computed_tokens")
    out_tokens = sum(len(res.token_ids) for res in results)
    ttfts = [res.ttft_s for res in results]
    lat = [res.latency_s for res in results]
    leaks = {k: after[k] for k in LEAK_KEYS}
    return {
        "preemption_mode": mode,
        "requests": len(reqs),
        "prompt_tokens": prompt_tokens,
        "output_tokens": out_tokens,
        "wall_s": wall,
        "tokens_per_s": out_tokens / wall,
        "requests_per_s": len(reqs) / wall,
        **latency_summary(ttfts, lat),
        "preemptions": delta("num_preemptions"),
        "swap_preemptions": delta("num_swap_preemptions"),
        "recompute_preemptions": delta("num_recompute_preemptions"),
        "pages_swapped_out": delta("num_pages_swapped_out"),
        "pages_swapped_in": delta("num_pages_swapped_in"),
        "swap_bytes": delta("num_swap_bytes"),
        "spilled_pages": delta("num_spilled_pages"),
        "spill_hits": delta("num_spill_hits"),
        "computed_tokens": computed,
        "unconstrained_tokens": prompt_tokens + decode_steps,
        "recomputed_tokens": computed - (prompt_tokens + decode_steps),
        "cached_prompt_tokens": delta("num_cached_prompt_tokens"),
        "peak_used_pages": after["peak_used_pages"],
        "num_pages": after["num_pages"],
        "num_host_pages": after["num_host_pages"],
        "max_model_len": after["max_model_len"],
        "prefix_caching": after["prefix_caching"],
        "leaks": leaks,
        "leaks_right_after": {k: raw["info_immediate"][k] for k in LEAK_KEYS},
        "leak_free": not any(leaks.values()),
        "settle_s": raw["settle_s"],
        "executor": costs,
        "server_startup_s": startup,
        "cpu": raw["cpu"],
        "server_args": serve_args,
        "outputs": [res.token_ids for res in results],
    }


# ---- page DMA (CUDA) ----------------------------------------------------------------------------
def dma_model_config(num_layers: int = 32, num_kv_heads: int = 8, head_dim: int = 128) -> Any:
    """A Llama-8B-like shape for the page pools (only the KV geometry matters here)."""
    from executor_svc.model_config import ModelConfig

    return ModelConfig(path=Path("<synthetic>"), architecture="LlamaForCausalLM", hf_config=None, vocab_size=32000,
                       hidden_size=4096, intermediate_size=14336, num_layers=num_layers, num_heads=32,
                       num_kv_heads=num_kv_heads, head_dim=head_dim, rms_norm_eps=1e-5,
                       max_position_embeddings=8192, tie_word_embeddings=False, attention_bias=False,
                       sliding_window=None, eos_token_ids=(2,))


def page_dma(device: str | torch.device = "cuda", num_pages: int = 512, num_layers: int = 32, num_kv_heads: int = 8,
             head_dim: int = 128, block_size: int = 16, dtype: torch.dtype = torch.float16,
             repeats: int = 5) -> dict[str, Any]:
    """Page DMA through the executor's ``DevicePagePool`` / ``HostPagePool`` / ``PageMover``: ``num_pages``
    scattered pages (host ids in reverse order, so no two copies merge into a run) out to the host and back,
    against one contiguous copy of the same bytes between the same (pinned, on CUDA) buffers. Median of
    ``repeats`` timed runs after a warm-up; the round trip is checked to preserve every page's contents."""
    from executor_svc.pages import DevicePagePool, HostPagePool, PageMover

    dev = torch.device(device)
    cfg = dma_model_config(num_layers, num_kv_heads, head_dim)
    pool = DevicePagePool(cfg, num_pages, block_size, dtype, dev)
    host = HostPagePool(pool, num_pages)
    mover = PageMover(pool, host)
    ids = list(range(num_pages))
    pairs_out = list(zip(ids, ids[::-1], strict=True))  # device i -> host n-1-i
    pairs_in = [(h, d) for d, h in pairs_out]
    nbytes = num_pages * pool.page_bytes
    dflat, hflat = pool.pages.view(-1), host.pages.view(-1)

    def sync() -> None:
        mover.synchronize()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def timed(fn) -> dict[str, float]:
        fn()  # warm-up
        sync()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - t0)
        med = statistics.median(times)
        return {"median_s": med, "best_s": min(times), "gb_per_s": nbytes / med / 1e9,
                "best_gb_per_s": nbytes / min(times) / 1e9, "pages_per_s": num_pages / med}

    # correctness: the round trip through the host tier brings every page back to its own slot
    pool.pages.copy_(torch.randn(pool.pages.shape, dtype=torch.float32).to(dtype))
    reference = pool.pages.clone()
    mover.run(pairs_out, [])
    pool.pages.zero_()
    mover.run([], pairs_in)
    sync()
    round_trip_ok = bool(torch.equal(pool.pages, reference))
    del reference

    non_blocking = dev.type == "cuda"
    res = {
        "paged_out": timed(lambda: mover.run(pairs_out, [])),
        "paged_in": timed(lambda: mover.run([], pairs_in)),
        "contiguous_out": timed(lambda: hflat.copy_(dflat, non_blocking=non_blocking)),
        "contiguous_in": timed(lambda: dflat.copy_(hflat, non_blocking=non_blocking)),
    }
    ratio_out = res["paged_out"]["gb_per_s"] / res["contiguous_out"]["gb_per_s"]
    ratio_in = res["paged_in"]["gb_per_s"] / res["contiguous_in"]["gb_per_s"]
    out = {"device": str(dev), "num_pages": num_pages, "page_bytes": pool.page_bytes, "bytes": nbytes,
           "dtype": str(dtype).removeprefix("torch."), "shape": list(pool.pages.shape[1:]),
           "host_pinned": bool(host.pages.is_pinned()) if dev.type == "cuda" else False,
           "round_trip_ok": round_trip_ok, "repeats": repeats, **res,
           "ratio_out": ratio_out, "ratio_in": ratio_in, "target_ratio": DMA_TARGET,
           "target_met": round_trip_ok and min(ratio_out, ratio_in) >= DMA_TARGET}
    return out


def print_dma(d: dict[str, Any]) -> None:
    mib = d["page_bytes"] / (1 << 20)
    print(f"page DMA ({d['device']}, {d['num_pages']} scattered pages of {mib:.3g} MiB, "
          f"{d['bytes'] / 1e6:,.1f} MB, median of {d['repeats']}):")
    for way, label in (("out", "device -> host"), ("in", "host -> device")):
        print(f"  {label}: paged {d[f'paged_{way}']['gb_per_s']:.2f} GB/s "
              f"({d[f'paged_{way}']['pages_per_s']:,.0f} pages/s), contiguous "
              f"{d[f'contiguous_{way}']['gb_per_s']:.2f} GB/s, ratio {d[f'ratio_{way}']:.2%}")
    print(f"  round trip intact: {d['round_trip_ok']}; target paged >= {DMA_TARGET:.0%} of contiguous: "
          f"{'met' if d['target_met'] else 'NOT met'}")


# ---- report -------------------------------------------------------------------------------------
@dataclass(slots=True)
class Config(Machine):
    model: str
    model_dir: str
    seed: int
    num_requests: int
    prompt_range: tuple[int, int]
    output_range: tuple[int, int]
    block_size: int
    num_pages: int
    num_host_pages: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    repeat: int
    prefix_caching: bool = True
    dtype: str = "float32"
    quick: bool = False
    order: str = "recompute, swap, auto (round-robin per trial)"


# (label, key, format, ratios vs recompute shown)
ROWS: list[tuple[str, str, str, bool]] = [
    ("wall (s)", "wall_s", "{:.2f}", False),
    ("output tokens/s", "tokens_per_s", "{:.1f}", True),
    ("requests/s", "requests_per_s", "{:.2f}", False),
    ("latency p50 (s)", "latency_p50_s", "{:.2f}", False),
    ("latency p99 (s)", "latency_p99_s", "{:.2f}", True),
    ("TTFT p50 (s)", "ttft_p50_s", "{:.2f}", False),
    ("TTFT p99 (s)", "ttft_p99_s", "{:.2f}", False),
    ("preemptions: swap", "swap_preemptions", "int", False),
    ("preemptions: recompute", "recompute_preemptions", "int", False),
    ("pages swapped out", "pages_swapped_out", "int", False),
    ("pages swapped in", "pages_swapped_in", "int", False),
    ("MB moved", "swap_mb", "{:.1f}", False),
    ("spilled pages", "spilled_pages", "int", False),
    ("spill hits", "spill_hits", "int", False),
    ("tokens computed", "computed_tokens", "int", False),
    ("recomputed tokens", "recomputed_tokens", "int", False),
    ("prompt tokens from cache", "cached_prompt_tokens", "int", False),
    ("peak KV pages", "peak_used_pages", "int", False),
]
RATIO_KEYS = [key for _, key, _, with_ratio in ROWS if with_ratio]
NUMERIC_KEYS = [key for _, key, _, _ in ROWS if key != "swap_mb"] + [
    "preemptions", "swap_bytes", "latency_mean_s", "ttft_mean_s", "server_startup_s", "settle_s"]


def _fmt(value: float, spec: str) -> str:
    if spec == "int":
        return f"{value:,.0f}" if float(value).is_integer() else f"{value:,.1f}"
    return spec.format(value)


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One policy over its trials: each metric's median over the uncontended trials (all if none is)."""
    clean = [r for r in runs if not is_contended(r)] or runs
    out: dict[str, Any] = {k: statistics.median(r[k] for r in clean) for k in NUMERIC_KEYS}
    out["swap_mb"] = statistics.median(r["swap_bytes"] for r in clean) / 1e6
    first = runs[0]
    out.update(preemption_mode=first["preemption_mode"], requests=first["requests"],
               prompt_tokens=first["prompt_tokens"], output_tokens=first["output_tokens"],
               unconstrained_tokens=first["unconstrained_tokens"], num_pages=first["num_pages"],
               num_host_pages=first["num_host_pages"], max_model_len=first["max_model_len"],
               prefix_caching=first["prefix_caching"], server_args=first["server_args"],
               leak_free=all(r["leak_free"] for r in runs), trials=len(runs),
               trials_used=[i for i, r in enumerate(runs) if any(r is c for c in clean)],
               trial_contended=[is_contended(r) for r in runs], executor=first["executor"])
    return out


def ratios(summary: dict[str, dict[str, Any]]) -> dict[str, float]:
    base = summary["recompute"]
    out: dict[str, float] = {}
    for mode in ("swap", "auto"):
        for key in RATIO_KEYS:
            out[f"{key} ({mode}/recompute)"] = summary[mode][key] / base[key] if base[key] else float("inf")
    return out


def print_policies(summary: dict[str, dict[str, Any]], rat: dict[str, float]) -> None:
    header = ("metric", *POLICIES, "swap/recompute", "auto/recompute")
    body = []
    for label, key, spec, with_ratio in ROWS:
        cells = [_fmt(summary[m][key], spec) for m in POLICIES]
        rs = [f"{rat[f'{key} ({m}/recompute)']:.2f}x" if with_ratio else "" for m in ("swap", "auto")]
        body.append((label, *cells, *rs))
    print_table(header, body)


def executor_line(mode: str, costs: dict[str, Any], block_size: int) -> str:
    pre, bw, pb = costs.get("prefill_us_per_token"), costs.get("swap_gb_per_s"), costs.get("page_bytes")
    parts = [f"prefill {pre:g} us/token" if pre is not None else "prefill n/a",
             f"page copy {bw:g} GB/s (out + in)" if bw is not None else "page copy n/a",
             f"page {pb / 1024:g} KiB" if pb else "page n/a"]
    if pre and bw and pb:  # one page: copy out and back in vs prefill its tokens again
        swap_us, recompute_us = 2 * pb / (bw * 1e9) * 1e6, block_size * pre
        parts.append(f"per page: swap {swap_us:.2f} us vs recompute {recompute_us:.1f} us")
    return f"executor ({mode}, {costs.get('device') or 'device n/a'}): " + ", ".join(parts)


def compare_outputs(reqs: list[Request], trials: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Requests whose greedy output in some policy and trial differs from recompute's first trial."""
    ref = trials["recompute"][0]["outputs"]
    bad = []
    for mode in POLICIES:
        for t, run in enumerate(trials[mode]):
            for r, a, b in zip(reqs, ref, run["outputs"], strict=True):
                if a != b:
                    bad.append({"policy": mode, "trial": t, "index": r.index, "first_diff": first_difference(a, b),
                                "reference": a, "output": b})
    return bad


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny-llama", help="built-in name or a local HF directory")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "swap.json")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-pages", type=int, default=96, help="device KV pages per server")
    p.add_argument("--num-host-pages", type=int, default=0, help="host tier pages (0: twice --num-pages)")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--repeat", type=int, default=1,
                   help="trials per policy, round-robin, each on a fresh server; medians are reported")
    p.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="the servers' prefix caching (on: the server default; a recompute victim's pages may then "
                        "come back from the host tier as prefix spill hits instead of being recomputed)")
    p.add_argument("--check-integrity", action="store_true", help="servers check page accounting every step")
    p.add_argument("--dma-pages", type=int, default=512, help="pages in the CUDA page-DMA measurement (0: skip)")
    p.add_argument("--wait-idle", type=float, default=600.0,
                   help="before each policy's workload, wait up to this many seconds for other processes to "
                        "leave the CPUs")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 16 requests, 32 device pages, prompts 32-128 and outputs 32-96 tokens")
    p.add_argument("--dma-only", action="store_true",
                   help="only the page DMA measurement (needs CUDA; what bench/gpu_check.sh runs)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.dma_only:
        if not torch.cuda.is_available():
            print("page DMA: skipped (no CUDA)")
            return 0
        dma = page_dma("cuda", num_pages=args.dma_pages)
        print_dma(dma)
        write_report(args.out.with_name("swap_dma.json"), dma)
        return 0
    prompt_range, output_range = PROMPT_RANGE, OUTPUT_RANGE
    if args.quick:
        args.num_requests, args.num_pages = min(args.num_requests, 16), min(args.num_pages, 32)
        prompt_range, output_range = QUICK_PROMPT_RANGE, QUICK_OUTPUT_RANGE
    if args.num_host_pages <= 0:
        args.num_host_pages = 2 * args.num_pages
    if args.num_requests < 1 or args.num_pages < 1 or args.repeat < 1:
        print("error: --num-requests, --num-pages and --repeat must be >= 1", file=sys.stderr)
        return 2
    model_dir = resolve_model(args.model)
    config = json.loads((model_dir / "config.json").read_text())
    vocab = config["vocab_size"]
    max_model_len = min(config["max_position_embeddings"], args.num_pages * args.block_size)
    longest = prompt_range[1] + output_range[1]
    if longest > max_model_len:
        print(f"error: prompt {prompt_range[1]} + output {output_range[1]} = {longest} tokens exceeds "
              f"max_model_len {max_model_len} (min of the model's {config['max_position_embeddings']} and "
              f"{args.num_pages} pages x {args.block_size} tokens); raise --num-pages", file=sys.stderr)
        return 2
    reqs = make_workload(args.num_requests, args.seed, vocab, prompt_range, output_range)
    demand = page_demand(reqs, args.block_size)
    cfg = Config(model=args.model, model_dir=str(model_dir), seed=args.seed, num_requests=args.num_requests,
                 prompt_range=prompt_range, output_range=output_range, block_size=args.block_size,
                 num_pages=args.num_pages, num_host_pages=args.num_host_pages, max_num_seqs=args.max_num_seqs,
                 max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=max_model_len,
                 repeat=args.repeat, prefix_caching=args.prefix_caching, quick=args.quick)
    print(f"workload: {len(reqs)} requests, {sum(len(r.prompt) for r in reqs)} prompt tokens, "
          f"{sum(r.max_tokens for r in reqs)} output tokens (seed {args.seed}); at full length they need "
          f"{demand['all_requests_pages']} pages ({demand['all_requests_pages'] / args.num_pages:.1f}x the "
          f"{args.num_pages} device pages of {args.block_size} tokens; host tier {args.num_host_pages} pages); "
          f"{cfg.nproc} CPUs, torch {cfg.torch_version} ({cfg.torch_threads} threads)", flush=True)

    trials: dict[str, list[dict[str, Any]]] = {m: [] for m in POLICIES}
    for trial in range(args.repeat):
        for mode in POLICIES:
            label = f" (trial {trial + 1}/{args.repeat})" if args.repeat > 1 else ""
            print(f"running --preemption-mode {mode}{label} ...", flush=True)
            res = run_policy(args, str(model_dir), mode, reqs)
            trials[mode].append(res)
            print(f"  {mode}: {res['wall_s']:.2f}s, {res['tokens_per_s']:.1f} tokens/s, preemptions "
                  f"{res['swap_preemptions']} swap + {res['recompute_preemptions']} recompute, "
                  f"{res['recomputed_tokens']} tokens recomputed", flush=True)
            if not res["leak_free"]:
                print(f"  ERROR: after the {mode} run the server still holds {res['leaks']}", flush=True)
            if is_contended(res):
                print(f"  WARNING: other processes used {res['cpu']['foreign_share']:.0%} of the machine's CPU "
                      f"during the {mode} run; its timings are not trustworthy", flush=True)
    summary = {m: summarize(trials[m]) for m in POLICIES}
    rat = ratios(summary)
    mismatches = compare_outputs(reqs, trials)

    print()
    print_policies(summary, rat)
    print()
    for mode in POLICIES:
        print(executor_line(mode, summary[mode]["executor"], args.block_size))
    if args.repeat > 1:
        for mode in POLICIES:
            walls = ", ".join(f"{r['wall_s']:.2f}" for r in trials[mode])
            print(f"{mode} trial walls (s): {walls}; medians over trials {summary[mode]['trials_used']}")

    dma: dict[str, Any] | None = None
    if args.dma_pages <= 0:
        print("page DMA: skipped (--dma-pages 0)")
    elif not torch.cuda.is_available():
        print("page DMA: skipped (no CUDA)")
    else:
        dma = page_dma("cuda", num_pages=args.dma_pages)
        torch.cuda.empty_cache()  # the pools died with page_dma's frame
        print_dma(dma)

    notes: list[str] = []
    for mode in POLICIES:
        s = summary[mode]
        if not s["preemptions"]:
            notes.append(f"{mode}: no preemptions; the trace did not overload the pool (lower --num-pages)")
        if mode == "recompute" and s["swap_preemptions"]:
            notes.append(f"recompute: {s['swap_preemptions']} swap preemptions under --preemption-mode recompute")
        if mode == "swap" and s["recompute_preemptions"]:
            notes.append(f"swap: {s['recompute_preemptions']} victims recomputed under --preemption-mode swap "
                         "(host tier full, or a victim larger than it)")
        if mode != "recompute" and s["preemptions"] and not s["swap_preemptions"]:
            notes.append(f"{mode}: no victim was swapped")
        if s["spill_hits"]:
            notes.append(f"{mode}: {s['spill_hits']:g} pages came back from the host tier as prefix spill hits "
                         f"({s['spill_hits'] * args.block_size:g} tokens not recomputed, not counted as prompt "
                         "tokens from cache)" + ("; --no-prefix-caching gives a pure recompute baseline"
                                                 if mode == "recompute" else ""))
    for n in notes:
        print(f"NOTE: {n}")
    leak_free = all(summary[m]["leak_free"] for m in POLICIES)
    if not leak_free:
        print("ERROR: pages, host pages or swap slots still held after a run: "
              + "; ".join(f"{m} trial {i}: {r['leaks']}" for m in POLICIES for i, r in enumerate(trials[m])
                          if not r["leak_free"]), file=sys.stderr)
    contended = any(is_contended(r) for runs in trials.values() for r in runs)
    if contended:
        print("WARNING: other processes competed for the CPUs during a measured run (see 'cpu' in the JSON); "
              "rerun on an idle machine")
    if mismatches:
        first = mismatches[0]
        print(f"ERROR: greedy outputs differ between policies: {len(mismatches)} (policy, trial, request) "
              f"outputs differ from recompute's first trial (first: {first['policy']} trial {first['trial']}, "
              f"request {first['index']} at output position {first['first_diff']})", file=sys.stderr)
    else:
        print(f"outputs: recompute == swap == auto for all {len(reqs)} requests"
              + (f" in all {args.repeat} trials" if args.repeat > 1 else ""))

    report = {"contended": contended, "config": asdict(cfg), "page_demand": demand,
              "policies": summary, "ratios": rat, "leak_free": leak_free,
              "trials": {m: [{k: v for k, v in r.items() if k != "outputs"} for r in runs]
                         for m, runs in trials.items()},
              "outputs_match": not mismatches, "mismatches": mismatches, "notes": notes, "page_dma": dma,
              "workload": [{"prompt_len": len(r.prompt), "max_tokens": r.max_tokens} for r in reqs]}
    write_report(args.out, report)
    return 1 if mismatches or not leak_free else 0


if __name__ == "__main__":
    sys.exit(main())
