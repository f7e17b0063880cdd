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

from pagedkv import grpc_common  # noqa: E402
from pagedkv.executor.v1 import executor_pb2 as pb  # noqa: E402
from pagedkv.executor.v1 import executor_pb2_grpc as pb_grpc  # noqa: E402
from pagedkv.local_server import TEST_EXECUTOR_SECRET, ServiceProcess  # noqa: E402
from pagedkv.wire import EXECUTOR_PROTOCOL  # noqa: E402
from scheduler_svc.detokenizer import IncrementalDetokenizer  # noqa: E402
from scheduler_svc.executor_client import ExecutorClient, ExecutorLink  # noqa: E402
from scheduler_svc.outputs import deliver  # noqa: E402
from scheduler_svc.pages import PagePool  # noqa: E402
from scheduler_svc.request import Request, Sampling  # noqa: E402
from scheduler_svc.scheduler import Scheduler, SchedulerConfig  # noqa: E402
from scheduler_svc.step_stream import StepStream  # noqa: E402

BLOCK = 16
PROMPT = 32


class _NullTokenizer:
    def decode(self, ids, **_kw) -> str:
        return ""

    def convert_ids_to_tokens(self, ids):
        return [""] * len(ids)


TOKENIZER = None  # --tokenizer: a real one (detokenizing costs), else _NullTokenizer (decodes nothing)
TEXT_IDS: list[int] = []  # --text: the sampled tokens follow these ids (else every sampled token is 7)
TEXT = ("The quick brown fox jumps over the lazy dog; naïve café, déjà vu, Straße, smörgåsbord. "
        "東京の天気は晴れです。你好，世界！서울 날씨 🎉🚀 — “quotes” and ‘more’ … ¿qué tal? Ünïcödé 123.\n")


SENTENCEPIECE_WORD = "▁the"  # what every request samples with --tokenizer sentencepiece and no --text


def build_sentencepiece_tokenizer(out_dir: Path) -> Path:
    """A Llama-2-style tokenizer for ``--tokenizer sentencepiece``: a unigram vocabulary of ▁-words (TEXT's and
    some common ones), single characters and 256 byte-fallback tokens, with Llama 2's decoder (spaces as ▁, byte
    fallback, one leading space stripped). Saved as a checkpoint's tokenizer files are."""
    import re

    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    words = set(re.findall(r"[A-Za-z]+", TEXT)) | {"the", "of", "and", "to", "in", "is", "that", "for", "it", "on"}
    chars = {c for c in TEXT if ord(c) < 0x250 and not c.isspace()}  # (CJK, Hangul, emoji: byte fallback)
    pieces = [("<unk>", 0.0), ("<s>", 0.0), ("</s>", 0.0), *[(f"<0x{b:02X}>", -20.0) for b in range(256)], ("▁", -3.0)]
    pieces += [(c, -6.0) for c in sorted(chars)]
    pieces += [(f"▁{w}", -2.0) for w in sorted(words)]
    tok = Tokenizer(models.Unigram(pieces, unk_id=0, byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(str(out_dir))
    return out_dir


def load_text_ids(tokenizer) -> list[int]:
    return tokenizer(TEXT, add_special_tokens=False)["input_ids"]


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


def _result_for(plan: pb.StepPlan, known: dict[str, list[int]]) -> pb.StepResult:
    """What a model would answer, without the model: one token for every request that caught up."""
    result = pb.StepResult(step_id=plan.step_id)
    for rid in plan.forget:
        known.pop(rid, None)
    for new in plan.new_requests:
        known[new.request_id] = [len(new.token_ids), new.num_computed_tokens]
    sampled = []
    items = [(r.request_id, r.num_scheduled_tokens) for r in plan.new_requests]
    items += [(c.request_id, c.num_scheduled_tokens) for c in plan.continuing]
    for row, (rid, n) in enumerate(items):
        total, done = known[rid]
        done += n
        if done == total:
            total += 1
            sampled.append(row)
        known[rid] = [total, done]
    for row, rid in enumerate(plan.decodes, len(items)):  # caught up by definition: one more token
        st = known[rid]
        st[0] += 1
        st[1] += 1
        sampled.append(row)
    result.num_computed_tokens = sum(n for _, n in items) + len(plan.decodes)
    result.sampled_rows.extend(sampled)  # (rows: new_requests, continuing, then decodes)
    result.sampled_token_ids.extend([7] * len(sampled))
    result.sampled_logprobs.extend([0.0] * len(sampled))
    return result


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


# ---- the no-op executor ------------------------------------------------------------------------------
class NoopExecutor(pb_grpc.ExecutorServicer):
    def __init__(self, num_pages: int) -> None:
        self.describe = pb.DescribeResponse(model="noop", protocol=EXECUTOR_PROTOCOL,
                                            num_device_pages=num_pages, block_size=BLOCK,
                                            vocab_size=259, max_position_embeddings=1 << 20, executor_id="noop")

    async def Describe(self, request, context):  # noqa: N802
        return self.describe

    async def Run(self, request_iterator, context):  # noqa: N802
        known: dict[str, list[int]] = {}
        async for plan in request_iterator:
            yield _result_for(plan, known)


async def serve_noop(port: int, num_pages: int) -> None:
    server = grpc_common.new_server()
    pb_grpc.add_ExecutorServicer_to_server(NoopExecutor(num_pages), server)
    health = grpc_common.add_health_and_reflection(server, [pb.DESCRIPTOR.services_by_name["Executor"].full_name])
    grpc_common.bind(server, "127.0.0.1", port)
    await server.start()
    await grpc_common.set_serving(health, [pb.DESCRIPTOR.services_by_name["Executor"].full_name], True)
    print("noop_ready", flush=True)
    await server.wait_for_termination()


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


if __name__ == "__main__":
    sys.exit(main())
