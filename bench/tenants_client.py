"""What tenants.py's client sends and sees: its constants (tenants, keys, configurations), the requests, each
request's stream as it arrived, the ``ModelInfo`` poller that runs beside a trace, and ModelInfo read as a dict
(after a trace, once nothing is held any more)."""

from __future__ import annotations

import asyncio
import math
import random
import statistics
import time
from dataclasses import dataclass
from typing import Any

import grpc

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
