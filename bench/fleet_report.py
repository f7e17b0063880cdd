"""fleet.py's report: the targets' verdicts, the tables (arms; the Dynamo hop) and the PNG."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from common import print_table
from fleet_load import Config


def verdicts(results: dict[str, dict[str, Any]], arm: str = "dynamo-kv") -> dict[str, str]:
    """The targets, for ``arm`` (Dynamo's KV routing with its defaults, or -tuned)."""
    out: dict[str, str] = {}
    kv, single, rr = results.get(arm), results.get("single"), results.get("dynamo-rr")
    if kv and single:
        out["hit"] = "PASS" if kv["hit_ratio"] >= 0.9 * single["hit_ratio"] else "MISS"
    if kv and rr:
        out["ttft"] = "PASS" if kv["ttft_p99_s"] <= rr["ttft_p99_s"] else "MISS"
    if kv and "hop" in kv:
        out["hop"] = "PASS" if kv["hop"]["edge+dynamo"]["tpot_ratio"] <= 1.1 else "MISS"
    return out


def print_report(results: dict[str, dict[str, Any]], cfg: Config) -> None:
    single = results.get("single", {}).get("hit_ratio")
    rr = results.get("dynamo-rr", {}).get("ttft_p99_s")
    rows = []
    for arm, r in results.items():
        v = verdicts(results, arm)
        hit = f"{r['hit_ratio']:.3f}"
        if arm.startswith("dynamo-kv") and single:
            hit += f" ({r['hit_ratio'] / single:.2f}x single, target >= 0.9: {v['hit']})"
        p99 = f"{r['ttft_p99_s'] * 1e3:.0f}"
        if arm.startswith("dynamo-kv") and rr:
            p99 += f" ({r['ttft_p99_s'] / rr:.2f}x dynamo-rr: {v['ttft']})"
        same = r.get("same_worker_repeats", float("nan"))
        rows.append([arm, hit, f"{r['ttft_p50_s'] * 1e3:.0f}", p99, f"{r['output_tok_s']:.1f}",
                     "-" if same != same else f"{same:.2f}", f"{r['errors']}/{r['requests']}",
                     f"{r['cpu'].get('foreign_share', float('nan')):.2f}"])
    print(f"\n{cfg.model}: {cfg.requests} requests, Poisson {cfg.rate}/s, {cfg.tenants} tenants x "
          f"{cfg.prompts_per_tenant} system prompts of {cfg.system_tokens} tokens, {cfg.max_tokens} output tokens; "
          f"{cfg.num_pages} pages a scheduler (single: {2 * cfg.num_pages}), no host tier")
    print_table(["arm", "cached/prompt", "TTFT p50 ms", "TTFT p99 ms", "out tok/s", "repeat same worker", "errors",
                 "foreign CPU"], rows)
    hop = results.get("dynamo-kv", {}).get("hop")
    if hop:
        print(f"\nthe Dynamo hop at batch 1 (medians of {hop['direct-gateway']['n']} requests each, "
              f"{cfg.hop_max_tokens} tokens):")
        rows = []
        for name, h in hop.items():
            ratio = "" if name == "direct-gateway" else f"{h['ttft_ratio']:.2f}x / {h['tpot_ratio']:.2f}x"
            if name == "edge+dynamo":
                ratio += f" (TPOT target <= 1.1x: {verdicts(results)['hop']})"
            rows.append([name, f"{h['ttft_p50_s'] * 1e3:.1f}", f"{h['tpot_p50_s'] * 1e3:.2f}", ratio])
        print_table(["path", "TTFT ms", "TPOT ms", "TTFT / TPOT vs direct"], rows)


def plot(results: dict[str, dict[str, Any]], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no PNG")
        return
    arms = list(results)
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.5))
    axes[0].bar(arms, [results[a]["hit_ratio"] for a in arms])
    axes[0].set_title("cached / prompt tokens")
    axes[1].bar(arms, [results[a]["ttft_p99_s"] * 1e3 for a in arms])
    axes[1].set_title("TTFT p99 (ms)")
    axes[2].bar(arms, [results[a]["output_tok_s"] for a in arms])
    axes[2].set_title("output tok/s")
    for ax in axes:
        ax.tick_params(axis="x", labelrotation=30)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"wrote {path}")
