"""The scheduler's periodic stats line (``--log-stats-interval``), as vLLM's "Avg prompt throughput: ..." line: one
INFO line every interval while there is activity, in place of a line per request (those are DEBUG).

Its figures come from the scheduler's Prometheus metrics (metrics.py), which are kept whether or not /metrics is
served: prompt and generation tok/s over the interval, requests running, waiting and swapped now, device KV usage
now, and the prefix-cache hit rate of the prompt tokens admitted in the interval. An interval with no tokens and no
request in the queues logs nothing, except the first such one after activity (the line that shows it settled).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import REGISTRY

COUNTERS = {"prompt": "pagedkv_prompt_tokens_total", "generation": "pagedkv_generated_tokens_total",
            "prefix_queries": "pagedkv_prefix_cache_query_tokens_total",
            "prefix_hits": "pagedkv_prefix_cache_hit_tokens_total"}
GAUGES = {"running": "pagedkv_requests_running", "waiting": "pagedkv_requests_waiting",
          "swapped": "pagedkv_requests_swapped", "kv_usage": "pagedkv_kv_cache_usage_perc"}


def _sample(name: str) -> float:
    return REGISTRY.get_sample_value(name) or 0.0


@dataclass(frozen=True, slots=True)
class Reading:
    at: float  # time.monotonic()
    counters: dict[str, float]

    @classmethod
    def now(cls) -> Reading:
        return cls(time.monotonic(), {k: _sample(v) for k, v in COUNTERS.items()})


def stats_fields(before: Reading, after: Reading) -> dict[str, float | int]:
    """The stats line's fields for the interval between two readings (the gauges as they are now)."""
    seconds = max(after.at - before.at, 1e-9)
    delta = {k: after.counters[k] - before.counters[k] for k in COUNTERS}
    gauges = {k: _sample(v) for k, v in GAUGES.items()}
    return {"prompt_tok_s": round(delta["prompt"] / seconds, 1),
            "generation_tok_s": round(delta["generation"] / seconds, 1),
            "running": int(gauges["running"]), "waiting": int(gauges["waiting"]), "swapped": int(gauges["swapped"]),
            "kv_usage_pct": round(100 * gauges["kv_usage"], 1),
            "prefix_hit_rate_pct": round(100 * delta["prefix_hits"] / delta["prefix_queries"], 1)
            if delta["prefix_queries"] else 0.0}


def active(fields: dict[str, float | int]) -> bool:
    return any(fields[k] for k in ("prompt_tok_s", "generation_tok_s", "running", "waiting", "swapped"))


async def log_stats(interval: float, log, refresh: Callable[[], None]) -> None:
    """Every ``interval`` seconds, ``refresh()`` (the gauges brought up to date), then the stats line when there
    was activity (see the module doc). Runs until cancelled."""
    before, was_active = Reading.now(), False
    while True:
        await asyncio.sleep(interval)
        refresh()
        after = Reading.now()
        fields = stats_fields(before, after)
        now_active = active(fields)
        if now_active or was_active:
            log.info("stats", interval_s=round(after.at - before.at, 1), **fields)
        before, was_active = after, now_active
