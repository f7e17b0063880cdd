"""Prefill steps on the executor's own path (``executor_svc.startup.build``), in one process with the real Scheduler
planning, and optionally against another checkout, the two alternated process by process (issue #46: float32 prefill
chunks attended by the CPU kernel instead of SDPA).

Cases: one 512-token prompt; one 2,048-token prompt; 8 prompts of 128 in one step; the 3rd 1,024-token chunk of a
3,072-token prompt; 31 chunks of 64 over a shared 1,024-token prefix (the burst of bench/e2e_peers.py's shared
workload). Each step is run ``--runs`` times per process (a new prompt each run), ``--rounds`` processes per tree;
the table gives the median over all of them.

    python bench/prefill_step.py [--against /tmp/before] [--rounds 4] [--runs 3]
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


def measure(args) -> dict[str, list[float]]:
    from executor_svc import args as executor_args
    from executor_svc.startup import build
    from pagedkv import logs
    from scheduler_svc.pages import PagePool
    from scheduler_svc.scheduler import Scheduler, SchedulerConfig
    from tests.support.driven import Driven
    from tests.support.fake_executor import make_request

    p = argparse.ArgumentParser()
    executor_args.add_args(p)
    runner, describe = build(p.parse_args(["--model", args.model, "--num-pages", "900", "--threads", str(args.threads),
                                           "--swap-space", "0"]), logs.configure("bench", json=True, level="warning"))

    def planner(budget: int, seqs: int = 64) -> Driven:
        return Driven(Scheduler(PagePool(runner.num_pages, runner.block_size),
                                SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=budget, max_model_len=4096,
                                                watermark=0.0), list(describe.eos_token_ids)))

    def prompt(n: int, seed: int) -> list[int]:
        return [1] + [100 + (j * 7 + seed * 13) % 40000 for j in range(n - 1)]

    def add(s: Driven, i: int, ids: list[int]) -> None:
        req = make_request(i, 0, 4, prompt=ids)
        req.sampling.ignore_eos = True
        s.add(req)

    def steps(s: Driven, n: int, before_last=None) -> float:
        """Runs n steps; returns the last one's time (``before_last(s)`` once its plan is made)."""
        took = 0.0
        for k in range(n):
            plan, _ = s.schedule()
            if k == 1 and before_last is not None:
                before_last(s)
            t = time.perf_counter()
            result = runner.step(plan)
            took = time.perf_counter() - t
            s.process(result)
        return took

    def whole(n: int, count: int = 1):
        def case(run: int) -> float:
            s = planner(4096)
            for i in range(count):
                add(s, i, prompt(n, run * 101 + i))
            return steps(s, 1)
        return case

    def chunked(run: int) -> float:
        s = planner(1024, 4)
        add(s, 0, prompt(3072, run))
        return steps(s, 3)

    def burst(run: int) -> float:  # the others arrive while the first prefills: admitted once its pages are cached
        s = planner(2048, 32)
        prefix = prompt(1024, run)
        add(s, 0, prefix + [200 + j for j in range(64)])
        return steps(s, 3, lambda s: [add(s, i, prefix + [200 + (i * 37 + j) % 40000 for j in range(64)])
                                      for i in range(1, 32)])

    cases = {"one 512-token prompt": whole(512), "one 2,048-token prompt": whole(2048),
             "8 prompts of 128": whole(128, 8), "the 3rd 1,024-token chunk of a 3,072-token prompt": chunked,
             "31 x 64 over a shared 1,024-token prefix": burst}
    out = {}
    for name, case in cases.items():
        case(1000)  # (warm)
        out[name] = [1e3 * case(run) for run in range(args.runs)]
    return out


def main(argv=None) -> int:
    a = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    a.add_argument("--model", default="smollm2-135m-instruct")
    a.add_argument("--threads", type=int, default=2)
    a.add_argument("--runs", type=int, default=3)
    a.add_argument("--rounds", type=int, default=2)
    a.add_argument("--against", default="", metavar="DIR", help="another checkout, alternated with this one")
    a.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a.add_argument("--out", default=str(ROOT / "bench" / "results" / "prefill_step.json"))
    args = a.parse_args(argv)
    if args.child:
        sys.path.insert(0, os.environ.get("PYTHONPATH", str(ROOT)))
        print(json.dumps(measure(args)))
        return 0
    trees = {"this checkout": ROOT, **({args.against: Path(args.against).resolve()} if args.against else {})}
    times: dict[str, dict[str, list[float]]] = {name: {} for name in trees}
    for r in range(args.rounds):
        for name, tree in (list(trees.items()) if r % 2 == 0 else list(trees.items())[::-1]):
            cmd = [sys.executable, str(ROOT / "bench" / "prefill_step.py"), "--child", "--model", args.model,
                   "--threads", str(args.threads), "--runs", str(args.runs)]
            done = subprocess.run(cmd, cwd=tree, env=dict(os.environ, PYTHONPATH=str(tree)), capture_output=True,
                                  text=True)
            if done.returncode:
                raise SystemExit(f"{tree}: {done.stderr[-3000:]}")
            for case, ts in json.loads(done.stdout.strip().splitlines()[-1]).items():
                times[name].setdefault(case, []).extend(ts)
    names = list(trees)
    print(f"\n{args.model}, {args.threads} threads; median ms of {args.rounds} processes x {args.runs} runs a tree\n")
    print("| step | " + " | ".join(names) + (f" | {names[0]} / {names[1]} |" if len(names) > 1 else " |"))
    print("|---|" + "---|" * (len(names) + (len(names) > 1)))
    for case in times[names[0]]:
        meds = [statistics.median(times[n][case]) for n in names]
        ratio = f" {meds[0] / meds[1]:.2f}x |" if len(meds) > 1 else ""
        print(f"| {case} | " + " | ".join(f"{m:.0f}" for m in meds) + f" |{ratio}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"load": os.getloadavg(), "times": times}, indent=1))
    print(f"\nload {os.getloadavg()[0]:.2f}; wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
