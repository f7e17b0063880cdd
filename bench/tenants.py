"""Tenants: a noisy neighbour under four scheduling set-ups, and long context with and without a sliding window.

Part 1, noisy neighbour. Two tenants share a server; a tenants file (written to a temporary directory, one per
configuration) gives them the API keys ``key-flood`` and ``key-quiet`` (stored hashed). Tenant A ("flood")
sends ``--flood-requests`` requests (32) at once, each a ``--flood-prompt``-token prompt (32) asking for
``--flood-tokens`` output tokens (256): decode-heavy. ``--quiet-delay`` seconds later (0.5: the flood is
admitted and queued) tenant B ("quiet") starts sending ``--quiet-requests`` requests (40) on a fixed schedule,
one every ``--quiet-interval-ms`` (50 ms), each an asyncio task started at its slot whether or not the earlier
ones finished: prompts of 200-300 tokens, 8 output tokens each. Every prompt is BOS then random ids in
[3, vocab) from a seeded ``random.Random``, distinct per request, so the prefix cache finds nothing; EOS is
ignored, decoding is greedy. Four configurations, each on a fresh ``pagedkv serve`` (``--max-num-seqs 16``,
``--num-pages 256``, ``--max-num-batched-tokens 512``) with the same trace:

* ``fcfs``: ``--no-fairness``, no limits: admission in arrival order;
* ``fair``: fairness on (VTC: the waiting tenant with the least weighted service is admitted first, and a
  tenant above its fair share of pages gives pages back), no limits;
* ``fair+quota``: fairness, and A held to ``page_quota = 0.5`` (of the pool) and ``max_concurrent_requests`` =
  half of ``--max-num-seqs``;
* ``fair+quota+budget``: as ``fair+quota``, plus A's ``page_budget = 8`` pages with ``overflow = "window"``:
  past 8 pages a request keeps its first page (the attention sink) and its most recent tokens, (8 - 2) x 16 =
  96 of them, so A's 288-token requests run windowed and never hold more than 8 pages each.

``--executors N`` runs each noisy-neighbour server as a scheduler driving N executor processes (``--num-pages``
each, one torch thread each): A's quota (a fraction is of all N pools) and its concurrency limit are the
scheduler's, summed over the executors, so they must hold in total; A's peak pages are then the sum of its
per-executor peaks (an upper bound on what it held at once). ``--configs`` runs a subset, e.g. the 3-executor
check of the tenant ledger::

    python bench/tenants.py --only noisy --executors 3 --configs fair+quota --flood-concurrency 4

Before the first configuration's flood, B's trace runs alone on that server: the "B alone" baseline (the same
prompt lengths and schedule, other random ids, so the loaded run cannot reuse its prefix pages).

A's flood is cancelled as soon as B's last request has finished (``--full-flood`` lets it run to the end), to
keep the run short: A's tokens/s is then the tokens it received until the cancellation over the time from its
first send to the cancellation; its latency percentiles cover only the requests that finished and its TTFT
percentiles only those that got a first token (the table says how many finished and started).

Per configuration and tenant the bench reports TTFT p50/p99 (from each request's own send to its first token),
end-to-end latency p50/p99, output tokens/s over the tenant's own span (its first send to its last token, or to
the cancellation), peak KV pages held (``TenantInfo.peak_used_pages``, reset with ``reset_peak`` just before
the trace), budget hits and fair-share preemptions (deltas over the trace), and B's p99 TTFT over B alone; and
per server its preemptions, peak pages, the most requests A had running at once (``ModelInfo`` polled every
``--poll-ms``, 50 ms), and whether every page was free again afterwards.

Part 2, long context with and without a sliding window. ``--long-requests`` requests (8) arrive together on a
single-tenant server with ``--long-num-pages`` pages (96 of 16 tokens: 1,536 tokens of KV), each a
``--long-prompt``-token prompt (600) asking for ``--long-tokens`` output tokens (900). Without a window one
request at full length needs 94 of the 96 pages, so they run about one at a time and preempt each other; with
``--sliding-window 256 --sink-tokens 16`` a request attends to its first 16 tokens plus its last 256 and holds
about (256 + 16) / 16 + 2 = 19 pages, so several run at once. The server caps ``max_model_len`` to the pool
(1,536 tokens) in both runs -- the cap does not look at the window -- so prompt + output must stay within it,
and both runs serve the same requests. Per run: wall time, output tokens/s, the most requests running at once
(``ModelInfo.num_running`` polled every ``--poll-ms``), peak pages, preemptions by kind, tokens computed
(recomputation after preemptions shows here), TTFT and latency p50/p99. The window changes what the model
attends to, so outputs are not compared between the two runs.

Servers start together up front (start-up is ~12 s each on 2 CPUs, mostly imports; an idle server uses well
under 1% of a CPU) and each is measured alone while the others wait; ``--start one-by-one`` starts each just
before its run instead. Before each measured trace the bench waits (up to ``--wait-idle`` s) for the CPUs to go
idle, and warns when other processes used them during a trace (see ``cpu`` in the JSON). Exit code 1 when a
quiet or long request failed or came back short, or pages were still held after a run.

    python bench/tenants.py            # both parts -> bench/results/tenants.json
    python bench/tenants.py --quick    # smoke run (~2 minutes): fewer requests, shorter outputs
    python bench/tenants.py --only long
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import grpc
import torch
from common import CpuWatch, Server, is_contended, pages_for, percentile, wait_idle

from pagedkv.models import resolve_model
from pagedkv.tenancy import hash_key

ROOT = Path(__file__).resolve().parent.parent
BOS_ID = 1
FIRST_BYTE_ID = 3  # ids below this are special (pad 0, BOS 1, EOS 2)
WARMUP_PROMPT = [BOS_ID, 72, 105]
FLOOD, QUIET = "flood", "quiet"
KEYS = {FLOOD: "key-flood", QUIET: "key-quiet"}
CONFIGS = ("fcfs", "fair", "fair+quota", "fair+quota+budget")
ALONE = "B alone"
LONG_RUNS = ("no window", "window")
SETTLE_S = 10.0


# ---- workload ----------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Request:
    index: int
    prompt: list[int]
    max_tokens: int


def make_prompt(rng: random.Random, length: int, vocab_size: int) -> list[int]:
    return [BOS_ID] + [rng.randrange(FIRST_BYTE_ID, vocab_size) for _ in range(length - 1)]


def make_requests(lengths: list[int], max_tokens: int, seed: int, vocab_size: int) -> list[Request]:
    rng = random.Random(seed)
    return [Request(i, make_prompt(rng, n, vocab_size), max_tokens) for i, n in enumerate(lengths)]


# ---- streams and polling -----------------------------------------------------------------------
@dataclass(slots=True)
class Stream:
    """One request as the client saw it (perf_counter times; nan: never happened)."""

    index: int
    max_tokens: int
    sent: float = math.nan
    first: float = math.nan
    last: float = math.nan
    done: float = math.nan  # the finish message
    tokens: int = 0
    finish_reason: int = 0
    stop_reason: str = ""
    error: str = ""

    @property
    def finished(self) -> bool:
        return bool(self.finish_reason) and not self.error


async def _stream(client: Any, req: Request, out: Stream) -> None:
    """Runs one request into ``out``; a cancellation leaves what arrived so far there."""
    out.sent = time.perf_counter()
    try:
        async for msg in client.generate(req.prompt, max_tokens=req.max_tokens, ignore_eos=True, temperature=0):
            now = time.perf_counter()
            if msg.token_ids:
                if not out.tokens:
                    out.first = now
                out.tokens += len(msg.token_ids)
                out.last = now
            if msg.finish_reason:
                out.finish_reason = msg.finish_reason
                out.stop_reason = msg.stop_reason
                out.done = now
    except grpc.aio.AioRpcError as err:
        out.error = f"{err.code().name}: {err.details()}"


class Poller:
    """``ModelInfo`` every ``every_s`` while a trace runs: the calling tenant's and the server's counts."""

    def __init__(self, client: Any, every_s: float) -> None:
        self.client, self.every_s = client, every_s
        self.samples: list[dict[str, float]] = []
        self.stop = asyncio.Event()
        self.t0 = time.perf_counter()
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while not self.stop.is_set():
            info = await self.client.model_info()
            self.samples.append({"t": round(time.perf_counter() - self.t0, 4), "running": info.num_running,
                                 "waiting": info.num_waiting, "used_pages": info.num_used_pages,
                                 "tenant_running": info.tenant.num_running,
                                 "tenant_waiting": info.tenant.num_waiting,
                                 "tenant_used_pages": info.tenant.used_pages})
            await asyncio.sleep(self.every_s)

    async def finish(self) -> dict[str, Any]:
        self.stop.set()
        await self.task
        s = self.samples

        def peak(key: str) -> int:
            return max((x[key] for x in s), default=0)

        return {"samples": len(s), "max_running": peak("running"), "max_waiting": peak("waiting"),
                "max_used_pages": peak("used_pages"), "max_tenant_running": peak("tenant_running"),
                "max_tenant_used_pages": peak("tenant_used_pages"),
                "mean_running": statistics.fmean(x["running"] for x in s) if s else 0.0,
                "median_pages_per_running": statistics.median(per) if (per := [
                    x["used_pages"] / x["running"] for x in s if x["running"]]) else float("nan"),
                "timeline": s}


INFO_KEYS = ("num_pages", "num_used_pages", "peak_used_pages", "num_running", "num_waiting", "num_computed_tokens",
             "num_preemptions", "num_swap_preemptions", "num_recompute_preemptions", "num_swapped",
             "num_used_host_pages", "num_host_pages", "max_model_len", "block_size", "prefix_caching")
TENANT_KEYS = ("id", "weight", "page_quota", "reserved_pages", "max_concurrent_requests", "page_budget", "overflow",
               "used_pages", "peak_used_pages", "num_running", "num_waiting", "service", "budget_hits",
               "fair_share_preemptions", "sliding_window", "sink_tokens")
LEAK_KEYS = ("num_used_pages", "num_used_host_pages", "num_swapped")


def _info(info: Any) -> dict[str, Any]:
    out = {k: getattr(info, k) for k in INFO_KEYS}
    out["tenant"] = {k: getattr(info.tenant, k) for k in TENANT_KEYS}
    return out


async def _settle(client: Any) -> tuple[dict[str, Any], float]:
    """ModelInfo once nothing is held any more (or SETTLE_S later): cancelled requests are reaped, and the
    last finish message may reach the client a moment before the scheduler frees its pages."""
    t0 = time.perf_counter()
    info = _info(await client.model_info())
    while any(info[k] for k in LEAK_KEYS) and time.perf_counter() - t0 < SETTLE_S:
        await asyncio.sleep(0.1)
        info = _info(await client.model_info())
    return info, time.perf_counter() - t0


# ---- summaries ---------------------------------------------------------------------------------
def stream_summary(streams: list[Stream], end: float | None = None) -> dict[str, Any]:
    """One tenant's requests in one trace. ``end``: the flood's cancellation (tokens/s over send -> end)."""
    if not streams:
        return {}
    started = [s for s in streams if s.tokens]
    finished = [s for s in streams if s.finished]
    ttfts = [s.first - s.sent for s in started]
    lat = [s.done - s.sent for s in finished]
    tokens = sum(s.tokens for s in streams)
    t_start = min(s.sent for s in streams)
    t_end = end if end is not None else max((s.last for s in started), default=t_start)
    span = t_end - t_start
    return {
        "requests": len(streams), "started": len(started), "finished": len(finished),
        "errors": [f"request {s.index}: {s.error}" for s in streams if s.error],
        "short": [s.index for s in finished if s.tokens != s.max_tokens],
        "output_tokens": tokens, "span_s": span, "tokens_per_s": tokens / span if span > 0 else float("nan"),
        "ttft_p50_s": percentile(ttfts, 50), "ttft_p99_s": percentile(ttfts, 99),
        "ttft_mean_s": statistics.fmean(ttfts) if ttfts else float("nan"),
        "latency_p50_s": percentile(lat, 50), "latency_p99_s": percentile(lat, 99),
        "latency_mean_s": statistics.fmean(lat) if lat else float("nan"),
        "ttfts_s": [round(x, 4) for x in ttfts],
    }


def tenant_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """The tenant's counters over a trace: peak pages since the reset, budget hits and fair-share
    preemptions as deltas."""
    b, a = before["tenant"], after["tenant"]
    return {"id": a["id"], "page_quota": a["page_quota"], "max_concurrent_requests": a["max_concurrent_requests"],
            "page_budget": a["page_budget"], "overflow": a["overflow"], "peak_used_pages": a["peak_used_pages"],
            "budget_hits": a["budget_hits"] - b["budget_hits"],
            "fair_share_preemptions": a["fair_share_preemptions"] - b["fair_share_preemptions"],
            "service": a["service"]}


def server_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    return {"preemptions": after["num_preemptions"] - before["num_preemptions"],
            "swap_preemptions": after["num_swap_preemptions"] - before["num_swap_preemptions"],
            "recompute_preemptions": after["num_recompute_preemptions"] - before["num_recompute_preemptions"],
            "computed_tokens": after["num_computed_tokens"] - before["num_computed_tokens"],
            "peak_used_pages": after["peak_used_pages"], "num_pages": after["num_pages"],
            "max_model_len": after["max_model_len"]}


# ---- part 1: noisy neighbour -------------------------------------------------------------------
def tenants_toml(config: str, args: argparse.Namespace) -> str:
    limits = []
    if config in ("fair+quota", "fair+quota+budget"):
        quota = repr(float(args.flood_quota)) if args.flood_quota <= 1 else str(int(args.flood_quota))  # pages
        limits += [f"page_quota = {quota}", f"max_concurrent_requests = {args.flood_concurrency}"]
    if config == "fair+quota+budget":
        limits += [f"page_budget = {args.flood_page_budget}", 'overflow = "window"']
    # admin: the bench reads the server's own counts (running, pages, preemptions), which a tenant does not see
    return "\n".join([f"[tenants.{FLOOD}]", f'keys = ["{hash_key(KEYS[FLOOD])}"]', "admin = true", *limits, "",
                      f"[tenants.{QUIET}]", f'keys = ["{hash_key(KEYS[QUIET])}"]', "admin = true", ""])


def common_args(args: argparse.Namespace, model: str, num_pages: int) -> list[str]:
    out = ["--model", model, "--dtype", "float32", "--block-size", str(args.block_size), "--num-pages",
           str(num_pages), "--max-num-seqs", str(args.max_num_seqs),
           "--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    if args.check_integrity:
        out.append("--check-integrity")
    return out


@dataclass(frozen=True, slots=True)
class ClusterSpec:
    """A scheduler driving ``executors`` executor processes, instead of one ``pagedkv serve``."""

    executors: int
    executor_args: tuple[str, ...]
    scheduler_args: tuple[str, ...]


def noisy_server_args(args: argparse.Namespace, model: str, config: str,
                      tenants_file: Path) -> list[str] | ClusterSpec:
    fairness = ["--no-fairness"] if config == "fcfs" else []
    if args.executors > 1:
        integrity = ["--check-integrity"] if args.check_integrity else []
        return ClusterSpec(args.executors, (
            "--model", model, "--dtype", "float32", "--block-size", str(args.block_size), "--num-pages",
            str(args.num_pages), "--threads", "1"), (
            "--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
            "--tenants-file", str(tenants_file), *fairness, *integrity))
    return [*common_args(args, model, args.num_pages), "--tenants-file", str(tenants_file), *fairness]


class ClusterServer:
    """``spec.executors`` executors (``pagedkv executor``, one torch thread each) and a scheduler driving them
    all, on free loopback ports; the same interface as ``Server``."""

    def __init__(self, spec: ClusterSpec, timeout: float = 600.0) -> None:
        from pagedkv.local_server import ServiceProcess

        self.procs = []
        try:
            self.procs += [ServiceProcess("executor", *spec.executor_args, timeout=timeout, wait=False)
                           for _ in range(spec.executors)]
            for p in self.procs:
                p.wait_ready(timeout)
            targets = [a for p in self.procs for a in ("--executor", p.address)]
            self.scheduler = ServiceProcess("scheduler", *targets, *spec.scheduler_args, timeout=timeout)
            self.procs.append(self.scheduler)
        except BaseException:
            self.stop()
            raise

    @property
    def address(self) -> str:
        return self.scheduler.address

    def log(self) -> str:
        return "\n".join(p.log() for p in self.procs)

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.stop()


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


# ---- part 2: long context ----------------------------------------------------------------------
def long_server_args(args: argparse.Namespace, model: str, run: str) -> list[str]:
    out = common_args(args, model, args.long_num_pages)
    if run == "window":
        out += ["--sliding-window", str(args.window), "--sink-tokens", str(args.sink)]
    return out


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


# ---- servers -----------------------------------------------------------------------------------
class Servers:
    """The bench's servers by name: started together up front, or each when first asked for."""

    def __init__(self, specs: dict[str, list[str] | ClusterSpec], together: bool) -> None:
        self.specs = specs
        self.started: dict[str, Server] = {}
        self.startup_s: dict[str, float] = {}
        if together and specs:
            t0 = time.perf_counter()
            with ThreadPoolExecutor(max_workers=len(specs)) as pool:
                futures = {name: pool.submit(self._start, name) for name in specs}
                errors = []
                for name, fut in futures.items():
                    try:
                        fut.result()
                    except Exception as err:  # noqa: BLE001  (stop the others, then report)
                        errors.append(f"{name}: {err}")
            if errors:
                self.stop_all()
                raise RuntimeError("server start-up failed:\n" + "\n".join(errors))
            print(f"started {len(specs)} servers together in {time.perf_counter() - t0:.1f}s", flush=True)

    def _start(self, name: str) -> Server:
        t0 = time.perf_counter()
        spec = self.specs[name]
        server = ClusterServer(spec) if isinstance(spec, ClusterSpec) else Server(spec)
        self.startup_s[name] = time.perf_counter() - t0
        self.started[name] = server
        return server

    def get(self, name: str) -> Server:
        return self.started[name] if name in self.started else self._start(name)

    def stop(self, name: str) -> None:
        server = self.started.pop(name, None)
        if server is not None:
            server.stop()

    def stop_all(self) -> None:
        for name in list(self.started):
            self.stop(name)


def run_on(servers: Servers, name: str, coro_fn) -> dict[str, Any]:
    """Runs one measured workload against the named server, then stops that server."""
    server = servers.get(name)
    try:
        return asyncio.run(coro_fn(server.address))
    except BaseException:
        print(server.log(), file=sys.stderr)
        raise
    finally:
        servers.stop(name)


# ---- report ------------------------------------------------------------------------------------
@dataclass(slots=True)
class Config:
    model: str
    model_dir: str
    seed: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    num_pages: int
    flood_requests: int
    flood_prompt: int
    flood_tokens: int
    quiet_requests: int
    quiet_prompt_range: tuple[int, int]
    quiet_tokens: int
    quiet_interval_ms: float
    quiet_delay_s: float
    flood_quota: float
    flood_quota_pages: int
    flood_concurrency: int
    flood_page_budget: int
    flood_window_tokens: int
    full_flood: bool
    long_num_pages: int
    long_requests: int
    long_prompt: int
    long_tokens: int
    window: int
    sink: int
    window_pages_bound: int
    poll_ms: float
    only: str
    start: str
    quick: bool = False
    executors: int = 1
    configs: tuple[str, ...] = CONFIGS
    dtype: str = "float32"
    order: str = "noisy: B alone (on fcfs's server), fcfs, fair, fair+quota, fair+quota+budget; long: no window, window"
    nproc: int = field(default_factory=lambda: os.cpu_count() or 0)
    torch_threads: int = field(default_factory=torch.get_num_threads)
    torch_version: str = torch.__version__
    python: str = platform.python_version()
    platform: str = platform.platform()


def _num(value: Any, spec: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if spec == "int":
        return f"{value:,.0f}"
    return spec.format(value)


def _json_safe(value: Any) -> Any:
    """NaN (a percentile of nothing, a rate over no time) as null: the JSON stays standard."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    return value


def print_table(header: tuple[str, ...], body: list[tuple[str, ...]]) -> None:
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(header)]
    print(" | ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)))
    print("-+-".join("-" * w for w in widths))
    for b in body:
        print(" | ".join(c.ljust(w) for c, w in zip(b, widths, strict=True)))


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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny-llama", help="built-in name or a local HF directory")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "tenants.json")
    p.add_argument("--only", choices=["both", "noisy", "long"], default="both", help="which part to run")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--check-integrity", action="store_true", help="servers check page accounting every step")
    g = p.add_argument_group("part 1: noisy neighbour")
    g.add_argument("--num-pages", type=int, default=256,
                   help="device KV pages of the noisy-neighbour servers (of each executor with --executors)")
    g.add_argument("--executors", type=int, default=1,
                   help="executors per noisy-neighbour server: N > 1 runs a scheduler driving N `pagedkv executor` "
                   "processes (one torch thread each); A's quota and concurrency limit are the scheduler's, summed "
                   "over them, and a quota fraction is of all N pools")
    g.add_argument("--configs", default=",".join(CONFIGS),
                   help=f"comma-separated subset of {', '.join(CONFIGS)} (B alone runs on the first one's server)")
    g.add_argument("--flood-requests", type=int, default=32)
    g.add_argument("--flood-prompt", type=int, default=32, help="prompt tokens of each flood request")
    g.add_argument("--flood-tokens", type=int, default=256, help="output tokens of each flood request")
    g.add_argument("--quiet-requests", type=int, default=40)
    g.add_argument("--quiet-prompt", type=int, nargs=2, default=(200, 300), metavar=("MIN", "MAX"),
                   help="prompt length range of the quiet requests")
    g.add_argument("--quiet-tokens", type=int, default=8, help="output tokens of each quiet request")
    g.add_argument("--quiet-interval-ms", type=float, default=50.0, help="one quiet request every this often")
    g.add_argument("--quiet-delay", type=float, default=0.5, help="seconds from the flood to the first quiet request")
    g.add_argument("--flood-quota", type=float, default=0.5,
                   help="flood's page_quota: a fraction of the pool (<= 1) or a number of pages")
    g.add_argument("--flood-concurrency", type=int, default=0,
                   help="flood's max_concurrent_requests in the quota configurations (0: half of --max-num-seqs)")
    g.add_argument("--flood-page-budget", type=int, default=8, help="flood's page_budget (pages per request) "
                   "in fair+quota+budget, overflow 'window'")
    g.add_argument("--full-flood", action="store_true",
                   help="let the flood finish instead of cancelling it when the quiet tenant is done")
    g = p.add_argument_group("part 2: long context")
    g.add_argument("--long-num-pages", type=int, default=96, help="device KV pages of the long-context servers")
    g.add_argument("--long-requests", type=int, default=8)
    g.add_argument("--long-prompt", type=int, default=600)
    g.add_argument("--long-tokens", type=int, default=900)
    g.add_argument("--window", type=int, default=256, help="--sliding-window of the windowed run")
    g.add_argument("--sink", type=int, default=16, help="--sink-tokens of the windowed run")
    p.add_argument("--poll-ms", type=float, default=50.0, help="ModelInfo polling period during a trace")
    p.add_argument("--start", choices=["together", "one-by-one"], default="together",
                   help="start all servers up front (idle while the others are measured) or each before its run")
    p.add_argument("--wait-idle", type=float, default=600.0,
                   help="before each measured trace, wait up to this many seconds for other processes to leave "
                        "the CPUs")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: flood 24 x 128 tokens, 20 quiet requests; long: 4 requests of 600 + 400 tokens")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    if not args.configs or set(args.configs) - set(CONFIGS) or args.executors < 1:
        print(f"error: --configs must name some of {', '.join(CONFIGS)}; --executors must be >= 1", file=sys.stderr)
        return 2
    if args.quick:
        args.flood_requests, args.flood_tokens = min(args.flood_requests, 24), min(args.flood_tokens, 128)
        args.quiet_requests = min(args.quiet_requests, 20)
        args.long_requests, args.long_tokens = min(args.long_requests, 4), min(args.long_tokens, 400)
    if args.flood_concurrency <= 0:
        args.flood_concurrency = max(1, args.max_num_seqs // 2)
    run_noisy, run_long = args.only in ("both", "noisy"), args.only in ("both", "long")
    model_dir = resolve_model(args.model)
    config = json.loads((model_dir / "config.json").read_text())
    vocab, model_max = config["vocab_size"], config["max_position_embeddings"]
    bs = args.block_size
    qmin, qmax = args.quiet_prompt
    errors: list[str] = []
    if min(args.flood_requests, args.quiet_requests, args.long_requests, args.flood_prompt, qmin, args.long_prompt,
           args.flood_tokens, args.quiet_tokens, args.long_tokens) < 1 or qmin > qmax:
        errors.append("request counts, prompt lengths and output lengths must be >= 1 (and --quiet-prompt MIN <= MAX)")
    noisy_len = min(model_max, args.num_pages * bs)
    if run_noisy and max(args.flood_prompt + args.flood_tokens, qmax + args.quiet_tokens) > noisy_len:
        errors.append(f"a noisy-neighbour request exceeds max_model_len {noisy_len}")
    if run_noisy and args.flood_page_budget < 3:
        errors.append("--flood-page-budget: the window policy needs at least 3 pages (sink, window, the next)")
    long_len = min(model_max, args.long_num_pages * bs)
    if run_long and args.long_prompt + args.long_tokens > long_len:
        errors.append(f"long requests: prompt {args.long_prompt} + output {args.long_tokens} exceeds max_model_len "
                      f"{long_len} (min of the model's {model_max} and {args.long_num_pages} pages x {bs} tokens; "
                      "the server caps it to the pool with or without a window)")
    if errors:
        for e in errors:
            print(f"error: {e}", file=sys.stderr)
        return 2

    flood_reqs = make_requests([args.flood_prompt] * args.flood_requests, args.flood_tokens, args.seed, vocab)
    lrng = random.Random(args.seed + 1)
    quiet_lens = [lrng.randint(qmin, qmax) for _ in range(args.quiet_requests)]
    quiet_reqs = make_requests(quiet_lens, args.quiet_tokens, args.seed + 2, vocab)
    alone_reqs = make_requests(quiet_lens, args.quiet_tokens, args.seed + 3, vocab)  # same lengths, other ids
    long_reqs = make_requests([args.long_prompt] * args.long_requests, args.long_tokens, args.seed + 4, vocab)
    quota_pages = (int(args.flood_quota * args.num_pages * args.executors) if args.flood_quota <= 1
                   else int(args.flood_quota))
    window_bound = pages_for(args.sink, bs) + pages_for(args.window, bs) + 2  # scheduler_svc.fit.window_pages
    cfg = Config(model=args.model, model_dir=str(model_dir), seed=args.seed, block_size=bs,
                 max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                 num_pages=args.num_pages, flood_requests=args.flood_requests, flood_prompt=args.flood_prompt,
                 flood_tokens=args.flood_tokens, quiet_requests=args.quiet_requests, quiet_prompt_range=(qmin, qmax),
                 quiet_tokens=args.quiet_tokens, quiet_interval_ms=args.quiet_interval_ms,
                 quiet_delay_s=args.quiet_delay, flood_quota=args.flood_quota, flood_quota_pages=quota_pages,
                 flood_concurrency=args.flood_concurrency, flood_page_budget=args.flood_page_budget,
                 flood_window_tokens=(args.flood_page_budget - 2) * bs, full_flood=args.full_flood,
                 long_num_pages=args.long_num_pages, long_requests=args.long_requests, long_prompt=args.long_prompt,
                 long_tokens=args.long_tokens, window=args.window, sink=args.sink, window_pages_bound=window_bound,
                 poll_ms=args.poll_ms, only=args.only, start=args.start, quick=args.quick,
                 executors=args.executors, configs=tuple(args.configs))
    if run_noisy:
        print(f"noisy neighbour: A floods {args.flood_requests} x ({args.flood_prompt} + {args.flood_tokens}) tokens "
              f"({pages_for(args.flood_prompt + args.flood_tokens - 1, bs)} pages each at full length); B sends "
              f"{args.quiet_requests} x ({qmin}-{qmax} + {args.quiet_tokens}) tokens, one every "
              f"{args.quiet_interval_ms:g} ms from {args.quiet_delay:g}s; {args.num_pages} pages, "
              f"--max-num-seqs {args.max_num_seqs}; quota configs: A page_quota {args.flood_quota:g} "
              f"({quota_pages} pages), max_concurrent_requests {args.flood_concurrency}; budget: "
              f"{args.flood_page_budget} pages (window {cfg.flood_window_tokens} tokens)", flush=True)
    if run_long:
        print(f"long context: {args.long_requests} x ({args.long_prompt} + {args.long_tokens}) tokens "
              f"({pages_for(args.long_prompt + args.long_tokens - 1, bs)} pages each at full length) on "
              f"{args.long_num_pages} pages; window run --sliding-window {args.window} --sink-tokens {args.sink} "
              f"(about {window_bound} pages a request)", flush=True)
    print(f"{cfg.nproc} CPUs, torch {cfg.torch_version} ({cfg.torch_threads} threads)", flush=True)

    with tempfile.TemporaryDirectory(prefix="pagedkv-tenants-") as tmp:
        specs: dict[str, list[str] | ClusterSpec] = {}
        if run_noisy:
            for c in args.configs:
                path = Path(tmp) / f"{c.replace('+', '_')}.toml"
                path.write_text(tenants_toml(c, args))
                specs[c] = noisy_server_args(args, str(model_dir), c, path)
        if run_long:
            for r in LONG_RUNS:
                specs[r] = long_server_args(args, str(model_dir), r)
        servers = Servers(specs, together=args.start == "together")
        try:
            noisy = noisy_part(args, servers, flood_reqs, quiet_reqs, alone_reqs) if run_noisy else None
            long = long_part(args, servers, long_reqs) if run_long else None
        finally:
            servers.stop_all()
    startup = servers.startup_s

    notes: list[str] = []
    problems: list[str] = []
    all_runs: list[tuple[str, dict[str, Any]]] = []
    if noisy is not None:
        all_runs += [(name, run) for name, run in noisy.items()]
        report_noisy(noisy, cfg, notes, problems)
    if long is not None:
        all_runs += [(f"long {name}", run) for name, run in long.items()]
        report_long(long, cfg, notes, problems)
    for name, run in all_runs:
        if not run["leak_free"]:
            problems.append(f"{name}: pages still held after the run: {run['leaks']}")
    contended = [name for name, run in all_runs if is_contended(run)]
    print()
    for n in notes:
        print(f"NOTE: {n}")
    if contended:
        print(f"WARNING: other processes competed for the CPUs during {', '.join(contended)} (see 'cpu' in the "
              "JSON); rerun on an idle machine")
    for e in problems:
        print(f"ERROR: {e}", file=sys.stderr)

    report = {"contended": bool(contended), "contended_runs": contended, "config": asdict(cfg),
              "server_startup_s": startup, "noisy_neighbour": noisy, "long_context": long,
              "notes": notes, "errors": problems,
              "workload": {"flood": [{"prompt_len": len(r.prompt), "max_tokens": r.max_tokens} for r in flood_reqs],
                           "quiet": [{"prompt_len": len(r.prompt), "max_tokens": r.max_tokens,
                                      "send_s": args.quiet_delay + i * args.quiet_interval_ms / 1000}
                                     for i, r in enumerate(quiet_reqs)],
                           "long": [{"prompt_len": len(r.prompt), "max_tokens": r.max_tokens} for r in long_reqs]}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(_json_safe(report), indent=2) + "\n")
    print(f"wrote {args.out}")
    return 1 if problems else 0


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


if __name__ == "__main__":
    sys.exit(main())
