"""Decode steps over a shared prompt prefix, with and without the cascade (issues #28, #46).

SmolLM2 (or ``--model``) on the executor's own build path, in one process with the real Scheduler planning (as
bench/profile_step.py): ``--batch`` requests whose prompts are the same ``--prefix`` tokens followed by
``--suffix`` tokens of their own, so prefix caching maps the prefix to the same pages in every table. Once all of
them decode, ``--steps`` steps run in six modes alternated step by step (one process, the same requests: what the
machine does meanwhile hits all alike): the kernel alone, from the Python loop over the layers and from the one C++
call of executor_svc/model/cpu_decode.cpp; the cascade with its prefix half as one SDPA call over the gathered
prefix (before session 19); the cascade as matrix products, its prefix half ``paged_attention_shared`` merged into
``paged_attention_after`` by log-sum-exp (sessions 19 to #46; from the loop); the cascade as it is served,
``paged_attention_cascade`` (each row the kernel's bits alone: #46), from the loop and from the one call. The table
gives each mode's median step and the attention alone (every ``paged_attention`` / ``paged_attention_cascade`` /
``paged_attention_shared`` / ``paged_attention_after`` call and the cascade's SDPA, timed with ``perf_counter``; not
inside the one call). tests/unit/test_attention_cpu_cascade.py holds the modes to the reference's results,
tests/unit/test_attention_rows_exact.py the cascade's rows to the kernel's bits.

    .venv/bin/python bench/shared_prefix_step.py [--batch 32] [--prefix 1024] [--suffix 64] [--steps 40]
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
    a.add_argument("--steps", type=int, default=40)
    a.add_argument("--threads", type=int, default=2)
    a.add_argument("--out", default=str(ROOT / "bench" / "results" / "shared_prefix_step.json"))
    args = a.parse_args(argv)

    import torch

    from executor_svc import args as executor_args
    from executor_svc.attention import cascade, torch_backend
    from executor_svc.startup import build
    from pagedkv import logs
    from scheduler_svc.pages import PagePool
    from scheduler_svc.scheduler import Scheduler, SchedulerConfig
    from tests.support.driven import Driven
    from tests.support.fake_executor import make_request

    p = argparse.ArgumentParser()
    executor_args.add_args(p)
    length = args.prefix + args.suffix + args.steps + 16
    pages = args.prefix // 16 + args.batch * (-(-(args.suffix + args.steps + 16) // 16) + 1) + 16
    eargs = p.parse_args(["--model", args.model, "--num-pages", str(pages), "--threads", str(args.threads),
                          "--swap-space", "0"])
    runner, describe = build(eargs, logs.configure("bench", json=True, level="warning"))
    timed: list[float] = []
    by_op: dict[str, list[float]] = {}
    ops = torch.ops.pagedkv_cpu
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu

    class Timed:  # the attention's calls, timed (perf_counter; CPU ops are synchronous)
        def __init__(self, fn) -> None:
            self.fn = fn

        def __call__(self, *a, **k):
            t = time.perf_counter()
            out = self.fn(*a, **k)
            timed.append(time.perf_counter() - t)
            by_op.setdefault(str(self.fn), []).append(timed[-1])
            return out

    class Kernel:  # torch.ops.pagedkv_cpu with the attention's ops timed
        paged_attention = Timed(ops.paged_attention)
        paged_attention_after = Timed(ops.paged_attention_after)
        paged_attention_shared = Timed(ops.paged_attention_shared)
        exact_cascade = Timed(ops.paged_attention_cascade)
        paged_attention_cascade = exact_cascade

        @staticmethod
        def products(q, k_cache, v_cache, tables, q_pos, pages, scale):  # (the cascade before #46)
            prior, lse = Kernel.paged_attention_shared(q, k_cache, v_cache, pages, scale)
            return Kernel.paged_attention_after(q, k_cache, v_cache, tables, q_pos, pages.numel() * k_cache.shape[1],
                                                prior, lse, scale)

        def __getattr__(self, name):
            return getattr(ops, name)

    kernel = Kernel()
    torch_backend.cpu_kernel.load = lambda: kernel  # (the backend asks for the kernel on every call)
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu = Timed(flash)

    sched = Driven(Scheduler(PagePool(runner.num_pages, runner.block_size),
                             SchedulerConfig(max_num_seqs=args.batch, max_num_batched_tokens=2048,
                                             max_model_len=length, watermark=0.0),
                             list(describe.eos_token_ids)))
    prefix = [1] + [100 + (j * 7) % 40000 for j in range(args.prefix - 1)]
    for i in range(args.batch):
        req = make_request(i, 0, args.steps + 8,
                           prompt=prefix + [200 + (i * 37 + j) % 40000 for j in range(args.suffix)])
        req.sampling.ignore_eos = True
        sched.add(req)
    while True:
        plan, _ = sched.schedule()
        sched.process(runner.step(plan))
        if len(plan.decodes) == args.batch:
            break
    rows = cascade.CASCADE_MIN_ROWS
    modes = ("kernel alone", "kernel alone, one call", "cascade, SDPA prefix", "cascade, products", "cascade",
             "cascade, one call")
    in_kernel = cascade.shared_in_kernel
    steps: dict[str, list[float]] = {m: [] for m in modes}
    attention: dict[str, list[float]] = {m: [] for m in modes}
    model = runner.model
    by_op.clear()  # (the prefills' calls above)
    for k in range(args.steps):
        mode = modes[k % len(modes)]
        cascade.CASCADE_MIN_ROWS = rows if mode.startswith("cascade") else 1 << 30
        cascade.shared_in_kernel = (lambda kernel, q: False) if mode.endswith("SDPA prefix") else in_kernel
        products = mode.endswith("products")
        Kernel.paged_attention_cascade = staticmethod(Kernel.products) if products else Kernel.exact_cascade
        # (the one call, executor_svc/model/cpu_decode.cpp, runs the kernel from C++: its attention is not timed)
        model.decode_in_one_call = mode.endswith("one call")
        plan, _ = sched.schedule()
        timed.clear()
        t = time.perf_counter()
        result = runner.step(plan)
        steps[mode].append(time.perf_counter() - t)
        attention[mode].append(sum(timed))
        sched.process(result)
    cascade.CASCADE_MIN_ROWS = rows
    cascade.shared_in_kernel = in_kernel
    Kernel.paged_attention_cascade = Kernel.exact_cascade
    model.decode_in_one_call = True
    out = {"model": args.model, "batch": args.batch, "prefix": args.prefix, "suffix": args.suffix,
           "threads": args.threads, "load": os.getloadavg()[0], "modes": {}}
    print(f"\n{args.model}: {args.batch} decodes over a shared {args.prefix}-token prefix + {args.suffix} of their "
          f"own, {args.threads} threads, {args.steps} steps alternated\n")
    print("| mode | step ms (median) | attention ms a step (30 layers) |")
    print("|---|---|---|")
    for mode in steps:
        s, att = 1e3 * statistics.median(steps[mode]), 1e3 * statistics.median(attention[mode])
        out["modes"][mode] = {"step_ms": s, "attention_ms": att}
        print(f"| {mode} | {s:.1f} | {'(in the call)' if mode.endswith('one call') else f'{att:.1f}'} |")
    print("\n| op (every mode's calls) | calls | median ms a call |\n|---|---|---|")
    for name, ts in by_op.items():
        print(f"| {name} | {len(ts)} | {1e3 * statistics.median(ts):.3f} |")
        out.setdefault("ops", {})[name] = {"calls": len(ts), "median_ms": 1e3 * statistics.median(ts)}
    print(f"\nload {out['load']:.2f}")
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
