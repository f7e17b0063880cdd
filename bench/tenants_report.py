"""tenants.py's report: the summaries of a trace (each tenant's streams, its counters and the server's as deltas),
the run's configuration as the JSON records it, and the tables' cells."""

from __future__ import annotations

import math
import os
import platform
import statistics
from dataclasses import dataclass, field
from typing import Any

import torch
from common import percentile
from tenants_client import CONFIGS, Stream


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
