"""Prefix sharing: the same shared-prefix workload with prefix caching off and on, in one run.

The workload is the seeds' example: ``--num-requests`` requests (100) arrive together (``asyncio.gather``),
all sharing one ``--prefix-len``-token prefix (2,000 tokens: a system prompt plus RAG documents), each
followed by its own suffix of 1-32 tokens and asking for 4-16 output tokens (EOS ignored, greedy). Every
suffix starts with a token distinct per request (for up to 256 requests), so only the prefix pages can
match. The server is single-tenant (no tenants file), so all requests share one prefix cache.

Each mode gets a fresh ``pagedkv serve`` with the same flags except ``--[no-]enable-prefix-caching``, and
enough KV pages that the caching-off run never preempts. Per mode the bench reports peak KV pages in use
(``ModelInfo.peak_used_pages``, reset just before the workload), prompt tokens the executor computed
(computed tokens minus one per decode step), TTFT p50/p99 (send to the first message carrying a token),
wall time, output tokens/s and requests/s, and then the ratios off/on (on/off for rates). Greedy outputs
with caching on must equal those with caching off, request by request; any mismatch fails the bench.

    python bench/prefix_sharing.py            # 100 requests, 2,000-token prefix -> bench/results/prefix_sharing.json
    python bench/prefix_sharing.py --quick    # smoke run: 20 requests, 500-token prefix
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from common import (
    BOS_ID,
    FIRST_BYTE_ID,
    ROOT,
    Machine,
    Request,
    Server,
    StreamResult,
    check_lengths,
    first_difference,
    is_contended,
    latency_summary,
    pages_for,
    print_table,
    timed_streams,
    wait_idle,
    warm_up,
    write_report,
)

from pagedkv.models import resolve_model

TENANT = "rag"
SUFFIX_RANGE = (1, 32)
OUTPUT_RANGE = (4, 16)


# ---- workload ----------------------------------------------------------------------------------

def make_workload(num_requests: int, prefix_len: int, seed: int, vocab_size: int) -> list[Request]:
    """One shared prefix (BOS + random byte tokens, ``prefix_len`` in all), then per request a suffix whose
    first token is distinct per request (cycling after ``vocab_size - 3`` requests) and random ids after."""
    rng = random.Random(seed)
    prefix = [BOS_ID] + [rng.randrange(FIRST_BYTE_ID, vocab_size) for _ in range(prefix_len - 1)]
    num_ids = vocab_size - FIRST_BYTE_ID
    reqs: list[Request] = []
    for i in range(num_requests):
        slen = rng.randint(*SUFFIX_RANGE)
        olen = rng.randint(*OUTPUT_RANGE)
        suffix = [FIRST_BYTE_ID + i % num_ids] + [rng.randrange(FIRST_BYTE_ID, vocab_size) for _ in range(slen - 1)]
        reqs.append(Request(i, prefix + suffix, olen))
    return reqs


def page_bounds(reqs: list[Request], prefix_len: int, block_size: int) -> dict[str, int]:
    """Pages every request needs at full length (KV of prompt + max_tokens - 1 tokens: the last sampled token
    is never run), all resident at once: without sharing, and with the prefix's full pages stored once."""
    shared = prefix_len // block_size
    full = [pages_for(len(r.prompt) + r.max_tokens - 1, block_size) for r in reqs]
    return {"shared_prefix_pages": shared, "no_sharing_pages": sum(full),
            "ideal_sharing_pages": shared + sum(f - shared for f in full)}


# ---- one mode ----------------------------------------------------------------------------------
def _info_dict(info: Any) -> dict[str, Any]:
    keys = ("num_pages", "num_used_pages", "peak_used_pages", "num_computed_tokens", "num_cached_prompt_tokens",
            "num_cached_pages", "num_preemptions", "prefix_caching", "block_size", "max_model_len",
            "attention_backend", "dtype")
    return {k: getattr(info, k) for k in keys}


async def _workload(address: str, reqs: list[Request], wait_idle_s: float) -> dict[str, Any]:
    from pagedkv.client import Client

    async with Client(address) as client:
        await warm_up(client)  # untimed; shares nothing
        await asyncio.to_thread(wait_idle, wait_idle_s)
        before = _info_dict(await client.model_info(reset_peak=True))
        wall, results, cpu = await timed_streams(client, reqs)
        after = _info_dict(await client.model_info())
    return {"wall_s": wall, "results": results, "cpu": cpu, "info_before": before, "info_after": after}


def run_mode(args: argparse.Namespace, model: str, caching: bool, reqs: list[Request]) -> dict[str, Any]:
    serve_args = ["--model", model, "--dtype", "float32", "--block-size", str(args.block_size),
                  "--num-pages", str(args.num_pages), "--max-num-seqs", str(args.max_num_seqs),
                  "--max-num-batched-tokens", str(args.max_num_batched_tokens),
                  "--enable-prefix-caching" if caching else "--no-enable-prefix-caching"]
    if args.check_integrity:
        serve_args.append("--check-integrity")
    t_start = time.perf_counter()
    server = Server(serve_args)
    startup = time.perf_counter() - t_start
    try:
        raw = asyncio.run(_workload(server.address, reqs, args.wait_idle))
    except BaseException:
        print(server.log(), file=sys.stderr)
        raise
    finally:
        server.stop()
    results: list[StreamResult] = raw["results"]
    check_lengths(reqs, results)
    before, after, wall = raw["info_before"], raw["info_after"], raw["wall_s"]
    if after["prefix_caching"] != caching:
        raise RuntimeError(f"server reports prefix_caching={after['prefix_caching']}, expected {caching}")
    computed = after["num_computed_tokens"] - before["num_computed_tokens"]
    decode_steps = sum(r.max_tokens - 1 for r in reqs)  # the first output token comes from the prefill
    prompt_tokens = sum(len(r.prompt) for r in reqs)
    cached = after["num_cached_prompt_tokens"] - before["num_cached_prompt_tokens"]
    out_tokens = sum(len(res.token_ids) for res in results)
    ttfts = [res.ttft_s for res in results]
    lat = [res.latency_s for res in results]
    return {
        "prefix_caching": caching,
        "requests": len(reqs),
        "prompt_tokens": prompt_tokens,
        "output_tokens": out_tokens,
        "peak_used_pages": after["peak_used_pages"],
        "used_pages_before": before["num_used_pages"],
        "used_pages_after": after["num_used_pages"],
        "num_pages": after["num_pages"],
        "computed_tokens": computed,
        "decode_tokens": decode_steps,
        "prefill_tokens_computed": computed - decode_steps,
        "cached_prompt_tokens": cached,
        "usage_cached_tokens": sum(res.cached_tokens for res in results),
        "requests_with_cache_hit": sum(1 for res in results if res.cached_tokens > 0),
        "preemptions": after["num_preemptions"] - before["num_preemptions"],
        "wall_s": wall,
        "tokens_per_s": out_tokens / wall,
        "requests_per_s": len(reqs) / wall,
        "computed_tokens_per_s": computed / wall,
        **latency_summary(ttfts, lat),
        "server_startup_s": startup,
        "cpu": raw["cpu"],
        "server_args": serve_args,
        "outputs": [res.token_ids for res in results],
    }


# ---- report ------------------------------------------------------------------------------------
@dataclass(slots=True)
class Config(Machine):
    model: str
    model_dir: str
    seed: int
    num_requests: int
    prefix_len: int
    suffix_range: tuple[int, int]
    output_range: tuple[int, int]
    block_size: int
    num_pages: int
    max_num_batched_tokens: int
    max_num_seqs: int
    tenant: str = "default"
    dtype: str = "float32"
    quick: bool = False
    order: str = "caching off then on"


# (label, key, format, ratio direction: "off/on", "on/off" or "" for none)
ROWS: list[tuple[str, str, str, str]] = [
    ("peak KV pages", "peak_used_pages", "{:d}", "off/on"),
    ("prefill tokens computed", "prefill_tokens_computed", "{:d}", "off/on"),
    ("prompt tokens from cache", "cached_prompt_tokens", "{:d}", ""),
    ("all tokens computed", "computed_tokens", "{:d}", "off/on"),
    ("TTFT p50 (s)", "ttft_p50_s", "{:.3f}", "off/on"),
    ("TTFT p99 (s)", "ttft_p99_s", "{:.3f}", "off/on"),
    ("latency p99 (s)", "latency_p99_s", "{:.3f}", "off/on"),
    ("wall (s)", "wall_s", "{:.2f}", "off/on"),
    ("output tokens/s", "tokens_per_s", "{:.1f}", "on/off"),
    ("requests/s", "requests_per_s", "{:.2f}", "on/off"),
    ("preemptions", "preemptions", "{:d}", ""),
]


def ratios(off: dict[str, Any], on: dict[str, Any]) -> dict[str, float]:
    out: dict[str, float] = {}
    for _, key, _, direction in ROWS:
        if not direction:
            continue
        num, den = (off[key], on[key]) if direction == "off/on" else (on[key], off[key])
        out[f"{key} ({direction})"] = num / den if den else float("inf")
    return out


def print_modes(off: dict[str, Any], on: dict[str, Any], rat: dict[str, float]) -> None:
    header = ("metric", "caching off", "caching on", "ratio")
    body = []
    for label, key, fmt, direction in ROWS:
        r = f"{rat[f'{key} ({direction})']:.2f}x {direction}" if direction else ""
        body.append((label, fmt.format(off[key]), fmt.format(on[key]), r))
    print_table(header, body)


def compare_outputs(reqs: list[Request], off: dict[str, Any], on: dict[str, Any]) -> list[dict[str, Any]]:
    """Requests whose greedy outputs differ between the two modes, with the first differing position."""
    bad = []
    for r, a, b in zip(reqs, off["outputs"], on["outputs"], strict=True):
        if a != b:
            bad.append({"index": r.index, "first_diff": first_difference(a, b), "caching_off": a, "caching_on": b})
    return bad


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny-llama", help="built-in name or a local HF directory")
    p.add_argument("--num-requests", type=int, default=100)
    p.add_argument("--prefix-len", type=int, default=2000, help="shared prefix length in tokens (BOS included)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "prefix_sharing.json")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-pages", type=int, default=0,
                   help="KV pages per server (0: enough for every request at full length without sharing, "
                        "plus slack, at least 1024)")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--check-integrity", action="store_true", help="servers check page accounting every step")
    p.add_argument("--wait-idle", type=float, default=600.0,
                   help="before each mode's workload, wait up to this many seconds for other processes to "
                        "leave the CPUs")
    p.add_argument("--quick", action="store_true", help="smoke run: 20 requests, 500-token prefix")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.quick:
        args.num_requests, args.prefix_len = min(args.num_requests, 20), min(args.prefix_len, 500)
    model_dir = resolve_model(args.model)
    config = json.loads((model_dir / "config.json").read_text())
    vocab, max_len = config["vocab_size"], config["max_position_embeddings"]
    longest = args.prefix_len + SUFFIX_RANGE[1] + OUTPUT_RANGE[1]
    if longest > max_len:
        print(f"error: prefix {args.prefix_len} + suffix {SUFFIX_RANGE[1]} + output {OUTPUT_RANGE[1]} = {longest} "
              f"tokens exceeds the model's {max_len}", file=sys.stderr)
        return 2
    if args.prefix_len < 1 or args.num_requests < 1:
        print("error: --prefix-len and --num-requests must be >= 1", file=sys.stderr)
        return 2
    reqs = make_workload(args.num_requests, args.prefix_len, args.seed, vocab)
    bounds = page_bounds(reqs, args.prefix_len, args.block_size)
    if args.num_pages <= 0:
        args.num_pages = max(1024, int(bounds["no_sharing_pages"] * 1.1) + 64)
    cfg = Config(model=args.model, model_dir=str(model_dir), seed=args.seed, num_requests=args.num_requests,
                 prefix_len=args.prefix_len, suffix_range=SUFFIX_RANGE, output_range=OUTPUT_RANGE,
                 block_size=args.block_size, num_pages=args.num_pages,
                 max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
                 quick=args.quick)
    print(f"workload: {len(reqs)} requests, shared prefix {args.prefix_len} tokens, "
          f"{sum(len(r.prompt) for r in reqs)} prompt tokens, {sum(r.max_tokens for r in reqs)} output tokens "
          f"(seed {args.seed}); {args.num_pages} KV pages of {args.block_size} tokens; "
          f"{cfg.nproc} CPUs, torch {cfg.torch_version} ({cfg.torch_threads} threads)", flush=True)

    runs: dict[str, dict[str, Any]] = {}
    for name, caching in (("off", False), ("on", True)):
        print(f"running prefix caching {name} ...", flush=True)
        res = run_mode(args, str(model_dir), caching, reqs)
        runs[name] = res
        print(f"  caching {name}: {res['wall_s']:.2f}s, peak {res['peak_used_pages']} pages, "
              f"{res['prefill_tokens_computed']} prefill tokens computed, TTFT p50 {res['ttft_p50_s']:.3f}s",
              flush=True)
        if is_contended(res):
            print(f"  WARNING: other processes used {res['cpu']['foreign_share']:.0%} of the machine's CPU "
                  f"during the caching-{name} run; its timings are not trustworthy", flush=True)
    off, on = runs["off"], runs["on"]
    rat = ratios(off, on)
    mismatches = compare_outputs(reqs, off, on)

    print()
    print_modes(off, on, rat)
    print()
    print(f"KV pages for all requests at full length: no sharing {bounds['no_sharing_pages']}, ideal sharing "
          f"{bounds['ideal_sharing_pages']} ({bounds['shared_prefix_pages']} prefix pages stored once); "
          f"observed peak: off {off['peak_used_pages']}, on {on['peak_used_pages']} "
          f"({on['peak_used_pages'] / bounds['ideal_sharing_pages']:.2f}x ideal)")
    print(f"prompt tokens {off['prompt_tokens']}; with caching on {on['requests_with_cache_hit']}/{len(reqs)} "
          f"requests hit the cache ({on['usage_cached_tokens']} cached tokens in usage)")
    notes: list[str] = []
    for name, res in runs.items():
        if res["prefill_tokens_computed"] + res["cached_prompt_tokens"] != res["prompt_tokens"]:
            notes.append(f"caching {name}: prefill computed {res['prefill_tokens_computed']} + cached "
                         f"{res['cached_prompt_tokens']} != prompt tokens {res['prompt_tokens']}")
        if res["preemptions"]:
            notes.append(f"caching {name}: {res['preemptions']} preemptions (recomputed tokens inflate "
                         "'computed'); raise --num-pages")
    for n in notes:
        print(f"NOTE: {n}")
    contended = is_contended(off) or is_contended(on)
    if contended:
        print("WARNING: other processes competed for the CPUs during a measured run (see 'cpu' in the JSON); "
              "rerun on an idle machine")
    if mismatches:
        print(f"ERROR: greedy outputs differ between caching off and on for {len(mismatches)}/{len(reqs)} "
              f"requests (first: request {mismatches[0]['index']} at output position "
              f"{mismatches[0]['first_diff']})", file=sys.stderr)
    else:
        print(f"outputs: caching on == caching off for all {len(reqs)} requests")

    strip = {k: v for k, v in off.items() if k != "outputs"}, {k: v for k, v in on.items() if k != "outputs"}
    report = {"contended": contended, "config": asdict(cfg), "page_bounds": bounds,
              "caching_off": strip[0], "caching_on": strip[1], "ratios": rat,
              "peak_on_vs_ideal": on["peak_used_pages"] / bounds["ideal_sharing_pages"],
              "outputs_match": not mismatches, "mismatches": mismatches, "notes": notes,
              "workload": [{"prompt_len": len(r.prompt), "suffix_len": len(r.prompt) - args.prefix_len,
                            "max_tokens": r.max_tokens} for r in reqs]}
    write_report(args.out, report)
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
