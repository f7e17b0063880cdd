"""Memory per queued request: the scheduler's RSS with requests waiting to start, by prompt size.

One executor (a small random Llama with a byte tokenizer and an 8192-token context, one torch thread) and one
scheduler on loopback. A tenants file gives tenant ``q`` ``max_concurrent_requests = 1``: a holder request (long,
greedy, EOS ignored) runs, and every other request of ``q`` waits to start. For each prompt kind (``tiny``: the
text "hi"; ``4k``: 4 KiB of ASCII text, 4,097 tokens with the byte tokenizer) the bench opens ``--warm`` streams
(allocator and gRPC warm-up), reads the scheduler's RSS (``/proc/PID/status`` VmRSS), opens ``--requests``
more (all from one client process, one channel), waits until ModelInfo (admin key) shows them all waiting, and
reads RSS again; memory per queued request is the difference over the count. Streams are cancelled between
kinds. The scheduler's queue bounds are lifted for the run (``--max-queued-requests 0 --max-queued-total 0``).

    python bench/queue_memory.py [--requests 1000]

Prints a table and writes bench/results/queue_memory.json. The figures include everything a queued request
holds in the scheduler: its gRPC call and stream, the handler's frame, the Request, its token ids, detokenizer
and outbox (the text itself is not kept once tokenized).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

from pagedkv.client import Client
from pagedkv.local_server import ServiceProcess
from pagedkv.tenancy import hash_key
from pagedkv.tools.random_model import build_random_model

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
PROMPTS = {"tiny": "hi", "4k": "x" * 4096}


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


async def waiting(address: str) -> int:
    async with Client(address, api_key="key-ops") as ops:
        return (await ops.model_info()).num_waiting


async def measure(address: str, pid: int, text: str, warm: int, count: int) -> dict:
    async with Client(address, api_key="key-q") as client:
        streams = []

        async def open_streams(n: int) -> None:
            for _ in range(n):
                call = client.generate(text, max_tokens=1)
                streams.append(asyncio.ensure_future(call.__anext__()))
            target = len(streams)
            for _ in range(600):
                if await waiting(address) >= target:
                    return
                await asyncio.sleep(0.1)
            raise RuntimeError(f"only {await waiting(address)} of {target} requests waiting")

        await open_streams(warm)
        await asyncio.sleep(1.0)
        before = rss_bytes(pid)
        t0 = time.perf_counter()
        await open_streams(count)
        took = time.perf_counter() - t0
        await asyncio.sleep(1.0)
        after = rss_bytes(pid)
        for s in streams:
            s.cancel()
        await asyncio.gather(*streams, return_exceptions=True)
    for _ in range(300):  # the cancelled requests leave the queue
        if await waiting(address) == 0:
            break
        await asyncio.sleep(0.1)
    return {"rss_before_mib": before / 2**20, "rss_after_mib": after / 2**20, "queued": count,
            "bytes_per_request": (after - before) / count, "seconds_to_queue": took}


async def run(args, address: str, pid: int) -> dict:
    async with Client(address, api_key="key-q") as client:
        holder = client.generate([1] + [5] * 8, max_tokens=8000, ignore_eos=True)
        await holder.__anext__()  # running: the seat of q's one concurrent request is taken
        report = {}
        for kind in args.kinds.split(","):
            report[kind] = await measure(address, pid, PROMPTS[kind], args.warm, args.requests)
        await holder.aclose()
    return report


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--warm", type=int, default=20)
    p.add_argument("--kinds", default="tiny,4k")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = build_random_model(Path(tmp) / "model", hidden_size=64, intermediate_size=128, num_layers=2,
                                   num_heads=4, num_kv_heads=2, max_position_embeddings=8192)
        tenants = Path(tmp) / "tenants.toml"
        tenants.write_text(f'[tenants.q]\nkeys = ["{hash_key("key-q")}"]\nmax_concurrent_requests = 1\n'
                           f'[tenants.ops]\nkeys = ["{hash_key("key-ops")}"]\nadmin = true\n')
        executor = ServiceProcess("executor", "--model", str(model), "--threads", "1", "--num-pages", "1200")
        scheduler = None
        try:
            scheduler = ServiceProcess("scheduler", "--executor", executor.address, "--tenants-file", str(tenants),
                                       "--max-num-seqs", "8", "--max-queued-requests", "0", "--max-queued-total", "0")
            report = asyncio.run(run(args, scheduler.address, scheduler.proc.pid))
        finally:
            if scheduler is not None:
                scheduler.stop()
            executor.stop()
    print(f"{'prompt':>6} {'queued':>7} {'RSS before':>11} {'RSS after':>10} {'per request':>12}")
    for kind, r in report.items():
        print(f"{kind:>6} {r['queued']:>7} {r['rss_before_mib']:>9.1f} M {r['rss_after_mib']:>8.1f} M "
              f"{r['bytes_per_request'] / 1024:>9.1f} KiB")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "queue_memory.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
