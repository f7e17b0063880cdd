"""The cost of structured outputs per step: the executor's real ModelRunner (torch backend, CPU) decoding N requests
whose every row follows a JSON schema, against the same N unconstrained, side by side in one process (two runners
over one model, their steps alternated, so both see the same machine load); medians per step and their ratio, at
N = 1, 32 and 256. Then the output tokens per second of a batch half constrained, against the same batch
unconstrained, and the schema's compile time (first, and from the cache).

A row whose grammar completes is given a fresh matcher (every row stays constrained for the whole run). The matchers'
work runs as the executor runs it: jobs on its matcher threads beside the forward (executor_svc/grammar_jobs.py).

    python bench/grammar_step.py                                   # tiny-llama and smollm2-135m-instruct
    python bench/grammar_step.py --models tiny-llama --steps 20    # -> bench/results/grammar_step.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SCHEMA = {"type": "array", "items": {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12}, "kind": {"enum": ["cat", "dog", "bird"]},
    "age": {"type": "integer", "minimum": 0, "maximum": 30},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3}},
    "required": ["name", "kind", "age", "tags"], "additionalProperties": False}}
PROMPT_LEN = 16


def build(path: Path, n: int, steps: int, engine, constrained: set[int]):
    from executor_svc.attention.torch_backend import TorchPagedAttention
    from executor_svc.kv_quant import parse_kv_dtype
    from executor_svc.model_config import ModelConfig
    from executor_svc.pages import DevicePagePool
    from executor_svc.runner import ModelRunner
    from pagedkv.executor.v1 import executor_pb2 as pb

    cfg = ModelConfig.from_dir(path)
    cpu = torch.device("cpu")
    model = build.models.get(str(path))
    if model is None:
        from executor_svc.model import load_model
        model = build.models[str(path)] = load_model(cfg, cpu, torch.float32)
    attention = TorchPagedAttention(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, model.scale)
    block = 16
    per = -(-(PROMPT_LEN + steps + 4) // block)
    pool = DevicePagePool(cfg, n * per + 1, block, torch.float32, cpu, parse_kv_dtype("auto", torch.float32))
    runner = ModelRunner(model, pool, attention, cpu)
    runner.mirror.grammars, runner.matchers = engine, build.matchers
    constraint = pb.Constraint(json_schema=json.dumps(SCHEMA), strict=True, end_token_ids=list(cfg.eos_token_ids))
    engine.submit(constraint).result()  # (compiled before a plan brings it, as the scheduler has it done)
    plan = pb.StepPlan(step_id=0)
    for i in range(n):
        new = plan.new_requests.add(request_id=str(i), token_ids=[1] + [3 + (i * 7 + j) % 200 for j in
                                                                         range(PROMPT_LEN - 1)],
                                    num_scheduled_tokens=PROMPT_LEN, page_ids=range(1 + i * per, 1 + (i + 1) * per),
                                    sampling=pb.SamplingParams(temperature=0.8, seed=i))
        if i in constrained:
            new.constraint.CopyFrom(constraint)
    runner.step(plan)
    return runner, constraint


build.models = {}
build.matchers = None  # (main: the executor's matcher threads, defaults)


def fresh(engine, constraint):
    """A matcher that starts over (a GrammarState as the mirror makes one)."""
    from executor_svc.grammar_jobs import GrammarState

    key, compiled = engine.lookup(constraint)
    return GrammarState(key, compiled, tuple(constraint.end_token_ids), (engine.vocab_size + 31) // 32)


def decode(runner, constraint, engine, step_id: int) -> float:
    """One decode step of every request; ms (the executor's total)."""
    from pagedkv.executor.v1 import executor_pb2 as pb

    for st in runner.requests.values():  # (a completed grammar starts over: every row stays constrained)
        if st.grammar is not None and st.grammar.terminated:
            st.grammar = fresh(engine, constraint)
    result = runner.step(pb.StepPlan(step_id=step_id, decodes=sorted(runner.requests, key=int)))
    assert not result.error, result.error
    return result.timings.total_ms


def side_by_side(path: Path, n: int, steps: int, engine, constrained_share: float = 1.0) -> dict:
    k = round(n * constrained_share)
    a, c = build(path, n, steps, engine, set(range(k)))
    b, _ = build(path, n, steps, engine, set())
    on, off = [], []
    for s in range(1, steps + 1):
        on.append(decode(a, c, engine, s))
        off.append(decode(b, c, engine, s))
    on_ms, off_ms = statistics.median(on[1:]), statistics.median(off[1:])  # (the first decode warms up)
    return {"requests": n, "constrained": k, "constrained_ms": round(on_ms, 2), "unconstrained_ms": round(off_ms, 2),
            "ratio": round(on_ms / off_ms, 3), "constrained_tok_s": round(n / on_ms * 1e3, 1),
            "unconstrained_tok_s": round(n / off_ms * 1e3, 1)}


def compile_times(engine) -> dict:
    from pagedkv.executor.v1 import executor_pb2 as pb

    c = pb.Constraint(json_schema=json.dumps({**SCHEMA, "minItems": 1}), strict=True)
    t0 = time.perf_counter()
    engine.submit(c).result()
    t1 = time.perf_counter()
    engine.submit(c).result()
    t2 = time.perf_counter()
    return {"compile_first_ms": round((t1 - t0) * 1e3, 2), "compile_cached_ms": round((t2 - t1) * 1e3, 4)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["tiny-llama", "smollm2-135m-instruct"])
    p.add_argument("--sizes", nargs="+", type=int, default=[1, 32, 256])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "grammar_step.json"))
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from executor_svc.grammar import GrammarEngine
    from executor_svc.grammar_jobs import Matchers
    from executor_svc.model_config import ModelConfig
    from pagedkv.models import resolve_model

    report = {"models": {}, "threads": args.threads, "steps": args.steps}
    print(f"{'model':24} {'N':>4} {'constrained':>11} {'ms/step on':>10} {'ms/step off':>11} {'ratio':>6}")
    for name in args.models:
        path = resolve_model(name)
        engine = GrammarEngine(path, ModelConfig.from_dir(path).vocab_size, compile_timeout=60.0, compile_workers=0)
        build.matchers = Matchers()
        entry = {"compile": compile_times(engine), "steps": [], "half_constrained": None}
        for n in args.sizes:
            row = side_by_side(path, n, args.steps, engine)
            entry["steps"].append(row)
            print(f"{name:24} {n:>4} {row['constrained']:>11} {row['constrained_ms']:>10} "
                  f"{row['unconstrained_ms']:>11} {row['ratio']:>6}")
        half = side_by_side(path, max(args.sizes), args.steps, engine, 0.5)
        entry["half_constrained"] = half
        print(f"{name:24} {half['requests']:>4} {half['constrained']:>11} {half['constrained_ms']:>10} "
              f"{half['unconstrained_ms']:>11} {half['ratio']:>6}   (half constrained: "
              f"{half['constrained_tok_s']} vs {half['unconstrained_tok_s']} output tok/s)")
        print(f"{name:24} compile: first {entry['compile']['compile_first_ms']} ms, cached "
              f"{entry['compile']['compile_cached_ms']} ms")
        report["models"][name] = entry
        engine.close()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"-> {args.out}")


if __name__ == "__main__":
    main()
