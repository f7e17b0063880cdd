"""The uniform workload (64 x 128-token prompts -> 64 tokens, greedy, no early stop; tiny-llama) in one process,
with no serving cost: pagedkv's real Scheduler and ModelRunner (tests/support/inprocess.py, integrity checks off)
against HF ``generate`` on one static batch of 64, alternating, ``--rounds`` rounds. What pagedkv would reach
against HF static with a free server (no gRPC, no scheduler process, no client reading streams).

    python bench/uniform_inprocess.py [--threads 2] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    from e2e_peers import _hf_model, workload

    from pagedkv.models import resolve_model
    from tests.support.fake_executor import drive, make_request
    from tests.support.inprocess import InProcessServer

    path = resolve_model("tiny-llama")
    reqs = workload("uniform", 0)
    model = _hf_model(path, "sdpa")

    def hf() -> None:
        ids = torch.tensor([r.prompt for r in reqs])
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=64,
                                 min_new_tokens=64, do_sample=False)
        assert out.shape[1] == ids.shape[1] + 64

    def pagedkv() -> None:
        server = InProcessServer(path, num_pages=2000, max_num_seqs=256, max_num_batched_tokens=2048)
        server.scheduler.check_integrity = lambda: None  # (a test harness check, not part of serving)
        running = []
        for i, r in enumerate(reqs):
            req = make_request(i, 0, 64, prompt=list(r.prompt))
            req.sampling.ignore_eos = True
            server.scheduler.add(req)
            running.append(req)
        drive(server.scheduler, executor=server)
        assert all(len(req.output_ids) == 64 for req in running)

    hf()
    pagedkv()  # (warm-up: kernel load, first allocations)
    walls: dict[str, list[float]] = {"HF static": [], "pagedkv": []}
    for _ in range(args.rounds):
        for name, run in (("HF static", hf), ("pagedkv", pagedkv)):
            t = time.perf_counter()
            run()
            walls[name].append(time.perf_counter() - t)
    print(f"\nuniform 64 x 128 -> 64, tiny-llama, one process, {args.threads} threads, load "
          f"{os.getloadavg()[0]:.2f}\n")
    print("| system | wall s (rounds) | median | output tok/s |\n|---|---|---|---|")
    for name, w in walls.items():
        print(f"| {name} | {' / '.join(f'{x:.2f}' for x in w)} | {statistics.median(w):.2f} | "
              f"{64 * 64 / statistics.median(w):.0f} |")
    print(f"pagedkv / HF static output tokens/s: "
          f"{statistics.median(walls['HF static']) / statistics.median(walls['pagedkv']):.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
