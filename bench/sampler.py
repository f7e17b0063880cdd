"""The executor's sampler alone: ``sample()`` on [rows, vocab] random logits, greedy and with temperature, top-p
and top-k, one torch thread, median of ``--repeats`` calls. With ``--against DIR`` the same calls run on another
checkout's sampler (a subprocess with that checkout on PYTHONPATH), side by side.

    python bench/sampler.py                         # 256 rows, vocabularies of 259 and 32,000
    python bench/sampler.py --against /tmp/before   # before / after
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KINDS = {  # what every row asks for: temperature, top_p, top_k
    "greedy": (0.0, 1.0, 0),
    "temperature 0.8": (0.8, 1.0, 0),
    "temperature 0.8, top-p 0.9": (0.8, 0.9, 0),
    "temperature 0.8, top-k 50, top-p 0.9": (0.8, 0.9, 50),
}


def measure(rows: int, vocabs: list[int], repeats: int) -> dict[str, float]:
    import torch

    from executor_svc.sampler import SamplingParams, sample

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    out = {}
    for vocab in vocabs:
        logits = torch.randn(rows, vocab, generator=g) * 3
        for kind, (t, p, k) in KINDS.items():
            params = [SamplingParams(temperature=t, top_p=p, top_k=k, seed=i) for i in range(rows)]
            times = []
            for r in range(repeats):
                start = time.perf_counter()
                sample(logits, params, [r] * rows)
                times.append(time.perf_counter() - start)
            out[f"{vocab}|{kind}"] = 1e3 * statistics.median(times)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--vocab", default="259,32000")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--against", default="", metavar="DIR", help="another checkout, measured the same way")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    vocabs = [int(v) for v in args.vocab.split(",")]
    if args.child:
        print(json.dumps(measure(args.rows, vocabs, args.repeats)))
        return 0

    def run(tree: Path) -> dict[str, float]:
        cmd = [sys.executable, __file__, "--child", "--rows", str(args.rows), "--vocab", args.vocab,
               "--repeats", str(args.repeats)]
        done = subprocess.run(cmd, cwd=tree, env=dict(os.environ, PYTHONPATH=str(tree)), capture_output=True,
                              text=True, check=True)
        return json.loads(done.stdout.strip().splitlines()[-1])
    mine = run(ROOT)
    other = run(Path(args.against)) if args.against else None
    print(f"\nsample() on {args.rows} rows, one thread, ms (median of {args.repeats}; load "
          f"{os.getloadavg()[0]:.2f})\n")
    print("| vocabulary | sampling | " + ("other | this checkout | ratio |" if other else "ms |"))
    print("|---|---|" + ("---|---|---|" if other else "---|"))
    for key, ms in mine.items():
        vocab, kind = key.split("|")
        if other:
            print(f"| {vocab} | {kind} | {other[key]:.2f} | {ms:.2f} | {ms / other[key]:.2f}x |")
        else:
            print(f"| {vocab} | {kind} | {ms:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
