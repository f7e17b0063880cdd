"""One preemption policy's run for swap.py: a fresh ``pagedkv serve`` with that ``--preemption-mode``, the overload
trace through it, and the ModelInfo deltas, leaks and executor start-up costs that the table reports."""

from __future__ import annotations

import argparse
import asyncio
import re
import sys
import time
from typing import Any

from common import (
    Request,
    Server,
    StreamResult,
    check_lengths,
    latency_summary,
    timed_streams,
    wait_idle,
    warm_up,
)

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
