"""Prefill steps whose chunks have cached context before them: SDPA with the context split off and without (issue
#28), and the CPU kernel (issue #46).

SmolLM2 (or ``--model``) on the executor's own build path, in one process with the real Scheduler planning (as
bench/shared_prefix_step.py). Two steps, each run ``--runs`` times per mode, the modes alternated run by run:

* ``shared``: one request prefills ``--prefix`` + ``--suffix`` tokens; ``--batch`` - 1 more with the same prefix
  arrive while it runs and are prefilled in one step, each a ``--suffix``-token chunk over the cached prefix (the
  step measured: the burst of bench/e2e_peers.py's shared workload);
* ``chunked``: one ``--prompt``-token prompt under a ``--chunk``-token budget; its third chunk is measured (over
  2 x ``--chunk`` tokens of its own context).

Modes: ``masked`` is one SDPA per chunk over its whole gathered context with a [q_len, ctx] mask (the path before
``split_prefills``; forced by raising ``PREFILL_SPLIT_MIN_TOKENS``), ``split`` the context's whole pages apart
(shared ones in one SDPA call for every chunk), then the chunk's own keys, merged by log-sum-exp (the path of other
dtypes than float32; before #46 float32's, with the pages' part the kernel library's ``paged_attention_shared``),
``kernel`` each token attended by the CPU kernel as a decode is, a chunk's tokens in runs that read their keys once
(float32's path since #46: a token's bits do not depend on the chunk).
tests/unit/test_attention_cpu_cascade.py holds the split to the reference's results.

    .venv/bin/python bench/prefill_context_step.py [--runs 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main(argv=None) -> int:
    a = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    a.add_argument("--model", default="smollm2-135m-instruct")
    a.add_argument("--batch", type=int, default=32)
    a.add_argument("--prefix", type=int, default=1024)
    a.add_argument("--suffix", type=int, default=64)
    a.add_argument("--prompt", type=int, default=3072)
    a.add_argument("--chunk", type=int, default=1024)
    a.add_argument("--runs", type=int, default=3)
    a.add_argument("--threads", type=int, default=2)
    a.add_argument("--out", default=str(ROOT / "bench" / "results" / "prefill_context_step.json"))
    args = a.parse_args(argv)

    from executor_svc import args as executor_args
    from executor_svc.attention import cascade
    from executor_svc.startup import build
    from pagedkv import logs
    from scheduler_svc.pages import PagePool
    from scheduler_svc.scheduler import Scheduler, SchedulerConfig
    from tests.support.driven import Driven
    from tests.support.fake_executor import make_request

    p = argparse.ArgumentParser()
    executor_args.add_args(p)
    longest = max(args.prefix + args.suffix, args.prompt) + 16
    pages = (args.prefix + args.batch * (args.suffix + 32)) // 16 + longest // 16 + 32
    eargs = p.parse_args(["--model", args.model, "--num-pages", str(pages), "--threads", str(args.threads),
                          "--swap-space", "0"])
    runner, describe = build(eargs, logs.configure("bench", json=True, level="warning"))
    eos = list(describe.eos_token_ids)
    split_min = cascade.PREFILL_SPLIT_MIN_TOKENS

    def request(i: int, prompt: list[int]):
        req = make_request(i, 0, 4, prompt=prompt)
        req.sampling.ignore_eos = True
        return req

    def shared(run: int) -> float:
        sched = Driven(Scheduler(PagePool(runner.num_pages, runner.block_size),
                                 SchedulerConfig(max_num_seqs=args.batch, max_num_batched_tokens=2048,
                                                 max_model_len=longest, watermark=0.0), eos))
        prefix = [1] + [100 + (j * 7 + run) % 40000 for j in range(args.prefix - 1)]  # (a new prefix each run)
        sched.add(request(0, prefix + [200 + j for j in range(args.suffix)]))
        for k in range(3):
            plan, _ = sched.schedule()
            if k == 1:  # the others arrive while the first prefills: admitted once its pages are cached
                for i in range(1, args.batch):
                    sched.add(request(i, prefix + [200 + (i * 37 + j) % 40000 for j in range(args.suffix)]))
            t = time.perf_counter()
            result = runner.step(plan)
            took = time.perf_counter() - t
            sched.process(result)
        assert len(plan.new_requests) == args.batch - 1, "the measured step is not the burst's chunks"
        return took

    def chunked(run: int) -> float:
        sched = Driven(Scheduler(PagePool(runner.num_pages, runner.block_size),
                                 SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=args.chunk,
                                                 max_model_len=longest, watermark=0.0), eos))
        sched.add(request(0, [1] + [100 + (j * 7 + run) % 40000 for j in range(args.prompt - 1)]))
        for _ in range(3):
            plan, _ = sched.schedule()
            t = time.perf_counter()
            result = runner.step(plan)
            took = time.perf_counter() - t
            sched.process(result)
        return took

    cases = {f"{args.batch - 1} chunks of {args.suffix} over a shared {args.prefix}-token prefix": shared,
             f"the 3rd {args.chunk}-token chunk of a {args.prompt}-token prompt": chunked}
    modes = ("masked", "split", "kernel")
    in_kernel = cascade.prefill_in_kernel
    times: dict[str, dict[str, list[float]]] = {c: {m: [] for m in modes} for c in cases}
    for run in range(len(modes) * args.runs):
        mode = modes[run % len(modes)]
        cascade.PREFILL_SPLIT_MIN_TOKENS = split_min if mode == "split" else 1 << 30
        cascade.prefill_in_kernel = in_kernel if mode == "kernel" else (lambda kernel, q: False)
        for case, fn in cases.items():
            times[case][mode].append(fn(run))
    cascade.PREFILL_SPLIT_MIN_TOKENS = split_min
    cascade.prefill_in_kernel = in_kernel
    out = {"model": args.model, "threads": args.threads, "load": os.getloadavg()[0], "cases": {}}
    print(f"\n{args.model}, {args.threads} threads, {args.runs} runs a mode, alternated (median ms)\n")
    print("| step | masked | split | kernel | kernel / split |")
    print("|---|---|---|---|---|")
    for case in cases:
        m, sp, k = (1e3 * statistics.median(times[case][mode]) for mode in modes)
        out["cases"][case] = {"masked_ms": m, "split_ms": sp, "kernel_ms": k, "runs": times[case]}
        print(f"| {case} | {m:.0f} | {sp:.0f} | {k:.0f} | {k / sp:.2f}x |")
    print(f"\nload {out['load']:.2f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
