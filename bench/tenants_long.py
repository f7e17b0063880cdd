"""tenants.py part 2, long context with and without a sliding window: the long requests together on a small pool,
each run on its own server, and their table and checks."""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

from common import CpuWatch, is_contended, wait_idle
from tenants_client import LEAK_KEYS, LONG_RUNS, WARMUP_PROMPT, Poller, Request, Stream, _info, _settle, _stream
from tenants_report import Config, _num, print_table, server_delta, stream_summary
from tenants_servers import Servers, run_on


async def _long(address: str, reqs: list[Request], args: argparse.Namespace) -> dict[str, Any]:
    from pagedkv.client import Client

    async with Client(address) as client:
        await client.wait_ready(timeout=120)
        warm = await client.complete(WARMUP_PROMPT, max_tokens=4, ignore_eos=True)
        if len(warm.token_ids) != 4:
            raise RuntimeError(f"warm-up returned {len(warm.token_ids)} tokens, expected 4")
        await asyncio.to_thread(wait_idle, args.wait_idle)
        before = _info(await client.model_info(reset_peak=True))
        poller = Poller(client, args.poll_ms / 1000)
        watch = CpuWatch()
        t0 = time.perf_counter()
        streams = [Stream(r.index, r.max_tokens) for r in reqs]
        await asyncio.gather(*(_stream(client, r, s) for r, s in zip(reqs, streams, strict=True)))
        wall = time.perf_counter() - t0
        cpu = watch.stop()
        poll = await poller.finish()
        after = _info(await client.model_info())
        settled, settle_s = await _settle(client)
    return {"wall_s": wall, "requests": stream_summary(streams), "server": server_delta(before, after),
            "poll": poll, "cpu": cpu, "leaks": {k: settled[k] for k in LEAK_KEYS},
            "leak_free": not any(settled[k] for k in LEAK_KEYS), "settle_s": settle_s}


def long_part(args: argparse.Namespace, servers: Servers, reqs: list[Request]) -> dict[str, dict[str, Any]]:
    runs: dict[str, dict[str, Any]] = {}
    prompt_tokens = sum(len(r.prompt) for r in reqs)
    decode_steps = sum(r.max_tokens - 1 for r in reqs)  # the first output token comes from the prefill
    for r in LONG_RUNS:
        label = r if r == "no window" else f"window {args.window} + sink {args.sink}"
        print(f"running long context, {label} ...", flush=True)
        run = run_on(servers, r, lambda address: _long(address, reqs, args))
        s, p = run["server"], run["poll"]
        run["label"] = label
        run["recomputed_tokens"] = s["computed_tokens"] - (prompt_tokens + decode_steps)
        run["pages_per_running"] = s["peak_used_pages"] / p["max_running"] if p["max_running"] else float("nan")
        runs[r] = run
        print(f"  {label}: {run['wall_s']:.2f}s, {run['requests']['tokens_per_s']:.1f} tokens/s, at most "
              f"{p['max_running']} running, peak {s['peak_used_pages']} pages, {s['preemptions']} preemptions",
              flush=True)
        if is_contended(run):
            print(f"  WARNING: other processes used {run['cpu']['foreign_share']:.0%} of the machine's CPU during "
                  f"the {label} run; its timings are not trustworthy", flush=True)
    return runs


def report_long(runs: dict[str, dict[str, Any]], cfg: Config, notes: list[str], problems: list[str]) -> None:
    cols = tuple(runs[r]["label"] for r in LONG_RUNS)
    print()
    print(f"long context: {cfg.long_requests} x ({cfg.long_prompt} + {cfg.long_tokens}) tokens, "
          f"{cfg.long_num_pages} pages")

    def cell(run: dict[str, Any], who: str, key: str, spec: str) -> str:
        return _num((run[who] if who else run).get(key), spec)

    print_table(("metric", *cols), [(label, *(cell(runs[r], who, key, spec) for r in LONG_RUNS))
                                    for label, who, key, spec in LONG_ROWS])
    for name, run in runs.items():
        q = run["requests"]
        if q["errors"] or q["short"] or q["finished"] != q["requests"]:
            problems.append(f"long {name}: requests failed or came back short: finished {q['finished']}/"
                            f"{q['requests']}, errors {q['errors'][:3]}, short {q['short'][:10]}")
    nw, w = runs["no window"], runs["window"]
    if w["poll"]["max_running"] <= nw["poll"]["max_running"]:
        notes.append(f"long context: the window did not raise concurrency (at most {w['poll']['max_running']} "
                     f"running vs {nw['poll']['max_running']} without)")
    if not nw["server"]["preemptions"]:
        notes.append("long context: no preemptions without the window; the requests fit the pool (lower "
                     "--long-num-pages or raise --long-requests)")
    steady = w["poll"]["median_pages_per_running"]
    if steady > cfg.window_pages_bound:
        problems.append(f"long context: with the window a running request held {steady:.1f} pages (median of the "
                        f"polls), above the ~{cfg.window_pages_bound} a (window + sink)-token window needs")
    if w["pages_per_running"] > cfg.window_pages_bound:
        notes.append(f"long context: with the window the peak was {w['server']['peak_used_pages']} pages for "
                     f"{w['poll']['max_running']} running requests ({w['pages_per_running']:.1f} a request; "
                     f"{steady:.1f} in the median poll), above the ~{cfg.window_pages_bound} pages a windowed "
                     "request holds once decoding: a prefill chunk (up to --max-num-batched-tokens tokens) gets "
                     "its pages before those behind the window are dropped")


LONG_ROWS: list[tuple[str, str, str, str]] = [
    ("wall (s)", "", "wall_s", "{:.2f}"),
    ("output tokens/s", "requests", "tokens_per_s", "{:.1f}"),
    ("most running at once", "poll", "max_running", "int"),
    ("mean running (polled)", "poll", "mean_running", "{:.2f}"),
    ("peak pages", "server", "peak_used_pages", "int"),
    ("peak pages / most running", "", "pages_per_running", "{:.1f}"),
    ("pages / running (median poll)", "poll", "median_pages_per_running", "{:.1f}"),
    ("preemptions: swap", "server", "swap_preemptions", "int"),
    ("preemptions: recompute", "server", "recompute_preemptions", "int"),
    ("tokens computed", "server", "computed_tokens", "int"),
    ("recomputed tokens", "", "recomputed_tokens", "int"),
    ("TTFT p50 (s)", "requests", "ttft_p50_s", "{:.2f}"),
    ("TTFT p99 (s)", "requests", "ttft_p99_s", "{:.2f}"),
    ("latency p50 (s)", "requests", "latency_p50_s", "{:.2f}"),
    ("latency p99 (s)", "requests", "latency_p99_s", "{:.2f}"),
    ("max_model_len", "server", "max_model_len", "int"),
]
