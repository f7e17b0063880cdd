"""The documentation site's plots (docs/performance.md), drawn from the JSON results committed under bench/results:

* ``flagship.png``: bench/flagship.py — output tok/s and TTFT p99 of each system at one KV budget;
* ``kv_quality.png``: bench/kv_quant.py (SmolLM2) and bench/vllm_kv_quality.py — perplexity change and top-1
  agreement of each KV dtype against float32 KV, pagedkv's and vLLM's;
* ``kv_decode.png``: bench/kv_quant.py part 4 — decode tok/s of each KV dtype against float32, by context length.

    python bench/plots.py                    # -> docs/img/*.png
    python bench/plots.py --out /tmp/plots
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
SOURCES = {  # plot -> the result files it reads
    "flagship.png": ("flagship_s26.json",),
    "kv_quality.png": ("kv_quant_smollm2_s25.json", "vllm_kv_quality_s26.json"),
    "kv_decode.png": ("kv_quant_decode_512_s25.json", "kv_quant_decode_2048_s25.json",
                      "kv_quant_decode_4096_s26.json"),
}


def _load(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def flagship(ax_pair) -> None:
    systems = _load("flagship_s26.json")["systems"]
    names = [n for n, s in systems.items() if s["median"].get("runs")]
    tps = [systems[n]["median"]["output_throughput"] for n in names]
    ttft = [systems[n]["median"]["p99_ttft_ms"] / 1000 for n in names]
    colors = ["tab:blue" if n.startswith("pagedkv") else "tab:gray" for n in names]
    for ax, vals, label in zip(ax_pair, (tps, ttft), ("output tok/s (higher is better)",
                                                      "TTFT p99, s (lower is better)"), strict=True):
        ax.barh(names, vals, color=colors)
        ax.set_xlabel(label)
        ax.invert_yaxis()
    ax_pair[0].set_title("SmolLM2-135M, 128 MiB of KV each, shared-prefix Poisson, 2 CPU cores", loc="left")


def kv_quality(ax_pair) -> None:
    ours = _load("kv_quant_smollm2_s25.json")["quality"]
    vllm = {r["kv"]: r for r in _load("vllm_kv_quality_s26.json")["results"]}
    base = ours["float32"]["perplexity"]
    rows = [(f"pagedkv {k}", ours[k]["perplexity"] / base - 1, ours[k]["top1_agreement"])
            for k in ("bfloat16", "fp8_e4m3", "int8")]
    rows += [(f"vLLM {k}", vllm[k]["ppl_vs_fp32"], vllm[k]["top1_agreement"]) for k in ("fp8_e4m3", "fp8_e5m2")
             if k in vllm]
    names = [r[0] for r in rows]
    colors = ["tab:blue" if n.startswith("pagedkv") else "tab:gray" for n in names]
    ax_pair[0].barh(names, [100 * r[1] for r in rows], color=colors)
    ax_pair[0].set_xlabel("perplexity vs float32 KV, % (lower is better)")
    ax_pair[1].barh(names, [100 * r[2] for r in rows], color=colors)
    ax_pair[1].set_xlabel("top-1 agreement with float32 KV, % (higher is better)")
    ax_pair[1].set_xlim(80, 100)
    for ax in ax_pair:
        ax.invert_yaxis()
    ax_pair[0].set_title("SmolLM2-135M, CPython's pydoc text, 128-token chunked prefills", loc="left")


def kv_decode(ax) -> None:
    for name, color in (("fp8_e4m3", "tab:orange"), ("int8", "tab:green")):
        points = []
        for f in SOURCES["kv_decode.png"]:
            r = _load(f)
            if name in r["decode"]:
                points.append((r["decode_setup"]["ctx"], r["decode"][name]["tokens_per_s"] /
                               r["decode"]["float32"]["tokens_per_s"]))
        ax.plot(*zip(*points), marker="o", color=color, label=name)
    ax.axhline(1.0, color="tab:gray", linestyle="--", label="float32 KV")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("decode tok/s vs float32 KV")
    ax.set_title("SmolLM2-135M decode, batch 32, 2 CPU cores", loc="left")
    ax.legend()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "img")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for name, draw, shape in (("flagship.png", flagship, (2, 1)), ("kv_quality.png", kv_quality, (2, 1)),
                              ("kv_decode.png", kv_decode, (1, 1))):
        fig, axes = plt.subplots(*shape, figsize=(8, 4.5 if shape[0] == 2 else 3.5))
        draw(axes)
        fig.tight_layout()
        fig.savefig(args.out / name, dpi=100, metadata={"Software": None})
        plt.close(fig)
        print(args.out / name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
