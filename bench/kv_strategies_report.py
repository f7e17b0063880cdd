"""kv_strategies.py's report: the table beside the seeds' claims, and the PNG (bars and utilization over time)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import common
from kv_strategies_sim import RowResult

# The seeds' table (seeds/000: 70B model on one A100): KV utilization and concurrent requests per strategy.
SEED_CLAIMS: dict[str, dict[str, str]] = {
    "contiguous": {"utilization": "30-40%", "concurrency": "16-32"},
    "bucketing": {"utilization": "45-60%", "concurrency": "32-64"},
    "paged": {"utilization": "85-95%", "concurrency": "128-256 (2-4x contiguous)"},
    "paged+sliding-window": {"utilization": "90-98%", "concurrency": "192-384"},
    "paged+share-prefix": {"utilization": "92-98% (with swap)", "concurrency": "192-320; -15..30% KV"},
    "paged+8bit-kv": {"utilization": "85-95%", "concurrency": "fp8: KV x2, 4x contiguous fp16; int8: +30-50%"},
}


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or not b else f"{a / b:.2f}x"


def format_table(summaries: list[dict[str, Any]]) -> str:
    contiguous = next(s for s in summaries if s["kind"] == "contiguous")
    head = ("strategy", "KV util", "seeds' util", "tokens/slot", "mean conc", "max conc", "x contig",
            "seeds' concurrency", "preempt")
    body = []
    for s in summaries:
        claim = SEED_CLAIMS[s["kind"]]
        body.append((s["strategy"], _pct(s["utilization"]), claim["utilization"],
                     f"{s['logical_tokens_per_slot']:.3f}",
                     "-" if s["mean_saturated_concurrency"] is None else f"{s['mean_saturated_concurrency']:.1f}",
                     str(s["max_concurrency"]),
                     _ratio(s["mean_saturated_concurrency"], contiguous["mean_saturated_concurrency"]),
                     claim["concurrency"],
                     str(s["preemptions"])))
    return common.format_table(head, body)


def write_png(path: Path, rows: list[RowResult], summaries: list[dict[str, Any]]) -> str:
    """Bars (utilization, concurrency) and utilization over time; returns a note when it cannot."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no PNG: matplotlib is not installed (pip install matplotlib)"
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(17, 5.5))
    names = [s["strategy"] for s in summaries]
    ys = range(len(names))
    ax1.barh(ys, [100 * (s["utilization"] or 0) for s in summaries], color="tab:blue")
    for y, s in zip(ys, summaries, strict=True):
        lo, hi = (float(x) for x in SEED_CLAIMS[s["kind"]]["utilization"].split("%")[0].split("-"))
        ax1.plot([lo, hi], [y, y], color="tab:orange", lw=6, alpha=0.6, label="seeds' claim" if y == 0 else None)
    ax1.set_yticks(list(ys), names)
    ax1.invert_yaxis()
    ax1.set_xlabel("KV utilization (%)")
    ax1.set_xlim(0, 100)
    ax1.legend(loc="upper center", bbox_to_anchor=(0.5, -0.1))
    ax2.barh(ys, [s["max_concurrency"] for s in summaries], color="tab:green", label="max")
    ax2.barh(ys, [s["mean_saturated_concurrency"] or 0 for s in summaries], color="tab:olive", height=0.4,
             label="mean (saturated)")
    ax2.set_yticks(list(ys), [])
    ax2.invert_yaxis()
    ax2.set_xlabel("concurrent requests at the KV budget")
    ax2.legend(loc="lower right")
    for row in rows:
        ax3.plot([t[0] for t in row.timeline], [100 * t[1] for t in row.timeline], label=row.strategy, lw=1)
    ax3.set_xlabel("step")
    ax3.set_ylabel("KV utilization (%)")
    ax3.set_ylim(0, 102)
    ax3.legend(fontsize=7, loc="lower left")
    fig.suptitle("KV strategies on one trace (simulation with scheduler_svc's page manager)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return ""
