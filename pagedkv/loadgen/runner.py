"""Sends the planned requests at their times and records when each streamed message arrived.

Times are ``time.perf_counter`` seconds. A request is *sent* when it starts its gRPC call: at its planned
time, or later when ``max_concurrency`` calls are already open (the wait is kept as ``queue_wait_s``).
Latencies are measured from the send. Each stream message that carries token ids is one *delivery*: its
arrival time and its token count are kept (a message may carry several tokens; ITL is computed per
delivery, see ``report``).
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TextIO

import grpc

from pagedkv.client import FINISH_NAMES, Client
from pagedkv.loadgen.scrape import MetricsScraper
from pagedkv.loadgen.workload import PlannedRequest


@dataclass(slots=True)
class RequestResult:
    index: int
    tenant: str
    prefix: int
    prompt_tokens: int  # sent
    max_tokens: int  # asked
    send_s: float = 0.0  # since the start of the run
    queue_wait_s: float = 0.0  # planned time -> send (concurrency cap)
    ttft_s: float | None = None
    e2e_s: float | None = None  # send -> end of stream (or error)
    delivery_s: list[float] = field(default_factory=list)  # since send, one per message carrying tokens
    delivery_tokens: list[int] = field(default_factory=list)
    output_tokens: int = 0  # token ids streamed
    usage_completion_tokens: int = 0
    usage_prompt_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None  # gRPC status code name
    error_detail: str = ""

    @property
    def ok(self) -> bool:
        return self.error is None and self.finish_reason in ("stop", "length")


@dataclass(frozen=True, slots=True)
class SamplingOptions:
    ignore_eos: bool = True
    temperature: float = 0.0
    seed: int = 0  # request i samples with seed + i


class Progress:
    """One plain-text line on a terminal, redrawn at most 10 times a second; silent when disabled."""

    def __init__(self, total: int, enabled: bool, stream: TextIO = sys.stderr) -> None:
        self.total, self.enabled, self.stream = total, enabled, stream
        self.done = self.errors = self.inflight = 0
        self.t0 = time.perf_counter()
        self._last = 0.0

    def update(self, force: bool = False) -> None:
        now = time.perf_counter()
        if not self.enabled or (not force and now - self._last < 0.1):
            return
        self._last = now
        width = 30
        filled = width * self.done // max(1, self.total)
        bar = "#" * filled + "-" * (width - filled)
        self.stream.write(f"\r[{bar}] {self.done}/{self.total} done, {self.inflight} in flight, "
                          f"{self.errors} errors, {now - self.t0:.1f}s ")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.update(force=True)
            self.stream.write("\n")
            self.stream.flush()


async def _stream(client: Client, req: PlannedRequest, opts: SamplingOptions, res: RequestResult) -> None:
    send = time.perf_counter()
    try:
        async for msg in client.generate(req.prompt, max_tokens=req.max_tokens, ignore_eos=opts.ignore_eos,
                                         temperature=opts.temperature, seed=opts.seed + req.index):
            if msg.token_ids:
                t = time.perf_counter() - send
                if res.ttft_s is None:
                    res.ttft_s = t
                res.delivery_s.append(t)
                res.delivery_tokens.append(len(msg.token_ids))
                res.output_tokens += len(msg.token_ids)
            if msg.finish_reason:
                res.finish_reason = FINISH_NAMES.get(msg.finish_reason) or str(msg.finish_reason)
                res.usage_completion_tokens = msg.usage.completion_tokens
                res.usage_prompt_tokens = msg.usage.prompt_tokens
                res.cached_tokens = msg.usage.cached_tokens
    except grpc.aio.AioRpcError as err:
        res.error, res.error_detail = err.code().name, err.details() or ""
    res.e2e_s = time.perf_counter() - send


async def run_requests(address: str, plan: Sequence[PlannedRequest], keys: dict[str, str], opts: SamplingOptions,
                       max_concurrency: int = 0, progress: Progress | None = None,
                       scraper: MetricsScraper | None = None,
                       tls: dict[str, str] | None = None) -> tuple[list[RequestResult], float]:
    """Runs the plan; returns the results (in plan order) and the wall time from the start to the end of
    the last stream. ``keys`` maps tenant names to API keys ("" for none); ``tls``: Client's tls_ca and
    tls_server_name."""
    progress = progress or Progress(len(plan), enabled=False)
    # NOTE: no resume: a stream the server ended or refused (a full queue, a scheduler gone) counts as the error it
    # was, not as a slow success.
    clients = {name: Client(address, api_key=key, resume=None, **(tls or {})) for name, key in keys.items()}
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency > 0 else None
    results = [RequestResult(r.index, r.tenant, r.prefix, len(r.prompt), r.max_tokens) for r in plan]
    stop = asyncio.Event()
    t0 = time.perf_counter()

    async def one(req: PlannedRequest, res: RequestResult) -> None:
        delay = t0 + req.send_at_s - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if sem is not None:
            await sem.acquire()
        try:
            res.send_s = time.perf_counter() - t0
            res.queue_wait_s = max(0.0, res.send_s - req.send_at_s)
            progress.inflight += 1
            progress.update()
            await _stream(clients[req.tenant], req, opts, res)
        finally:
            if sem is not None:
                sem.release()
            progress.inflight -= 1
            progress.done += 1
            progress.errors += not res.ok
            progress.update()

    scrape_task = asyncio.create_task(scraper.run(t0, stop)) if scraper is not None else None
    try:
        await asyncio.gather(*(one(r, res) for r, res in zip(plan, results, strict=True)))
        wall = time.perf_counter() - t0
    finally:
        stop.set()
        if scrape_task is not None:
            await scrape_task
        progress.close()
        for c in clients.values():
            await c.close()
    return results, wall
