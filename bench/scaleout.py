"""Scale-out: tokens/s with 1, 2 and 4 executors behind one scheduler on the same trace, and the time from an
executor's kill -9 to the first token of each migrated stream, in one run.

Every executor is a separate ``pagedkv executor`` process (tiny-llama, CPU torch backend, ``--threads 1``
each so that N executors use at most N cores), driven by one ``pagedkv scheduler`` with ``--executor``
repeated. The trace: ``--num-requests`` (64) distinct random prompts of 32-256 tokens, each asking for
64-128 output tokens (EOS ignored, greedy), all sent at once. The bench compares greedy outputs with the
1-executor run, request by request, and prints how many differ and where the first differing token is:
fp32 results depend slightly on which requests share a batch (as in every batching server), so a
near-tie late in a random model's output may flip; a single executor run twice gives identical outputs.

Migration: two executors, ``--migration-requests`` (32) streams at once (half greedy, half seeded
sampling); once every stream has produced 8 tokens, one executor is killed (SIGKILL). For each stream the
scheduler moved (its ``requests_migrating`` log line names them), the bench reports the time from the kill
to that stream's next token (p50/p99/max), and checks every stream's tokens against an undisturbed run.

NOTE: this machine's core count bounds the scaling: with 2 cores, 4 single-threaded executors cannot beat
2; the table prints the cores seen.

    python bench/scaleout.py                 # -> bench/results/scaleout.json
    python bench/scaleout.py --quick         # smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import sys
import time
from typing import Any

from common import ROOT, first_difference, make_workload, percentile, wait_idle, write_report

from pagedkv.client import Client, Completion, accumulate
from pagedkv.local_server import ServiceProcess
from pagedkv.models import resolve_model

VOCAB = 259  # tiny-llama's byte vocabulary (ids 3..258 are bytes)


def start_cluster(n: int, num_pages: int) -> tuple[ServiceProcess, list[ServiceProcess]]:
    execs = [ServiceProcess("executor", "--threads", "1", "--num-pages", str(num_pages), wait=False) for _ in range(n)]
    for e in execs:
        e.wait_ready(300)
    flags = [f for e in execs for f in ("--executor", e.address)]
    sched = ServiceProcess("scheduler", *flags, "--max-num-seqs", "256")
    return sched, execs


def stop(procs: list[ServiceProcess]) -> None:
    for p in procs:
        p.kill()


async def _stream(client: Client, prompt: list[int], params: dict, request_id: str, t0: float,
                  arrivals: list[float]) -> Completion:
    out = Completion()
    async for msg in client.generate(prompt, request_id=request_id, **params):
        accumulate(out, msg)
        if msg.token_ids:
            arrivals.append(time.perf_counter() - t0)
    return out


async def throughput_run(address: str, reqs) -> dict[str, Any]:
    async with Client(address) as client:
        await client.wait_ready(120)
        await client.complete([1, 72, 105], max_tokens=4)  # warm-up
        t0 = time.perf_counter()
        times: list[list[float]] = [[] for _ in reqs]
        outs = await asyncio.gather(*(
            _stream(client, r.prompt, dict(max_tokens=r.max_tokens, ignore_eos=True), f"r{r.index}", t0, times[i])
            for i, r in enumerate(reqs)))
        wall = time.perf_counter() - t0
        info = await client.model_info()
    tokens = sum(len(o.token_ids) for o in outs)
    return {"wall_s": wall, "output_tokens": tokens, "tokens_per_s": tokens / wall,
            "ttft_p50_s": percentile([t[0] for t in times], 50), "ttft_p99_s": percentile([t[0] for t in times], 99),
            "placed": {e.address: e.num_placed for e in info.executors},
            "outputs": [o.token_ids for o in outs]}


def migration_workload(n: int) -> list[tuple[list[int], dict]]:
    reqs = make_workload(n, seed=11, vocab_size=VOCAB, prompt_range=(24, 128), output_range=(96, 96))
    out = []
    for i, r in enumerate(reqs):
        params = dict(max_tokens=r.max_tokens, ignore_eos=True, temperature=0.0)
        if i % 2:
            params.update(temperature=0.9, top_p=0.95, seed=500 + i)
        out.append((r.prompt, params))
    return out


async def migration_run(address: str, reqs, victim: ServiceProcess | None) -> dict[str, Any]:
    async with Client(address) as client:
        t0 = time.perf_counter()
        times: list[list[float]] = [[] for _ in reqs]
        tasks = [asyncio.create_task(_stream(client, p, kw, f"m{i}", t0, times[i])) for i, (p, kw) in enumerate(reqs)]
        killed_at = None
        if victim is not None:
            while min(len(t) for t in times) < 8:
                await asyncio.sleep(0.005)
            victim.kill()
            killed_at = time.perf_counter() - t0
        outs = await asyncio.gather(*tasks)
    return {"outputs": [o.token_ids for o in outs], "times": times, "killed_at": killed_at}


def measure_migration(args) -> dict[str, Any]:
    reqs = migration_workload(args.migration_requests)
    sched, execs = start_cluster(2, args.num_pages)
    try:
        base = asyncio.run(migration_run(sched.address, reqs, None))
        run = asyncio.run(migration_run(sched.address, reqs, execs[1]))
        time.sleep(0.5)
        moved: set[str] = set()
        for e in sched.events:
            if e.get("event") == "requests_migrating" and e.get("cause") == "failure":
                moved.update(e.get("request_ids", []))
    finally:
        stop([sched, *execs])
    gaps = []
    for i, t in enumerate(run["times"]):
        if f"m{i}" in moved:
            after = [x for x in t if x > run["killed_at"]]
            if after:
                gaps.append(after[0] - run["killed_at"])
    identical = run["outputs"] == base["outputs"]
    return {"streams": len(reqs), "migrated": len(moved), "identical_to_undisturbed": identical,
            "kill_to_first_token_p50_s": percentile(gaps, 50), "kill_to_first_token_p99_s": percentile(gaps, 99),
            "kill_to_first_token_max_s": max(gaps) if gaps else float("nan")}


def _divergence(base: list[list[int]], other: list[list[int]]) -> dict[int, int]:
    """Request index -> first output position where other differs from base (only the differing ones)."""
    out = {}
    for i, (a, b) in enumerate(zip(base, other)):
        if a != b:
            out[i] = first_difference(a, b)
    return out


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--executors", default="1,2,4", help="executor counts to compare")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--migration-requests", type=int, default=32)
    p.add_argument("--num-pages", type=int, default=512, help="device pages per executor")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="smoke run: 16 requests, counts 1,2")
    p.add_argument("--wait-idle", type=float, default=60.0,
                   help="wait up to this long for other processes to leave the CPUs before each run (0: off)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "scaleout.json"))
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.quick:
        args.num_requests, args.migration_requests, args.executors = 16, 8, "1,2"
    resolve_model("tiny-llama")
    counts = [int(c) for c in args.executors.split(",")]
    reqs = make_workload(args.num_requests, args.seed, VOCAB, (32, 256), (64, 128))
    rows = {}
    for n in counts:
        wait_idle(args.wait_idle)
        sched, execs = start_cluster(n, args.num_pages)
        try:
            rows[n] = asyncio.run(throughput_run(sched.address, reqs))
        finally:
            stop([sched, *execs])
        print(f"{n} executor(s): {rows[n]['tokens_per_s']:.1f} tok/s", file=sys.stderr)
    wait_idle(args.wait_idle)
    mig = measure_migration(args)
    divergence = {n: _divergence(rows[counts[0]]["outputs"], rows[n]["outputs"]) for n in counts}
    base = rows[counts[0]]["tokens_per_s"]
    print(f"\nscale-out, tiny-llama on CPU ({os.cpu_count()} cores), {args.num_requests} requests, "
          f"{sum(len(o) for o in rows[counts[0]]['outputs'])} output tokens, one executor thread each\n")
    print("| executors | wall (s) | output tok/s | vs 1 | TTFT p50 (s) | TTFT p99 (s) | requests per executor |")
    print("|---|---|---|---|---|---|---|")
    for n, r in rows.items():
        print(f"| {n} | {r['wall_s']:.2f} | {r['tokens_per_s']:.1f} | {r['tokens_per_s'] / base:.2f}x | "
              f"{r['ttft_p50_s']:.2f} | {r['ttft_p99_s']:.2f} | {'/'.join(str(v) for v in r['placed'].values())} |")
    for n, d in divergence.items():
        if n != counts[0]:
            print(f"\ngreedy outputs, {n} vs {counts[0]} executor(s): {len(d)} of {len(reqs)} requests differ"
                  + (f" (first differing token at output positions {sorted(d.values())})" if d else ""))
    print(f"\nmigration: kill -9 one of 2 executors with {mig['streams']} streams mid-generation: "
          f"{mig['migrated']} streams moved; kill -> first token p50 {mig['kill_to_first_token_p50_s'] * 1e3:.0f} ms, "
          f"p99 {mig['kill_to_first_token_p99_s'] * 1e3:.0f} ms, max {mig['kill_to_first_token_max_s'] * 1e3:.0f} ms; "
          f"outputs identical to an undisturbed run: {mig['identical_to_undisturbed']}")
    result = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
              "config": vars(args), "throughput": {str(n): {k: v for k, v in r.items() if k != "outputs"}
                                                   for n, r in rows.items()},
              "outputs_differing": {str(n): d for n, d in divergence.items()}, "migration": mig}
    write_report(args.out, result)
    return 0 if mig["identical_to_undisturbed"] and mig["migrated"] > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
