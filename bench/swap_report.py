"""swap.py's report: the run's configuration, each policy's medians over its trials, the ratios against
recompute, the table, the executor's cost line and the output comparison between policies."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

from common import Machine, Request, first_difference, is_contended, print_table

POLICIES = ("recompute", "swap", "auto")


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
