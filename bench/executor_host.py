"""The executor's host time per step at N decodes: what the executor does on the CPU around the model's forward.

The real ModelRunner (tiny-llama, torch backend on the CPU, one torch thread) holds ``--requests`` requests that
decode in step (32-token prompts, EOS ignored; the real Scheduler plans, in-process, tests/support/inprocess.py). Over
``--steps`` decode steps the parts are timed, median per step: ``apply`` (the plan checked and committed),
``prepare`` (the forward's inputs built), ``sample`` (tokens drawn, the result filled), and the plan's parse and
the result's serialization, beside the whole step and the model's forward. On a GPU the forward shrinks and these
host parts are what a step costs on top of it; with CUDA graphs ``prepare`` is the graph rows and buffers.

    python bench/executor_host.py                          # -> bench/results/executor_host.json
    python bench/executor_host.py --against /tmp/before    # another checkout, alternating rounds, side by side
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


SAMPLING = {  # --sampling: what every request asks for (scheduler_svc.request.Sampling's fields)
    "greedy": {"temperature": 0.0},
    "temperature": {"temperature": 0.8},
    "top-p": {"temperature": 0.8, "top_p": 0.95},
    "top-k-top-p": {"temperature": 0.8, "top_p": 0.95, "top_k": 50},
    # the logits controls (#31): a checkout without them refuses these (an AttributeError in its child)
    "greedy-penalties": {"temperature": 0.0, "repetition_penalty": 1.1, "frequency_penalty": 0.5,
                         "presence_penalty": 0.5},
    "penalties": {"temperature": 0.8, "repetition_penalty": 1.1, "frequency_penalty": 0.5, "presence_penalty": 0.5},
    "all-controls": {"temperature": 0.8, "top_p": 0.95, "repetition_penalty": 1.1, "frequency_penalty": 0.5,
                     "presence_penalty": 0.5, "min_p": 0.05, "min_tokens": 1 << 20, "min_tokens_stop_ids": [2],
                     "logit_bias": {i: 1.0 for i in range(3, 13)}},
    # log-probabilities (#31): the sampled token's, and with its 5 or 20 most likely (a checkout without top_logprobs
    # refuses the last two)
    "logprobs": {"temperature": 0.0, "logprobs": True},
    "top-5": {"temperature": 0.0, "logprobs": True, "top_logprobs": 5},
    "top-20": {"temperature": 0.8, "logprobs": True, "top_logprobs": 20},
}


def measure(n: int, steps: int, sampling: str = "greedy") -> dict[str, float]:
    import torch

    torch.set_num_threads(1)
    from pagedkv.executor.v1 import executor_pb2 as pb
    from pagedkv.models import resolve_model
    from tests.support.fake_executor import make_request
    from tests.support.inprocess import InProcessServer

    server = InProcessServer(resolve_model("tiny-llama"), num_pages=n * 4 + 64, max_num_seqs=n,
                             max_num_batched_tokens=4096)
    runner, scheduler = server.runner, server.scheduler
    for i in range(n):
        req = make_request(i, 0, 1 << 20, prompt=[1] + [3 + (i * 7 + j) % 250 for j in range(31)])
        req.sampling.ignore_eos = True
        for name, value in SAMPLING[sampling].items():
            setattr(req.sampling, name, value)
        req.sampling.seed = i
        scheduler.add(req)
    while True:  # to the steady decode: every request in plan.decodes
        plan, _ = scheduler.schedule()
        scheduler.process(runner.step(plan))
        if len(plan.decodes) == n:
            break
    try:
        from pagedkv.runtime import settle_gc
        settle_gc()
    except ImportError:  # (an older checkout: what its services did)
        import gc
        gc.collect()
        gc.freeze()
    parts: dict[str, list[float]] = {k: [] for k in ("apply", "prepare", "sample", "parse", "serialize", "step",
                                                     "forward")}

    def timed(name, f):
        def wrapper(*a, **kw):
            t = time.perf_counter()
            out = f(*a, **kw)
            parts[name].append(time.perf_counter() - t)
            return out
        return wrapper
    if hasattr(runner, "mirror"):  # (the plan check: RequestMirror.apply; runner._apply before #30)
        runner.mirror.apply = timed("apply", runner.mirror.apply)
    else:
        runner._apply = timed("apply", runner._apply)
    runner._build_batch = timed("prepare", runner._build_batch)
    runner._sample = timed("sample", runner._sample)
    decodes = 0
    for _ in range(steps):
        plan, _ = scheduler.schedule()
        decodes += len(plan.decodes)
        data = plan.SerializeToString()
        t = time.perf_counter()
        plan = pb.StepPlan.FromString(data)
        parts["parse"].append(time.perf_counter() - t)
        t = time.perf_counter()
        result = runner.step(plan)
        parts["step"].append(time.perf_counter() - t)
        t = time.perf_counter()
        result.SerializeToString()
        parts["serialize"].append(time.perf_counter() - t)
        prepare = getattr(result.timings, "prepare_ms", 0.0)  # (older checkouts timed it inside forward_ms)
        parts["forward"].append((result.timings.forward_ms - (0.0 if prepare else 1e3 * parts["prepare"][-1])) / 1e3)
        scheduler.process(result)
    out = {k: 1e3 * statistics.median(v) for k, v in parts.items()}
    out["host"] = out["apply"] + out["prepare"] + out["sample"] + out["parse"] + out["serialize"]
    out["decodes_per_step"] = decodes / steps
    return out


def child(args) -> int:
    print(json.dumps({n: measure(n, args.steps, args.sampling) for n in args.counts}))
    return 0


def run_tree(tree: Path, args) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree))
    cmd = [sys.executable, str(ROOT / "bench" / "executor_host.py"), "--child", "--steps", str(args.steps),
           "--requests", ",".join(map(str, args.counts)), "--sampling", args.sampling]
    out = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, check=True)
    return {int(k): v for k, v in json.loads(out.stdout.strip().splitlines()[-1]).items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", default="256,1024", help="decodes per step to measure at")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--against", default="", metavar="DIR", help="another checkout, measured alternately")
    p.add_argument("--rounds", type=int, default=3, help="with --against: rounds per tree (medians reported)")
    p.add_argument("--sampling", choices=list(SAMPLING), default="greedy",
                   help="what every request samples with (temperature 0.8; top-p 0.95; top-k 50; the penalties: "
                   "repetition 1.1, frequency and presence 0.5; all-controls: those, min_p 0.05, min_tokens, "
                   "10 logit_bias entries; logprobs: the sampled token's log-probability; top-5, top-20: and its 5 "
                   "or 20 most likely tokens, greedy or at temperature 0.8)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "executor_host.json"))
    args = p.parse_args(argv)
    args.counts = [int(c) for c in args.requests.split(",")]
    if args.child:
        sys.path.insert(0, os.environ.get("PYTHONPATH", str(ROOT)))
        return child(args)
    trees = {"this checkout": ROOT, **({f"against {args.against}": Path(args.against).resolve()}
                                       if args.against else {})}
    runs: dict[str, list[dict]] = {name: [] for name in trees}
    for _ in range(args.rounds if args.against else 1):
        for name, tree in trees.items():
            runs[name].append(run_tree(tree, args))
    keys = ("apply", "prepare", "sample", "parse", "serialize", "host", "forward", "step")
    table = {name: {n: {k: statistics.median(r[n][k] for r in rs) for k in keys} for n in args.counts}
             for name, rs in runs.items()}
    print(f"\nexecutor host time per step (tiny-llama, CPU, 1 torch thread, sampling {args.sampling}; ms, medians "
          f"of {args.steps} steps"
          f"{f', then of {args.rounds} rounds' if args.against else ''}; load {os.getloadavg()[0]:.2f})\n")
    print("| tree | decodes | apply | prepare | sample | parse | serialize | host total | forward | step |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, by_n in table.items():
        for n, r in by_n.items():
            print(f"| {name} | {n} | " + " | ".join(f"{r[k]:.3f}" for k in keys) + " |")
    if args.against:
        mine, other = table.values()
        for n in args.counts:
            print(f"decodes {n}: host {mine[n]['host'] / other[n]['host']:.2f}x (this checkout / the other)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"config": vars(args), "cpus": os.cpu_count(), "trees": table}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
