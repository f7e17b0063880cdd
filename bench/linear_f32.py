"""Float32 linears on the CPU: our product (executor_svc/model/cpu_gemm.cpp) against oneDNN's prepacked one, the two
paths of ``executor_svc.model.cpu_linear.PackedLinear``, in one process, alternated.

SmolLM2's four layer linears (qkv 576->960, o 576->576, gate_up 576->3,072, down 1,536->576) over ``--layers``
layers of fresh random weights (more bytes than the L3 cache holds: each product reads its weight from memory, as
in a step), at each row count of ``--rows``; medians of ``--reps`` alternated passes. Prints the table (ms a pass,
GFLOP/s, weight read GB/s) and writes bench/results/linear_f32.json.

    python bench/linear_f32.py
    python bench/linear_f32.py --rows 1,8,2048 --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common import print_table, write_report  # noqa: E402

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,2,4,8,16,32,64,128,512,2048")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "linear_f32.json"))
    args = p.parse_args()
    import torch

    from executor_svc.model import cpu_linear

    torch.set_num_threads(args.threads)
    if cpu_linear.float32_kernel() is None:
        raise SystemExit("our float32 product is not built here (no AVX-512, or no kernel library)")
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=g) * 0.05 for n, k in SHAPES * args.layers]
    ours = [cpu_linear.PackedLinear(w, None) for w in weights]
    cpu_linear._ours[:] = [None]  # the next ones through oneDNN
    onednn = [cpu_linear.PackedLinear(w, None) for w in weights]
    cpu_linear._ours.clear()
    assert ours[0].ops is not None and onednn[0].ops is None
    nbytes = sum(w.numel() * 4 for w in weights)
    flops_per_row = 2 * sum(w.numel() for w in weights)
    rows, report = [], {"threads": args.threads, "layers": args.layers, "weight_bytes": nbytes, "rows": {}}
    for m in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(m, k, generator=g) for k in {k for _, k in SHAPES}}
        times: dict[str, list[float]] = {"ours": [], "onednn": []}
        for rep in range(args.reps):
            order = [("ours", ours), ("onednn", onednn)]
            for name, lins in order if rep % 2 == 0 else order[::-1]:
                start = time.perf_counter()
                for lin, w in zip(lins, weights):
                    lin(xs[w.shape[1]])
                times[name].append(time.perf_counter() - start)
        o, d = statistics.median(times["ours"]), statistics.median(times["onednn"])
        report["rows"][m] = {"ours_s": o, "onednn_s": d}
        rows.append([str(m), f"{o * 1e3:.2f}", f"{d * 1e3:.2f}", f"{o / d:.2f}x", f"{m * flops_per_row / o / 1e9:.0f}",
                     f"{m * flops_per_row / d / 1e9:.0f}", f"{nbytes / o / 1e9:.1f}", f"{nbytes / d / 1e9:.1f}"])
    print(f"\nSmolLM2's layer linears x {args.layers} layers ({nbytes / 1e6:.0f} MB of float32 weights), "
          f"{args.threads} threads\n")
    print_table(["rows", "ours ms", "oneDNN ms", "ours / oneDNN", "ours GFLOP/s", "oneDNN GFLOP/s", "ours GB/s",
                 "oneDNN GB/s"], rows)
    write_report(args.out, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
