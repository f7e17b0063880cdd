"""tenants.py part 1, the noisy neighbour: A's flood and B's quiet schedule through one server (and B alone before
the first configuration), each configuration in turn, and its table and checks."""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

from common import CpuWatch, is_contended, wait_idle
from tenants_client import (
    ALONE,
    CONFIGS,
    FLOOD,
    KEYS,
    LEAK_KEYS,
    QUIET,
    WARMUP_PROMPT,
    Poller,
    Request,
    Stream,
    _info,
    _settle,
    _stream,
)
from tenants_report import Config, _num, print_table, server_delta, stream_summary, tenant_delta
from tenants_servers import Servers, run_on


async def _sleep_until(t: float) -> None:
    delay = t - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)


async def _trace(flood: Any, quiet: Any, flood_reqs: list[Request], quiet_reqs: list[Request],
                 args: argparse.Namespace, delay_s: float) -> dict[str, Any]:
    """The flood at once, then the quiet requests on their schedule; the flood cancelled when the quiet
    tenant is done (unless --full-flood)."""
    f_before = _info(await flood.model_info(reset_peak=True))
    q_before = _info(await quiet.model_info(reset_peak=True))
    poller = Poller(flood, args.poll_ms / 1000)
    watch = CpuWatch()
    t0 = time.perf_counter()
    f_streams = [Stream(r.index, r.max_tokens) for r in flood_reqs]
    f_tasks = [asyncio.create_task(_stream(flood, r, s)) for r, s in zip(flood_reqs, f_streams, strict=True)]
    q_streams = [Stream(r.index, r.max_tokens) for r in quiet_reqs]
    q_tasks = []
    for i, (r, s) in enumerate(zip(quiet_reqs, q_streams, strict=True)):
        await _sleep_until(t0 + delay_s + i * args.quiet_interval_ms / 1000)
        q_tasks.append(asyncio.create_task(_stream(quiet, r, s)))
    await asyncio.gather(*q_tasks)
    t_quiet_done = time.perf_counter()
    pending = [t for t in f_tasks if not t.done()]
    cancelled_at = None
    if pending and not args.full_flood:
        cancelled_at = time.perf_counter()
        for t in pending:
            t.cancel()
    await asyncio.gather(*f_tasks, return_exceptions=True)
    wall = time.perf_counter() - t0
    cpu = watch.stop()
    poll = await poller.finish()
    f_after = _info(await flood.model_info())
    q_after = _info(await quiet.model_info())
    settled, settle_s = await _settle(quiet)
    return {
        "wall_s": wall, "quiet_done_s": t_quiet_done - t0,
        "flood_cancelled_at_s": None if cancelled_at is None else cancelled_at - t0,
        "flood_cancelled": len(pending) if cancelled_at is not None else 0,
        "flood": {**stream_summary(f_streams, cancelled_at), **tenant_delta(f_before, f_after)} if f_streams else {},
        "quiet": {**stream_summary(q_streams), **tenant_delta(q_before, q_after)},
        "server": server_delta(q_before, q_after), "poll": poll, "cpu": cpu,
        "leaks": {k: settled[k] for k in LEAK_KEYS}, "leak_free": not any(settled[k] for k in LEAK_KEYS),
        "settle_s": settle_s,
    }


async def _noisy(address: str, flood_reqs: list[Request], quiet_reqs: list[Request],
                 alone_reqs: list[Request] | None, args: argparse.Namespace) -> dict[str, Any]:
    from pagedkv.client import Client

    # (resume=None: a refused or broken stream counts as the error it was)
    async with (Client(address, api_key=KEYS[FLOOD], resume=None) as flood,
                Client(address, api_key=KEYS[QUIET], resume=None) as quiet):
        await flood.wait_ready(timeout=120)
        for c in (flood, quiet):  # untimed warm-up; also proves both keys work
            warm = await c.complete(WARMUP_PROMPT, max_tokens=4, ignore_eos=True)
            if len(warm.token_ids) != 4:
                raise RuntimeError(f"warm-up returned {len(warm.token_ids)} tokens, expected 4")
        out: dict[str, Any] = {}
        if alone_reqs is not None:
            await asyncio.to_thread(wait_idle, args.wait_idle)
            out["alone"] = await _trace(flood, quiet, [], alone_reqs, args, 0.0)
        await asyncio.to_thread(wait_idle, args.wait_idle)
        out["loaded"] = await _trace(flood, quiet, flood_reqs, quiet_reqs, args, args.quiet_delay)
    return out


def noisy_part(args: argparse.Namespace, servers: Servers, flood_reqs: list[Request], quiet_reqs: list[Request],
               alone_reqs: list[Request]) -> dict[str, dict[str, Any]]:
    runs: dict[str, dict[str, Any]] = {}
    for i, c in enumerate(args.configs):
        first = i == 0
        print(f"running {c}{' (B alone first)' if first else ''} ...", flush=True)
        out = run_on(servers, c, lambda address, first=first: _noisy(
            address, flood_reqs, quiet_reqs, alone_reqs if first else None, args))
        if first:
            runs[ALONE] = {**out["alone"], "server_of": c}
            a = runs[ALONE]
            print(f"  {ALONE}: TTFT p50 {a['quiet']['ttft_p50_s']:.3f}s p99 {a['quiet']['ttft_p99_s']:.3f}s",
                  flush=True)
        run = out["loaded"]
        runs[c] = run
        q, f = run["quiet"], run["flood"]
        cancelled = (f" (A cancelled at {run['flood_cancelled_at_s']:.2f}s: {run['flood_cancelled']} unfinished)"
                     if run["flood_cancelled"] else "")
        print(f"  {c}: B TTFT p50 {q['ttft_p50_s']:.3f}s p99 {q['ttft_p99_s']:.3f}s, A {f['finished']}/"
              f"{f['requests']} finished, {f['tokens_per_s']:.1f} tokens/s, wall {run['wall_s']:.2f}s{cancelled}",
              flush=True)
        for name in ([ALONE] if first else []) + [c]:
            if is_contended(runs[name]):
                print(f"  WARNING: other processes used {runs[name]['cpu']['foreign_share']:.0%} of the machine's "
                      f"CPU during {name}; its timings are not trustworthy", flush=True)
    for pct in ("p50", "p99"):  # the timing side of tests/e2e/test_tenants_e2e.py's admission-order check
        base = runs[ALONE]["quiet"][f"ttft_{pct}_s"]
        for run in runs.values():
            run["quiet"][f"ttft_{pct}_vs_alone"] = run["quiet"][f"ttft_{pct}_s"] / base if base > 0 else float("nan")
    return runs


def report_noisy(runs: dict[str, dict[str, Any]], cfg: Config, notes: list[str], problems: list[str]) -> None:
    cols = (ALONE, *(c for c in CONFIGS if c in runs))
    print()
    print("noisy neighbour (A = flood, B = quiet)")
    print_table(("metric", *cols), [(label, *(noisy_cell(runs[c], label, who, key, spec) for c in cols))
                                    for label, who, key, spec in NOISY_ROWS])
    for name, run in runs.items():
        q, f = run["quiet"], run["flood"]
        if q["errors"] or q["short"] or q["finished"] != q["requests"]:
            problems.append(f"{name}: quiet requests failed or came back short: finished {q['finished']}/"
                            f"{q['requests']}, errors {q['errors'][:3]}, short {q['short'][:10]}")
        if f and (f["errors"] or f["short"]):
            problems.append(f"{name}: flood requests failed or came back short: errors {f['errors'][:3]}, "
                            f"short {f['short'][:10]}")
        if name in ("fair+quota", "fair+quota+budget") and f:
            if f["peak_used_pages"] > cfg.flood_quota_pages:
                problems.append(f"{name}: A held {f['peak_used_pages']} pages, above its quota "
                                f"{cfg.flood_quota_pages}")
            if run["poll"]["max_tenant_running"] > cfg.flood_concurrency:
                problems.append(f"{name}: A had {run['poll']['max_tenant_running']} requests running, above "
                                f"max_concurrent_requests {cfg.flood_concurrency}")
        if name == "fair+quota+budget" and f:
            if not f["budget_hits"]:
                notes.append(f"{name}: A's requests never reached their {cfg.flood_page_budget}-page budget")
            per_request = cfg.flood_page_budget * cfg.flood_concurrency
            if f["peak_used_pages"] > per_request:
                problems.append(f"{name}: A held {f['peak_used_pages']} pages, above {cfg.flood_concurrency} "
                                f"requests x {cfg.flood_page_budget}-page budget")
        if f and run["flood_cancelled"]:
            notes.append(f"{name}: A's flood cancelled at {run['flood_cancelled_at_s']:.2f}s when B was done "
                         f"({run['flood_cancelled']} of {f['requests']} requests unfinished); A's figures cover "
                         "the time until then")
    if runs[ALONE]["quiet"]["ttft_p99_s"] > 0:
        for pct in ("p50", "p99"):
            ratios = ", ".join(f"{c} {runs[c]['quiet'][f'ttft_{pct}_vs_alone']:.2f}x" for c in CONFIGS if c in runs)
            print(f"B {pct} TTFT vs B alone ({runs[ALONE]['quiet'][f'ttft_{pct}_s']:.3f}s): {ratios}")


# (label, who, key, format): who is "quiet", "flood", "server", "poll" or "" (the run itself)
NOISY_ROWS: list[tuple[str, str, str, str]] = [
    ("B TTFT p50 (s)", QUIET, "ttft_p50_s", "{:.3f}"),
    ("B TTFT p99 (s)", QUIET, "ttft_p99_s", "{:.3f}"),
    ("B TTFT p50 / B alone", QUIET, "ttft_p50_vs_alone", "{:.2f}x"),
    ("B TTFT p99 / B alone", QUIET, "ttft_p99_vs_alone", "{:.2f}x"),
    ("B latency p50 (s)", QUIET, "latency_p50_s", "{:.3f}"),
    ("B latency p99 (s)", QUIET, "latency_p99_s", "{:.3f}"),
    ("B output tokens/s", QUIET, "tokens_per_s", "{:.1f}"),
    ("B peak pages", QUIET, "peak_used_pages", "int"),
    ("B budget hits", QUIET, "budget_hits", "int"),
    ("B fair-share preemptions", QUIET, "fair_share_preemptions", "int"),
    ("A finished / started / sent", FLOOD, "counts", "{}"),
    ("A TTFT p50 (s)", FLOOD, "ttft_p50_s", "{:.3f}"),
    ("A TTFT p99 (s)", FLOOD, "ttft_p99_s", "{:.3f}"),
    ("A latency p50 (s)", FLOOD, "latency_p50_s", "{:.3f}"),
    ("A latency p99 (s)", FLOOD, "latency_p99_s", "{:.3f}"),
    ("A output tokens/s", FLOOD, "tokens_per_s", "{:.1f}"),
    ("A peak pages", FLOOD, "peak_used_pages", "int"),
    ("A most running at once", "poll", "max_tenant_running", "int"),
    ("A budget hits", FLOOD, "budget_hits", "int"),
    ("A fair-share preemptions", FLOOD, "fair_share_preemptions", "int"),
    ("preemptions (all)", "server", "preemptions", "int"),
    ("peak pages (all)", "server", "peak_used_pages", "int"),
    ("most running at once (all)", "poll", "max_running", "int"),
    ("wall (s)", "", "wall_s", "{:.2f}"),
]


def noisy_cell(run: dict[str, Any], label: str, who: str, key: str, spec: str) -> str:
    if label.startswith("A ") and not run["flood"]:  # B alone: no flood
        return "-"
    src = run if not who else run[who]
    if key == "counts":
        f = run["flood"]
        return f"{f['finished']} / {f['started']} / {f['requests']}"
    return _num(src.get(key), spec)
