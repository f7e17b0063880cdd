"""Scheduler overhead: planning time per step at 64, 256 and 1,024 running requests, and the step round trip
over gRPC against an executor that runs no model, side by side with a real tiny-llama executor's step.

Planning (in this process, no RPC): ``--requests`` requests of 32-token prompts are admitted and run to
their steady decode (one token per request per step, EOS ignored); then ``--steps`` steps are timed through the
planner's wire (``StepStream``, as the engine drives it): ``next_plan()`` (the plan: ``Scheduler.plan`` and its
encoding) and ``apply()`` (``Scheduler.process``: applying the sampled tokens), median and
p99. Target: planning <= 0.5 ms per step at 256 running (docs/design.md). With ``--tokenizer`` the requests detokenize
with that model's tokenizer as the scheduler loads it (scheduler_svc.tokenizer.load_tokenizer); every sampled token
is then token 7 (one ASCII byte for tiny-llama; ``--tokenizer sentencepiece``, a Llama-2-style tokenizer built here:
the word "▁the"), or with ``--text`` the next token of a mixed English, accented, CJK and emoji text (each request at
its own offset), so that multi-byte characters cost what they cost. Target for
``process`` with tiny-llama's tokenizer (#17): <= 0.3 ms at 256 running, <= 1.2 ms at 1,024. ``process`` is
``StepStream.apply`` and ``outputs.deliver`` (every message on its client stream), with the streams read between
steps (not timed), as a client that keeps up reads them.

Round trip: the same scheduler drives, over a real gRPC Run stream on loopback, (a) a no-op executor (a
process of its own that keeps per-request token counts and answers each plan at once with one token per
caught-up request) and (b) a real ``pagedkv executor`` with tiny-llama on the CPU, one thread. Per step:
the round trip, and for the real executor its own forward time; the scheduler's share of a real step is
(plan + process + no-op round trip) / real step.

    python bench/scheduler_overhead.py           # -> bench/results/scheduler_overhead.json
    python bench/scheduler_overhead.py --quick
    python bench/scheduler_overhead.py --tokenizer tiny-llama --text --planning-only
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# (--against runs ``import scheduler_overhead as so`` in each tree and reads or replaces so.Scheduler,
# so._result_for, so.new_scheduler, so._NullTokenizer, so.TEXT_IDS and so.load_text_ids: they stay names of this
# module, and measure_planning looks them up here)
from scheduler_overhead_compare import compare_trees  # noqa: E402
from scheduler_overhead_noop import BLOCK, _result_for, serve_noop  # noqa: E402
from scheduler_overhead_text import SENTENCEPIECE_WORD, build_sentencepiece_tokenizer, load_text_ids  # noqa: E402

from pagedkv.executor.v1 import executor_pb2 as pb  # noqa: E402
from pagedkv.local_server import TEST_EXECUTOR_SECRET, ServiceProcess  # noqa: E402
from scheduler_svc.detokenizer import IncrementalDetokenizer  # noqa: E402
from scheduler_svc.executor_client import ExecutorClient, ExecutorLink  # noqa: E402
from scheduler_svc.outputs import deliver  # noqa: E402
from scheduler_svc.pages import PagePool  # noqa: E402
from scheduler_svc.request import Request, Sampling  # noqa: E402
from scheduler_svc.scheduler import Scheduler, SchedulerConfig  # noqa: E402
from scheduler_svc.step_stream import StepStream  # noqa: E402

PROMPT = 32


class _NullTokenizer:
    def decode(self, ids, **_kw) -> str:
        return ""

    def convert_ids_to_tokens(self, ids):
        return [""] * len(ids)


TOKENIZER = None  # --tokenizer: a real one (detokenizing costs), else _NullTokenizer (decodes nothing)
TEXT_IDS: list[int] = []  # --text: the sampled tokens follow these ids (else every sampled token is 7)


def follow_text(plan: pb.StepPlan, result: pb.StepResult, positions: dict[str, int]) -> None:
    """Rewrites the sampled tokens: request i's k-th token is TEXT_IDS[(37 * i + k) % len(TEXT_IDS)]."""
    ids = [r.request_id for r in plan.new_requests] + [c.request_id for c in plan.continuing] + list(plan.decodes)
    tokens = []
    for row in result.sampled_rows:
        rid = ids[row]
        k = positions.get(rid)
        if k is None:
            k = 37 * int(rid[1:])
        tokens.append(TEXT_IDS[k % len(TEXT_IDS)])
        positions[rid] = k + 1
    result.sampled_token_ids[:] = tokens


def new_scheduler(n: int, num_pages: int | None = None) -> tuple[Scheduler, StepStream]:
    """A planner with n requests queued, and its wire (what the benchmark drives)."""
    pages = num_pages or n * 24 + 64
    config = SchedulerConfig(max_num_seqs=n, max_num_batched_tokens=max(2048, 2 * n), max_model_len=pages * BLOCK)
    s = Scheduler(PagePool(pages, BLOCK), config, [2])
    for i in range(n):
        prompt = [1] + [3 + (i * 31 + j * 7) % 250 for j in range(PROMPT - 1)]
        s.add(Request(request_id=f"q{i}", prompt_ids=prompt, sampling=Sampling(max_tokens=1 << 20, ignore_eos=True),
                      arrival=i, detokenizer=IncrementalDetokenizer(TOKENIZER or _NullTokenizer(), prompt, [], False)))
    return s, StepStream(s)


def measure_planning(n: int, steps: int) -> dict[str, float]:
    s, w = new_scheduler(n)
    running = s.queues.running
    known: dict[str, list[int]] = {}
    while len(running) < n or any(r.num_uncomputed > 1 for r in running):  # to the steady decode
        plan, _ = w.next_plan()
        w.apply(_result_for(plan, known))
    plan_t, process_t = [], []
    positions: dict[str, int] = {}
    for _ in range(steps):
        t0 = time.perf_counter()
        plan, _ = w.next_plan()
        t1 = time.perf_counter()
        result = _result_for(plan, known)
        if TEXT_IDS:
            follow_text(plan, result, positions)
        read_streams(s)
        t2 = time.perf_counter()
        deliver(w.apply(result))
        t3 = time.perf_counter()
        plan_t.append(t1 - t0)
        process_t.append(t3 - t2)
    w.check_integrity()
    return {"running": n, "plan_ms_p50": _ms(plan_t, 50), "plan_ms_p99": _ms(plan_t, 99),
            "process_ms_p50": _ms(process_t, 50), "process_ms_p99": _ms(process_t, 99),
            "plan_bytes": plan.ByteSize(), "decodes_in_plan": len(plan.decodes)}


# ``process`` is StepStream.apply and outputs.deliver: every message on its client stream, as the engine does it.
TIMES_DELIVER = True


def read_streams(s: Scheduler) -> None:
    """What the streams' readers take between two steps (not timed: a stream that keeps up, one message a token)."""
    for r in s.queues.running:
        q = r.outbox
        while not q.empty():
            q.get_nowait()


def _ms(values: list[float], q: float) -> float:
    xs = sorted(values)
    return xs[min(len(xs) - 1, int(round((len(xs) - 1) * q / 100)))] * 1e3


async def drive(address: str, n: int, steps: int, num_pages: int, secret: str = "") -> dict[str, float]:
    """Runs the scheduler against an executor over gRPC; times the steady-decode steps."""
    print(f"driving {address} with {n} requests", file=sys.stderr, flush=True)
    client = ExecutorClient(address, step_timeout=120, link=ExecutorLink(secret=secret))
    await client.connect(60)
    s, w = new_scheduler(n, num_pages)
    running = s.queues.running
    rtt, forward = [], []
    try:
        while len(running) < n or any(r.num_uncomputed > 1 for r in running):
            plan, _ = w.next_plan()
            w.apply(await client.step(plan))
        for _ in range(steps):
            plan, _ = w.next_plan()
            t0 = time.perf_counter()
            result = await client.step(plan)
            rtt.append(time.perf_counter() - t0)
            forward.append(result.timings.total_ms / 1e3)
            w.apply(result)
    finally:
        await client.close()
    return {"rtt_ms_p50": _ms(rtt, 50), "rtt_ms_p99": _ms(rtt, 99), "executor_ms_p50": _ms(forward, 50)}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", default="64,256,1024", help="running requests to measure at")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--real-steps", type=int, default=30, help="steps timed against the real executor")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--tokenizer", default="", metavar="MODEL",
                   help="detokenize with this model's tokenizer (a built-in name or a directory, e.g. tiny-llama; "
                   "'sentencepiece': a Llama-2-style one built here); default: a tokenizer that decodes nothing "
                   "(the scheduler's own costs alone)")
    p.add_argument("--text", action="store_true",
                   help="with --tokenizer: sampled tokens follow a mixed-language text instead of one ASCII token")
    p.add_argument("--planning-only", action="store_true", help="measure plan and process only (no gRPC part)")
    p.add_argument("--against", default="", metavar="DIR",
                   help="another checkout of pagedkv (e.g. a commit before a refactor): measure planning in both, "
                   "alternating, --rounds times, and print the two side by side (no gRPC part)")
    p.add_argument("--rounds", type=int, default=3, help="with --against: rounds per tree (medians are reported)")
    p.add_argument("--serve-noop", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "scheduler_overhead.json"))
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.serve_noop:
        asyncio.run(serve_noop(args.serve_noop, 1 << 16))
        return 0
    if args.quick:
        args.requests, args.steps, args.real_steps = "64,256", 40, 8
    counts = [int(c) for c in args.requests.split(",")]
    if args.text and not args.tokenizer:
        raise SystemExit("--text needs --tokenizer")
    if args.tokenizer and not args.against:
        global TOKENIZER, TEXT_IDS
        from pagedkv.models import resolve_model
        from scheduler_svc.tokenizer import load_tokenizer

        if args.tokenizer == "sentencepiece":
            import tempfile
            TOKENIZER = load_tokenizer(build_sentencepiece_tokenizer(Path(tempfile.mkdtemp())))
        else:
            TOKENIZER = load_tokenizer(resolve_model(args.tokenizer))
        if args.text:
            TEXT_IDS = load_text_ids(TOKENIZER)
        elif args.tokenizer == "sentencepiece":  # (token 7 is a byte there: every sample a word instead)
            TEXT_IDS = [TOKENIZER.backend_tokenizer.token_to_id(SENTENCEPIECE_WORD)]
    from pagedkv.runtime import settle_gc

    settle_gc()  # as the scheduler does once it has started (scheduler_svc/server.py)
    import subprocess

    if args.against:
        return compare_trees(args, counts)
    planning = [measure_planning(n, args.steps) for n in counts]
    if args.planning_only:
        return print_planning(args, counts, planning)

    from pagedkv.cli import free_port

    port = free_port()
    noop = subprocess.Popen([sys.executable, __file__, "--serve-noop", str(port)], stdout=subprocess.PIPE, text=True)
    assert noop.stdout is not None and noop.stdout.readline().strip() == "noop_ready"
    real = ServiceProcess("executor", "--threads", "1", "--num-pages", str(max(counts) * 24 + 64))
    rows = []
    try:
        for n, plan_row in zip(counts, planning):
            noop_row = asyncio.run(drive(f"127.0.0.1:{port}", n, args.steps, 1 << 16))
            real_row = asyncio.run(drive(real.address, n, args.real_steps, max(counts) * 24 + 64, TEST_EXECUTOR_SECRET))
            overhead = plan_row["plan_ms_p50"] + plan_row["process_ms_p50"] + noop_row["rtt_ms_p50"]
            rows.append({**plan_row, "noop": noop_row, "tiny_llama": real_row,
                         "scheduler_share_of_real_step": overhead / (real_row["rtt_ms_p50"] + plan_row["plan_ms_p50"]
                                                                     + plan_row["process_ms_p50"])})
    finally:
        noop.kill()
        real.kill()
    print(f"\nscheduler overhead ({os.cpu_count()} cores, {platform.python_implementation()} "
          f"{platform.python_version()}); steady decode, block {BLOCK}, median (p99)\n")
    print("| running | plan (ms) | process (ms) | plan bytes | no-op executor round trip (ms) | "
          "tiny-llama step round trip (ms) | its forward+sample (ms) | scheduler share of a real step |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['running']} | {r['plan_ms_p50']:.3f} ({r['plan_ms_p99']:.3f}) | {r['process_ms_p50']:.3f} "
              f"({r['process_ms_p99']:.3f}) | {r['plan_bytes']:,} | {r['noop']['rtt_ms_p50']:.2f} "
              f"({r['noop']['rtt_ms_p99']:.2f}) | {r['tiny_llama']['rtt_ms_p50']:.1f} | "
              f"{r['tiny_llama']['executor_ms_p50']:.1f} | {r['scheduler_share_of_real_step']:.0%} |")
    at256 = next((r for r in rows if r["running"] == 256), None)
    if at256:
        ok = at256["plan_ms_p50"] <= 0.5
        verdict = "met" if ok else "MISSED"
        print(f"\nplanning at 256 running: {at256['plan_ms_p50']:.3f} ms (target <= 0.5 ms: {verdict})")
        if args.tokenizer:
            verdict = "met" if at256["process_ms_p50"] <= 0.3 else "MISSED"
            print(f"processing at 256 running: {at256['process_ms_p50']:.3f} ms (target <= 0.3 ms: {verdict})")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
                                          "config": vars(args), "rows": rows}, indent=2))
    return 0


def print_planning(args, counts: list[int], planning: list[dict]) -> int:
    """--planning-only: the plan and process columns alone."""
    load = Path("/proc/loadavg").read_text().split()[:3] if Path("/proc/loadavg").exists() else []
    print(f"\nplanning ({os.cpu_count()} cores, load {' '.join(load)}; tokenizer {args.tokenizer or 'none'}"
          f"{', text' if args.text else ''}; {args.steps} steps), median (p99)\n")
    print("| running | plan (ms) | process (ms) |")
    print("|---|---|---|")
    for r in planning:
        print(f"| {r['running']} | {r['plan_ms_p50']:.3f} ({r['plan_ms_p99']:.3f}) | {r['process_ms_p50']:.3f} "
              f"({r['process_ms_p99']:.3f}) |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
                                          "config": vars(args), "rows": planning}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
