"""Where a decode step's time goes, on the executor's own path (``executor_svc.startup.build``: the attention backend
``auto`` picks, the model as served), in one process with the real Scheduler planning.

For each batch size, ``--batch`` requests with ``--prompt-len``-token prompts are prefilled, then ``--steps`` decode
steps run; the table gives the median step (``ModelRunner.step``: plan applied, inputs, forward, sample), the
forward alone, and TPOT against the memory-bandwidth limit (the weights the step reads divided by the read
bandwidth measured here: a torch sum over 256 MiB on the executor's threads, best of 2, after each timed step,
the median of those per batch size: the VM's bandwidth moves by 2x within minutes). ``--profile`` adds a
torch.profiler table of one step's ops by self CPU time, grouped (linear, attention, norm, rotary, activation,
other elementwise, logits, sampler), and the number of ops dispatched per step.

    python bench/profile_step.py --model smollm2-135m-instruct --batch 1,32 --profile
    python bench/profile_step.py --model smollm2-135m-instruct --batch 1 --against /tmp/before
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

GROUPS = (  # (group, substrings of aten op names), first match wins
    ("linear (matmul)", ("addmm", "aten::mm", "aten::linear", "aten::matmul", "aten::bmm", "mkldnn", "onednn",
                         "int4", "_weight_int4")),
    ("attention (paged)", ("paged_attention", "scaled_dot_product", "softmax", "index_select")),
    ("fused layer ops (cpu_ops.cpp)", ("pagedkv_cpu::",)),
    ("embedding", ("embedding",)),
    ("norm (rsqrt, mean, pow)", ("rsqrt", "aten::mean", "aten::pow", "rms_norm")),
    ("rotary (cat, neg, slice)", ("aten::cat", "aten::neg", "aten::slice", "aten::cos", "aten::sin")),
    ("activation", ("silu", "gelu", "relu")),
    ("sampler (argmax, topk)", ("argmax", "topk", "sort", "multinomial")),
    ("copies (to, copy_, contiguous)", ("aten::to", "aten::copy_", "contiguous", "_to_copy", "clone")),
    ("elementwise (mul, add)", ("aten::mul", "aten::add", "aten::sub", "aten::div")),
    ("views (view, split, reshape)", ("view", "split", "reshape", "unsqueeze", "select", "expand", "as_strided",
                                      "narrow", "aten::t", "transpose", "permute", "empty", "detach", "alias")),
)


_PROBE: list = []


def read_bandwidth(threads: int, runs: int = 5) -> float:
    """GB/s of a torch sum over 256 MiB of float32, best of ``runs``."""
    import torch

    torch.set_num_threads(threads)
    if not _PROBE:
        _PROBE.append(torch.ones(64 << 20, dtype=torch.float32))
        _PROBE[0].sum()
    x = _PROBE[0]
    best = float("inf")
    for _ in range(runs):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return x.numel() * 4 / best / 1e9


def group_of(name: str) -> str:
    for group, keys in GROUPS:
        if any(k in name for k in keys):
            return group
    return "other"


def measure(args) -> dict:
    import torch

    from executor_svc import args as executor_args
    from executor_svc.startup import build
    from pagedkv import logs
    from scheduler_svc.pages import PagePool
    from scheduler_svc.scheduler import Scheduler, SchedulerConfig
    from tests.support.driven import Driven
    from tests.support.fake_executor import make_request

    p = argparse.ArgumentParser()
    executor_args.add_args(p)
    batches = [int(b) for b in args.batch.split(",")]
    decode_steps = 2 * args.steps if args.loop else args.steps
    pages_per = -(-(args.prompt_len + decode_steps + 8) // 16)
    eargs = p.parse_args(["--model", args.model, "--num-pages", str(max(batches) * pages_per + 8),
                          "--threads", str(args.threads), "--swap-space", "0", *args.executor_args.split()])
    runner, describe = build(eargs, logs.configure("profile", json=True, level="warning"))
    model = runner.model
    weights = model.weight_bytes()
    # a decode step reads every linear, the head and the norms once, and one row of the embedding table (a head
    # tied in place is the table itself, read whole)
    embed = model.embed.numel() * model.embed.element_size()
    if getattr(model.logits, "weight", None) is model.embed:
        embed = 0
    out: dict = {"model": args.model, "attention_backend": describe.attention_backend, "threads": args.threads,
                 "weight_bytes": weights, "read_bytes": weights["linears"] + weights["other"] - embed,
                 "read_gb_s": read_bandwidth(args.threads), "batches": {}}
    out["read_gb_s"] = max(out["read_gb_s"], read_bandwidth(args.threads))
    for b in batches:
        sched = Driven(Scheduler(PagePool(runner.num_pages, runner.block_size),
                                 SchedulerConfig(max_num_seqs=b, max_num_batched_tokens=max(2048, args.prompt_len),
                                                 max_model_len=args.prompt_len + decode_steps + 16, watermark=0.0),
                                 list(describe.eos_token_ids)))  # planned through its wire, as the engine does
        for i in range(b):
            span = min(40000, describe.vocab_size - 100)  # ids within the vocabulary (tiny-llama has 320)
            req = make_request(i, 0, decode_steps + 8, prompt=[1] + [100 + (i * 37 + j) % span
                                                                   for j in range(args.prompt_len - 1)])
            req.sampling.ignore_eos = True
            sched.add(req)
        while True:  # prefills, to the steady decode
            plan, _ = sched.schedule()
            sched.process(runner.step(plan))
            if len(plan.decodes) == b:
                break
        steps, forwards, probes = [], [], []  # probes: the read bandwidth after each timed step (the VM's moves)
        loop_steps, loop_forwards = [], []  # --loop: the Python loop's steps, alternated with the one call's
        prof = None
        for k in range(decode_steps):
            plan, _ = sched.schedule()
            looped = args.loop and k % 2 == 1
            model.decode_in_one_call = not looped
            if looped:
                t = time.perf_counter()
                result = runner.step(plan)
                loop_steps.append(time.perf_counter() - t)
                loop_forwards.append(result.timings.forward_ms / 1e3)
            elif args.profile and k == args.steps // 2 * (2 if args.loop else 1):  # (not timed)
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                    result = runner.step(plan)
                profiled_ms = result.timings.forward_ms
            else:
                t = time.perf_counter()
                result = runner.step(plan)
                steps.append(time.perf_counter() - t)
                forwards.append(result.timings.forward_ms / 1e3)
                probes.append(read_bandwidth(args.threads, runs=2))
            sched.process(result)
        row = {"step_ms": 1e3 * statistics.median(steps), "forward_ms": 1e3 * statistics.median(forwards),
               "read_gb_s": statistics.median(probes)}
        if loop_steps:
            row["loop_step_ms"] = 1e3 * statistics.median(loop_steps)
            row["loop_forward_ms"] = 1e3 * statistics.median(loop_forwards)
        if prof is not None:
            groups: dict[str, list[float]] = {}
            total_ops = 0
            for ev in prof.key_averages():
                if ev.key.startswith("aten::") or "pagedkv" in ev.key or "mkldnn" in ev.key:
                    g = groups.setdefault(group_of(ev.key), [0.0, 0])
                    g[0] += ev.self_cpu_time_total / 1e3
                    g[1] += ev.count
                    total_ops += ev.count
            row["profile"] = {k: {"self_ms": v[0], "ops": v[1]} for k, v in
                              sorted(groups.items(), key=lambda kv: -kv[1][0])}
            row["ops_per_step"] = total_ops
            top = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:12]
            row["top_ops"] = [(e.key, e.self_cpu_time_total / 1e3, e.count) for e in top]
            row["profiled_step_ms"] = profiled_ms
        out["batches"][b] = row
    return out


def report(runs: dict[str, dict]) -> None:
    any_run = next(iter(runs.values()))
    read = any_run["read_gb_s"]
    step_bytes = any_run["read_bytes"]  # (measure(): what one decode step reads)
    limit_ms = step_bytes / (read * 1e9) * 1e3
    print(f"\n{any_run['model']}: attention {any_run['attention_backend']}, {any_run['threads']} threads; weights "
          f"{step_bytes / 1e6:.0f} MB read per step; read bandwidth at the start {read:.1f} GB/s -> bandwidth "
          f"limit {limit_ms:.1f} ms/step\n")
    print("The limit per row: the median of the bandwidth probes run between that row's steps (best of 2 each).\n")
    print("| tree | batch | step ms | forward ms | read GB/s between steps | limit ms | step / limit | tok/s |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in runs.items():
        for b, row in r["batches"].items():
            row_read = row.get("read_gb_s", read)  # (a tree from before the probes: the run's)
            limit_ms = step_bytes / (row_read * 1e9) * 1e3
            print(f"| {name} | {b} | {row['step_ms']:.1f} | {row['forward_ms']:.1f} | {row_read:.1f} | "
                  f"{limit_ms:.1f} | {row['step_ms'] / limit_ms:.2f}x | {int(b) * 1e3 / row['step_ms']:.0f} |")
            if "loop_step_ms" in row:
                print(f"| {name}, Python loop | {b} | {row['loop_step_ms']:.1f} | {row['loop_forward_ms']:.1f} | "
                      f"{row_read:.1f} | {limit_ms:.1f} | {row['loop_step_ms'] / limit_ms:.2f}x | "
                      f"{int(b) * 1e3 / row['loop_step_ms']:.0f} |")
    for name, r in runs.items():
        for b, row in r["batches"].items():
            if "profile" not in row:
                continue
            print(f"\n{name}, batch {b}: one step under torch.profiler ({row['profiled_step_ms']:.1f} ms forward, "
                  f"{row['ops_per_step']} ops dispatched)\n")
            print("| group | self ms | ops |")
            print("|---|---|---|")
            for g, v in row["profile"].items():
                print(f"| {g} | {v['self_ms']:.2f} | {v['ops']} |")
            print("\ntop ops: " + "; ".join(f"{k} {ms:.2f} ms x{n}" for k, ms, n in row["top_ops"]))


def run_tree(tree: Path, args) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree))
    cmd = [sys.executable, str(ROOT / "bench" / "profile_step.py"), "--child", "--model", args.model, "--batch",
           args.batch, "--steps", str(args.steps), "--prompt-len", str(args.prompt_len), "--threads",
           str(args.threads), "--executor-args", args.executor_args, *(["--profile"] if args.profile else []),
           *(["--loop"] if args.loop else [])]
    done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{tree}: {done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--batch", default="1,32", help="decodes per step")
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--profile", action="store_true", help="a torch.profiler table of one step per batch size")
    p.add_argument("--loop", action="store_true",
                   help="also time the Python loop over the layers (decode_in_one_call off), alternated step by step "
                        "with the one call (executor_svc/model/cpu_decode.cpp)")
    p.add_argument("--executor-args", default="", help="more `pagedkv executor` flags, one string")
    p.add_argument("--against", default="", metavar="DIR", help="another checkout, measured after this one")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "profile_step.json"))
    args = p.parse_args(argv)
    if args.child:
        sys.path.insert(0, os.environ.get("PYTHONPATH", str(ROOT)))
        print(json.dumps(measure(args)))
        return 0
    trees = {"this checkout": ROOT, **({f"{args.against}": Path(args.against).resolve()} if args.against else {})}
    runs = {name: run_tree(tree, args) for name, tree in trees.items()}
    report(runs)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"load": os.getloadavg(), "runs": runs}, indent=1))
    print(f"\nload {os.getloadavg()[0]:.2f}; wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
