"""PNG plots of a run: latency CDFs, and KV utilization over time when the scheduler's gauges were scraped.

matplotlib is optional (the ``bench`` extra): without it no PNG is written and ``write_plots`` says why.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pagedkv.loadgen.report import itl_s, tpot_s
from pagedkv.loadgen.runner import RequestResult
from pagedkv.loadgen.scrape import page_utilization

NO_MATPLOTLIB = "no PNG plots: matplotlib is not installed (pip install matplotlib, or pagedkv[bench])"


def _cdf(ax: Any, values_ms: list[float], title: str) -> None:
    xs = sorted(values_ms)
    if xs:
        ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post")
    ax.set_title(f"{title} (n={len(xs)})")
    ax.set_xlabel("ms")
    ax.set_ylabel("fraction of samples")
    ax.grid(alpha=0.3)


def write_plots(prefix: Path, results: Sequence[RequestResult], kv_samples: list[dict] | None) -> tuple[list[str], str]:
    """Writes ``<prefix>_latency_cdf.png`` (and ``<prefix>_kv.png`` with KV samples); returns (paths, note)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return [], NO_MATPLOTLIB
    done = [r for r in results if r.ok]
    series = [
        ([r.ttft_s * 1e3 for r in done if r.ttft_s is not None], "TTFT"),
        ([t * 1e3 for t in map(tpot_s, done) if t is not None], "TPOT"),
        ([g * 1e3 for r in done for g in itl_s(r)], "ITL"),
        ([r.e2e_s * 1e3 for r in done if r.e2e_s is not None], "E2E latency"),
    ]
    prefix.parent.mkdir(parents=True, exist_ok=True)
    paths = []
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, (values, title) in zip(axes.flat, series, strict=True):
        _cdf(ax, values, title)
    fig.suptitle("pagedkv bench: latency CDFs")
    fig.tight_layout()
    path = prefix.with_name(prefix.name + "_latency_cdf.png")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    paths.append(str(path))
    if kv_samples:
        fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
        ts = [s["t_s"] for s in kv_samples]
        util = [page_utilization(s["values"]) for s in kv_samples]
        ax1.plot(ts, [u * 100 if u is not None else float("nan") for u in util], label="pages used / all pages")
        if any("pagedkv_kv_slot_utilization" in s["values"] for s in kv_samples):
            ax1.plot(ts, [s["values"].get("pagedkv_kv_slot_utilization", float("nan")) * 100 for s in kv_samples],
                     label="pagedkv_kv_slot_utilization (as the scheduler reports it)")
        ax1.set_ylabel("%")
        ax1.set_ylim(bottom=0)
        ax1.legend(loc="lower right")
        ax1.grid(alpha=0.3)
        for name, label in (("pagedkv_requests_running", "running"), ("pagedkv_requests_waiting", "waiting")):
            ax2.plot(ts, [s["values"].get(name, float("nan")) for s in kv_samples], label=label)
        ax2.set_xlabel("seconds since start")
        ax2.set_ylabel("requests")
        ax2.legend(loc="upper right")
        ax2.grid(alpha=0.3)
        fig.suptitle("pagedkv bench: KV utilization (scheduler metrics)")
        fig.tight_layout()
        path = prefix.with_name(prefix.name + "_kv.png")
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(str(path))
    return paths, ""
