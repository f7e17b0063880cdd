"""The CPU decode attention inside a real decode step against the same call alone (issue #28).

SmolLM2 (or ``--model``) on the executor's own build path, ``--batch`` requests with ``--prompt-len``-token prompts
planned by the real Scheduler, as bench/profile_step.py. Every ``torch.ops.pagedkv_cpu.paged_attention`` call of the
steady decode steps is timed with ``perf_counter`` (no profiler). Then the arguments of one step's calls are replayed
alone: each layer's call repeated (its K/V hot in the caches), and each after a 128 MiB write that evicts the caches
(cold).

    .venv/bin/python bench/attention_in_step.py [--batch 32] [--steps 16] [--prompt-len 128]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


class TimedKernel:
    """``torch.ops.pagedkv_cpu`` with paged_attention timed and its arguments kept (the last step's)."""

    def __init__(self, ops) -> None:
        self.ops = ops
        self.calls: list[float] = []
        self.args: list[tuple] = []

    def __getattr__(self, name: str):
        return getattr(self.ops, name)

    def paged_attention(self, *args):
        t = time.perf_counter()
        out = self.ops.paged_attention(*args)
        self.calls.append(time.perf_counter() - t)
        self.args.append(args)
        return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeat", type=int, default=9, help="isolated replays of each layer's call")
    args = p.parse_args()

    from executor_svc import args as executor_args
    from executor_svc.attention import cpu_kernel
    from executor_svc.startup import build
    from pagedkv import logs
    from scheduler_svc.pages import PagePool
    from scheduler_svc.scheduler import Scheduler, SchedulerConfig
    from tests.support.driven import Driven
    from tests.support.fake_executor import make_request

    ep = argparse.ArgumentParser()
    executor_args.add_args(ep)
    pages_per = -(-(args.prompt_len + args.steps + 8) // 16)
    eargs = ep.parse_args(["--model", args.model, "--num-pages", str(args.batch * pages_per + 8),
                           "--threads", str(args.threads), "--swap-space", "0"])
    runner, describe = build(eargs, logs.configure("probe", json=True, level="warning"))
    timed = TimedKernel(cpu_kernel.load())
    cpu_kernel._state["module"] = timed  # what the backend's load() returns from now on
    sched = Driven(Scheduler(PagePool(runner.num_pages, runner.block_size),
                             SchedulerConfig(max_num_seqs=args.batch, max_num_batched_tokens=max(2048, args.prompt_len),
                                             max_model_len=args.prompt_len + args.steps + 16, watermark=0.0),
                             list(describe.eos_token_ids)))
    for i in range(args.batch):
        req = make_request(i, 0, args.steps + 8, prompt=[1] + [100 + (i * 37 + j) % 40000
                                                               for j in range(args.prompt_len - 1)])
        req.sampling.ignore_eos = True
        sched.add(req)
    while True:
        plan, _ = sched.schedule()
        sched.process(runner.step(plan))
        if len(plan.decodes) == args.batch:
            break
    step_ms, attn_ms, per_layer = [], [], []
    for _ in range(args.steps):
        plan, _ = sched.schedule()
        timed.calls.clear()
        timed.args.clear()
        t = time.perf_counter()
        result = runner.step(plan)
        step_ms.append((time.perf_counter() - t) * 1e3)
        attn_ms.append(sum(timed.calls) * 1e3)
        per_layer.append(list(timed.calls))
        sched.process(result)
    layers = len(timed.args)
    print(f"load {os.getloadavg()[0]:.2f}; {args.model}, batch {args.batch}, {layers} attention calls a step, "
          f"threads {torch.get_num_threads()}")
    print(f"in the step: step {statistics.median(step_ms):.2f} ms, attention {statistics.median(attn_ms):.2f} ms "
          f"({statistics.median(attn_ms) / layers:.3f} ms a call; last step's calls min/median/max "
          f"{min(timed.calls) * 1e3:.3f}/{statistics.median(timed.calls) * 1e3:.3f}/{max(timed.calls) * 1e3:.3f})")
    best = [min(s[i] for s in per_layer) for i in range(layers)]
    print(f"in the step, each layer's fastest of {args.steps} steps: {sum(best) * 1e3:.2f} ms "
          f"({statistics.median(best) * 1e3:.3f} ms a call)")
    kernel = timed.ops
    flush = torch.empty(32 << 20, dtype=torch.float32)
    hot, cold = [], []
    for call in timed.args:
        kernel.paged_attention(*call)
        runs = []
        for _ in range(args.repeat):
            t = time.perf_counter()
            kernel.paged_attention(*call)
            runs.append(time.perf_counter() - t)
        hot.append(min(runs))
        runs = []
        for _ in range(args.repeat):
            flush.fill_(1.0)
            t = time.perf_counter()
            kernel.paged_attention(*call)
            runs.append(time.perf_counter() - t)
        cold.append(min(runs))
    for name, times in (("hot", hot), ("cold", cold)):
        print(f"alone, {name} (fastest of --repeat): {sum(times) * 1e3:.2f} ms for {layers} calls "
              f"({statistics.median(times) * 1e3:.3f} ms a call)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
