"""scheduler_overhead.py ``--against DIR``: planning and processing of this checkout and another, measured in
alternating subprocesses (each tree's own scheduler_overhead.measure_planning), side by side."""

from __future__ import annotations

import json
import os
import platform
import sys
from pathlib import Path

from scheduler_overhead_text import SENTENCEPIECE_WORD, build_sentencepiece_tokenizer

ROOT = Path(__file__).resolve().parent.parent


def compare_trees(args, counts: list[int]) -> int:
    """Planning and processing times of this checkout and of args.against, measured in alternating
    subprocesses (the same machine state for both), medians over args.rounds."""
    import statistics
    import subprocess

    tokenizer = ""
    if args.tokenizer:  # (both trees' new_scheduler build their detokenizers with _NullTokenizer())
        import tempfile

        from pagedkv.models import resolve_model
        path = (build_sentencepiece_tokenizer(Path(tempfile.mkdtemp())) if args.tokenizer == "sentencepiece" else
                resolve_model(args.tokenizer))
        tokenizer = ("from scheduler_svc.tokenizer import load_tokenizer; "
                     f"tok = load_tokenizer({str(path)!r}); "
                     "so._NullTokenizer = lambda: tok; ")
        if args.text:  # (a tree whose bench has no --text fails here rather than measure token 7)
            tokenizer += "so.TEXT_IDS = so.load_text_ids(tok); "
        elif args.tokenizer == "sentencepiece":  # (token 7 is a byte there: every sample a word instead)
            tokenizer += f"so.TEXT_IDS = [tok.backend_tokenizer.token_to_id({SENTENCEPIECE_WORD!r})]; "
    # each tree's collector set-up as its scheduler makes it (pagedkv.runtime.settle_gc, or gc.freeze before it)
    gc_setup = ("import gc; gc.collect(); gc.freeze()\ntry:\n from pagedkv.runtime import settle_gc; settle_gc()\n"
                "except ImportError:\n pass\n")
    # A tree whose bench times Scheduler.process alone gets deliver timed with it and its streams read between
    # steps, as here (TIMES_DELIVER), so both trees are measured alike.
    same_timing = ("if not getattr(so, 'TIMES_DELIVER', False):\n"
                   " from scheduler_svc.outputs import deliver as _deliver\n"
                   " _process, _result, _new, _made = so.Scheduler.process, so._result_for, so.new_scheduler, []\n"
                   " def _timed(self, result):\n  out = _process(self, result); _deliver(out); return out\n"
                   " def _new_scheduler(n):\n  _made.append(_new(n)); return _made[-1]\n"
                   " def _read_then(plan, known):\n"
                   "  for r in _made[-1].running:\n   q = r.queue\n   while not q.empty(): q.get_nowait()\n"
                   "  return _result(plan, known)\n"
                   " so.Scheduler.process, so.new_scheduler, so._result_for = _timed, _new_scheduler, _read_then\n")
    code = ("import json, sys; sys.path[:0] = ['.', 'bench']; import scheduler_overhead as so; " + tokenizer + "\n" +
            gc_setup + same_timing + f"print(json.dumps([so.measure_planning(n, {args.steps}) for n in {counts!r}]))")
    trees = {"this checkout": ROOT, f"against {args.against}": Path(args.against).resolve()}
    runs: dict[str, list] = {name: [] for name in trees}
    for _ in range(args.rounds):
        for name, tree in trees.items():
            out = subprocess.run([sys.executable, "-c", code], cwd=tree, capture_output=True, text=True, check=True)
            runs[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
    keys = ("plan_ms_p50", "plan_ms_p99", "process_ms_p50", "process_ms_p99")
    table = {name: [{k: statistics.median(r[i][k] for r in rs) for k in keys} for i in range(len(counts))]
             for name, rs in runs.items()}
    print(f"\nplanning side by side ({os.cpu_count()} cores; median over {args.rounds} rounds of each run's median "
          "and p99)\n")
    print("| tree | running | plan (ms) | plan p99 | process (ms) | process p99 |")
    print("|---|---|---|---|---|---|")
    for name, rows in table.items():
        for n, r in zip(counts, rows):
            print(f"| {name} | {n} | {r['plan_ms_p50']:.3f} | {r['plan_ms_p99']:.3f} | {r['process_ms_p50']:.3f} | "
                  f"{r['process_ms_p99']:.3f} |")
    mine, other = table.values()
    for n, a, b in zip(counts, mine, other):
        print(f"running {n}: plan {a['plan_ms_p50'] / b['plan_ms_p50']:.2f}x, process "
              f"{a['process_ms_p50'] / b['process_ms_p50']:.2f}x (this checkout / the other)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
                                          "config": vars(args), "counts": counts, "trees": table}, indent=2))
    return 0
