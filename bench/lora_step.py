"""One step's forward with LoRA adapters against the same step on the base model (#52), in process, on the
executor's own path (``executor_svc.startup.build`` with ``--lora-modules``: the model, the attention backend and
the adapters' stacks as a server builds them).

``--rows`` requests of ``--context``-token prompts are spread round-robin over ``--adapters`` PEFT adapters
(bench/lora.py's ``make_adapters``: rank ``--rank`` on q/k/v/o/gate/up/down, built once) and prefilled; then three
steps are timed, each over one batch (ids, positions, pages) run with and without the adapters:

    decode    one decode row per request
    mixed     those decodes and one new prompt of ``--context`` tokens (the first adapter's)
    prefill   ``--adapters`` new prompts of ``--context`` tokens, one per adapter (a first step of the load)

Arms, run alternately ``--repeats`` times each (a prefill step a quarter as often), after a throw-away run each:
``base`` (no LoraBatch: the model as a base server runs it, decode_layers' one call included), ``base, layer loop``
(decode only: the base model through the Python layer loop that a step with adapter rows takes), ``adapters``
(``lora_batch`` + forward) and, with ``--against REV``, ``adapters @ REV``: executor_svc/lora/batch.py of git
revision REV (or a file) loaded beside this tree's, with the largest |logit difference| from this tree's. Medians;
ratios in tok/s, arm over base (= base ms / arm ms). The load average before and after is recorded: other work on
the machine moves these timings by 2x.

    python bench/lora_step.py --model smollm2 --against HEAD~1       # -> bench/results/lora_step.json
    python bench/lora_step.py --model tiny-llama --repeats 5 --profile
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from common import print_table, write_report  # noqa: E402

MODELS = {"smollm2": "smollm2-135m-instruct", "tiny-llama": "tiny-llama"}
LOOP = "base, layer loop"  # the arm of the base model without decode_layers' one call


def batch_module(rev: str):
    """executor_svc/lora/batch.py as of git revision ``rev`` (or the file ``rev``), imported as a module of its
    own."""
    text = Path(rev).read_text() if Path(rev).is_file() else subprocess.run(
        ["git", "show", f"{rev}:executor_svc/lora/batch.py"], cwd=ROOT, check=True, capture_output=True,
        text=True).stdout
    path = Path(tempfile.mkdtemp()) / "lora_batch_before.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location("lora_batch_before", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # (its dataclasses look their module up)
    spec.loader.exec_module(mod)
    return mod


def build_runner(args, adapters: dict[str, Path]):
    from executor_svc import args as executor_args
    from executor_svc.startup import build
    from pagedkv import logs

    p = argparse.ArgumentParser()
    executor_args.add_args(p)
    pages = (args.rows + 2 * args.adapters + 8) * -(-(args.context + 32) // 16) + 64 * args.adapters
    eargs = p.parse_args(["--model", MODELS[args.model], "--num-pages", str(pages), "--threads", str(args.threads),
                          "--swap-space", "0", "--max-lora-rank", str(args.rank),
                          "--lora-modules", *[f"{n}={d}" for n, d in adapters.items()]])
    return build(eargs, logs.configure("lora_step", json=True, level="warning"))[0]


class Planner:
    """Step plans written by hand for one runner: each new request gets pages for its prompt and 16 tokens more."""

    def __init__(self, runner, adapters: list[str]) -> None:
        self.runner, self.adapters = runner, adapters
        self.vocab = runner.model.cfg.vocab_size
        self.page, self.next_id = 1, 0

    def new(self, plan, n: int, adapter: str) -> str:
        pages = -(-(n + 16) // self.runner.block_size)
        rid, self.next_id = self.next_id, self.next_id + 1
        prompt = [100 + (rid * 131 + j * 7) % (self.vocab - 200) for j in range(n)]
        plan.new_requests.add(request_id=str(rid), token_ids=prompt, num_scheduled_tokens=n,
                              page_ids=list(range(self.page, self.page + pages)), adapter=adapter)
        self.page += pages
        return str(rid)

    def batches(self, rows: int, context: int) -> dict[str, tuple]:
        """kind -> (scheduled items, ids, positions, meta, logits rows) of the steps timed, after ``rows`` requests
        are prefilled (2048 tokens a step at most, as the scheduler's default budget)."""
        from pagedkv.executor.v1 import executor_pb2 as pb

        ids = []
        per_step = max(1, 2048 // context)
        for start in range(0, rows, per_step):
            plan = pb.StepPlan(step_id=start)
            ids += [self.new(plan, context, self.adapters[i % len(self.adapters)])
                    for i in range(start, min(rows, start + per_step))]
            result = self.runner.step(plan)
            assert not result.error, result.error
        plan = pb.StepPlan(step_id=10_000)
        for rid in ids:
            plan.continuing.add(request_id=rid, num_scheduled_tokens=1)
        decode = self.runner.mirror.apply(plan)
        plan = pb.StepPlan(step_id=10_001)
        self.new(plan, context, self.adapters[0])
        one_prompt = self.runner.mirror.apply(plan)
        plan = pb.StepPlan(step_id=10_002)
        for name in self.adapters:
            self.new(plan, context, name)
        prompts = self.runner.mirror.apply(plan)
        return {kind: (items, *self.runner._build_batch(items))
                for kind, items in (("decode", decode), ("mixed", decode + one_prompt), ("prefill", prompts))}


def forward(runner, impl, batch) -> tuple[float, object]:
    """Seconds of one step's LoraBatch (``impl``'s lora_batch; None or LOOP: the base model) and forward, and its
    logits."""
    from executor_svc.lora.batch import step_row_slots

    items, ids, positions, meta, rows = batch
    runner.model.decode_in_one_call = impl is not LOOP
    t = time.perf_counter()
    lora = None if impl in (None, LOOP) else impl.lora_batch(runner.lora, step_row_slots(
        [(i.count, i.state.adapter) for i in items]), runner.device)
    logits = runner.model.forward(ids, positions, meta, runner.pool, runner.attention, rows, lora)
    elapsed = time.perf_counter() - t
    runner.model.decode_in_one_call = True
    return elapsed, logits


def time_step(runner, arms: dict, batch, repeats: int) -> dict:
    """One step's medians per arm, the arms alternating (after a throw-away run each), and the logits' differences:
    the adapters' from the base model's and, with a revision to compare, from that revision's."""
    logits = {arm: forward(runner, impl, batch)[1] for arm, impl in arms.items()}
    times: dict[str, list[float]] = {a: [] for a in arms}
    for r in range(repeats):
        for arm in (list(arms) if r % 2 == 0 else list(arms)[::-1]):
            times[arm].append(forward(runner, arms[arm], batch)[0])
    row = {"tokens": int(batch[1].numel()), "ms": {a: 1e3 * statistics.median(t) for a, t in times.items()},
           "runs_ms": {a: [1e3 * x for x in t] for a, t in times.items()}}
    row["tok_s_over_base"] = {a: row["ms"]["base"] / row["ms"][a] for a in arms if a != "base"}
    row["max_abs_adapters_vs_base"] = float((logits["adapters"] - logits["base"]).abs().max())
    before = [a for a in arms if a.startswith("adapters @")]
    if before:
        row["max_abs_diff_vs_before"] = float((logits["adapters"] - logits[before[0]]).abs().max())
    return row


def measure(args) -> dict:
    import torch
    from e2e_peers import model_dir
    from lora import make_adapters

    import executor_svc.lora.batch as current

    base = model_dir(MODELS[args.model])
    adapters = make_adapters(MODELS[args.model], base, args.rank, args.adapters)
    runner = build_runner(args, adapters)
    arms = {"base": None, LOOP: LOOP, "adapters": current}
    if args.against:
        arms[f"adapters @ {args.against}"] = batch_module(args.against)
    report: dict = {"config": {k: str(v) for k, v in vars(args).items()}, "threads": torch.get_num_threads(),
                    "load_avg_before": os.getloadavg(), "steps": {}}
    batches = Planner(runner, list(adapters)).batches(args.rows, args.context)
    for kind, batch in batches.items():
        here = {a: v for a, v in arms.items() if v is not LOOP or kind == "decode"}
        row = time_step(runner, here, batch, args.repeats if kind != "prefill" else max(2, args.repeats // 4))
        report["steps"][kind] = row
        print(f"  {kind}: " + ", ".join(f"{a} {ms:.1f} ms" for a, ms in row["ms"].items()), flush=True)
    report["load_avg_after"] = os.getloadavg()
    if args.profile:
        report["profile"] = {kind: profile(runner, current, batch, kind) for kind, batch in batches.items()}
    return report


def profile(runner, impl, batch, kind: str) -> list:
    """The adapters' step under torch.profiler: the top ops by self CPU time."""
    import torch

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        forward(runner, impl, batch)
    top = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:12]
    print(f"\nadapters' {kind} step, top ops by self CPU time:")
    for e in top:
        print(f"  {e.key:<40} {e.self_cpu_time_total / 1e3:8.2f} ms  x{e.count}")
    return [(e.key, e.self_cpu_time_total / 1e3, e.count) for e in top]


def table(report: dict) -> None:
    arms = list(dict.fromkeys(a for row in report["steps"].values() for a in row["ms"]))
    rows = []
    for kind, row in report["steps"].items():
        ms, ratio = row["ms"], row["tok_s_over_base"]
        rows.append((kind, str(row["tokens"]), *[f"{ms[a]:.1f}" if a in ms else "-" for a in arms],
                     *[f"{ratio[a]:.2f}" if a in ratio else "-" for a in arms if a != "base"]))
    cfg = report["config"]
    print(f"\n{cfg['model']}, {cfg['adapters']} adapters of rank {cfg['rank']}, {cfg['rows']} requests of "
          f"{cfg['context']} tokens, {report['threads']} threads; medians of {cfg['repeats']} (prefill: a quarter); "
          f"load average {report['load_avg_before'][0]:.2f} before, {report['load_avg_after'][0]:.2f} after\n")
    print_table(("step", "tokens", *[f"{a} ms" for a in arms], *[f"tok/s {a} / base" for a in arms if a != "base"]),
                rows)
    if "max_abs_diff_vs_before" in next(iter(report["steps"].values())):
        print("max |logits, this tree - before|: " + ", ".join(
            f"{k} {r['max_abs_diff_vs_before']:.2e}" for k, r in report["steps"].items()))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(MODELS), default="smollm2")
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--rows", type=int, default=32, help="decode rows, round-robin over the adapters (default 32)")
    ap.add_argument("--context", type=int, default=256, help="tokens per prompt (default 256)")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--against", metavar="REV", help="also time executor_svc/lora/batch.py of this git revision "
                                                     "(or this file)")
    ap.add_argument("--profile", action="store_true", help="torch.profiler's top ops of each adapters' step")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "lora_step.json")
    args = ap.parse_args(argv)
    report = measure(args)
    table(report)
    write_report(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
