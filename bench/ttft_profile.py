"""Where the first token's time goes (#49, item 1): drives `pagedkv serve` with the issue's workloads and reads each
request's breakdown from the scheduler's DEBUG `request_first_token` lines (scheduler_svc/ttft_trace.py).

Workloads (greedy, ignore_eos, token-id prompts through pagedkv.client over gRPC):
  poisson  48 x (256 +-50%) -> (64 +-50%), Poisson arrivals at 4 req/s
  prefix   32 x (one shared 1,024-token prefix + 64) -> 32, all at once
  mixed    --mixed-requests x (256 +-90%) -> (128 +-90%), all at once (the issue's row has 64)

Prints, per model, workload and run: mean / p99 of tokenize, queue, behind (the first chunk's plan waiting for the
plan in flight: async scheduling's extra step), prefill (first plan to first token read, behind included), send
(read to taken by the handler) and TTFT (server's, and the client's), the prefill's steps and chunks; then the
shared-prefix burst's first prefill chunk by chunk. Writes bench/results/ttft_profile.json. Each workload runs
--runs times (the machine is shared: the spread is the noise)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import time
from pathlib import Path

from pagedkv.cli import free_port
from pagedkv.client import Client
from pagedkv.loadgen.report import percentile
from pagedkv.local_server import LocalServer

ROOT = Path(__file__).resolve().parent.parent
PARTS = ("tokenize_s", "prepare_s", "queue_s", "behind_s", "prefill_s", "send_s", "ttft_s")


def _spread(rng: random.Random, mean: int, frac: float) -> int:
    return max(1, round(mean * (1 + rng.uniform(-frac, frac))))


def workload(name: str, seed: int, mixed_requests: int) -> list[tuple[list[int], int, float]]:
    """(prompt ids, max_tokens, arrival offset in seconds) per request."""
    rng = random.Random(seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(3, 250) for _ in range(n)]
    if name == "poisson":
        t, out = 0.0, []
        for _ in range(48):
            out.append(([1] + ids(_spread(rng, 256, 0.5) - 1), _spread(rng, 64, 0.5), t))
            t += rng.expovariate(4.0)
        return out
    if name == "prefix":
        prefix = [1] + ids(1023)
        return [(prefix + ids(64), 32, 0.0) for _ in range(32)]
    if name == "mixed":
        return [([1] + ids(_spread(rng, 256, 0.9) - 1), _spread(rng, 128, 0.9), 0.0) for _ in range(mixed_requests)]
    raise ValueError(f"workload: {name!r} is not one of poisson, prefix, mixed")


async def _drive(address: str, reqs: list[tuple[list[int], int, float]], tag: str) -> list[dict]:
    """Sends each request at its offset; per request its client-side TTFT and cached tokens."""
    async with Client(address) as client:
        t0 = time.perf_counter()

        async def one(i: int, prompt: list[int], max_tokens: int, at: float) -> dict:
            await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
            sent, first, cached = time.perf_counter(), 0.0, 0
            async for msg in client.generate(prompt, max_tokens=max_tokens, ignore_eos=True,
                                             request_id=f"{tag}-{i}"):
                if msg.token_ids and not first:
                    first = time.perf_counter() - sent
                if msg.usage.cached_tokens:
                    cached = msg.usage.cached_tokens
            return {"request_id": f"{tag}-{i}", "client_ttft_s": first, "cached_tokens": cached}
        return await asyncio.gather(*(one(i, *r) for i, r in enumerate(reqs)))


def _stats(values: list[float]) -> dict:
    return {"mean": statistics.fmean(values), "p99": percentile(values, 99)} if values else {}


def summarize(lines: list[dict], clients: list[dict]) -> dict:
    out = {k: _stats([e[k] for e in lines]) for k in PARTS}
    out["client_ttft_s"] = _stats([c["client_ttft_s"] for c in clients])
    out["prefill_steps"] = _stats([e["prefill_steps"] for e in lines])
    out["prefill_chunks"] = _stats([e["prefill_chunks"] for e in lines])
    out["plans_ahead"] = statistics.fmean(e["plans_ahead"] for e in lines) if lines else 0.0
    out["requests"] = len(lines)
    return out


def first_prefill(lines: list[dict], clients: list[dict], prompt_tokens: int) -> dict:
    """The shared-prefix burst: the request whose chunks ran first, chunk by chunk, and how often the prefix was
    computed (prompt tokens the burst's chunks computed against the burst's prompt tokens)."""
    first = min(lines, key=lambda e: e["chunks"][0][0])
    computed = sum(c[1] for e in lines for c in e["chunks"])
    return {"request_id": first["request_id"], "ttft_s": first["ttft_s"], "queue_s": first["queue_s"],
            "prefill_s": first["prefill_s"], "chunks": first["chunks"],
            "burst_prompt_tokens": prompt_tokens * len(lines), "burst_computed_tokens": computed,
            "requests_with_prefix_hit": sum(c["cached_tokens"] >= 1008 for c in clients)}


def run_model(model: str, workloads: list[str], runs: int, mixed_requests: int, extra: list[str]) -> dict:
    server = LocalServer("--model", model, "--metrics-port", str(free_port()), "--log-format", "json",
                         "--log-level", "debug", *extra, timeout=600)
    results: dict = {"model": model, "runs": []}
    try:
        asyncio.run(_drive(server.address, workload("mixed", 99, 8), "warmup"))  # (kernels, allocator)
        asyncio.run(_drive(server.address, workload("prefix", 98, 0)[:2], "warmup-prefix"))
        for run in range(runs):
            for name in workloads:
                reqs = workload(name, run, mixed_requests)
                tag = f"{name}-{run}"
                load = os.getloadavg()[0]
                clients = asyncio.run(_drive(server.address, reqs, tag))
                time.sleep(0.5)  # (the last lines reach the pump)
                lines = [e for e in list(server.events) if e.get("event") == "request_first_token"
                         and str(e.get("request_id", "")).startswith(tag + "-")]
                row = {"workload": name, "run": run, "load_before": load, "load_after": os.getloadavg()[0],
                       **summarize(lines, clients)}
                if name == "prefix" and lines:
                    row["first_prefill"] = first_prefill(lines, clients, len(reqs[0][0]))
                results["runs"].append(row)
                print(_row(model, row), flush=True)
    finally:
        server.stop()
    return results


def _ms(s: dict) -> str:
    return f"{s['mean'] * 1e3:.0f} / {s['p99'] * 1e3:.0f}" if s else "-"


HEADER = ("| model | workload | run | load | n | tokenize | queue | behind | prefill | steps | chunks | send | TTFT "
          "server | TTFT client |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")


def _row(model: str, r: dict) -> str:
    steps, chunks = r["prefill_steps"], r["prefill_chunks"]
    return (f"| {model} | {r['workload']} | {r['run'] + 1} | {r['load_before']:.1f}-{r['load_after']:.1f} | "
            f"{r['requests']} | {_ms(r['tokenize_s'])} | {_ms(r['queue_s'])} | {_ms(r['behind_s'])} | "
            f"{_ms(r['prefill_s'])} | {steps.get('mean', 0):.2f} / {steps.get('p99', 0):.0f} | "
            f"{chunks.get('mean', 0):.2f} | {_ms(r['send_s'])} | {_ms(r['ttft_s'])} | {_ms(r['client_ttft_s'])} |")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="smollm2-135m-instruct,tiny-llama")
    p.add_argument("--workloads", default="poisson,prefix,mixed")
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--mixed-requests", type=int, default=32)
    p.add_argument("--serve-args", default="", help="more flags for pagedkv serve (one string)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "ttft_profile.json"))
    args = p.parse_args(argv)
    print("ms, mean / p99 (steps: mean / p99); behind is part of prefill\n" + HEADER, flush=True)
    report = {"load_start": os.getloadavg(), "cpus": os.cpu_count(), "models": []}
    for model in args.models.split(","):
        report["models"].append(run_model(model, args.workloads.split(","), args.runs, args.mixed_requests,
                                          args.serve_args.split()))
    report["load_end"] = os.getloadavg()
    for m in report["models"]:
        for r in m["runs"]:
            if "first_prefill" in r:
                f = r["first_prefill"]
                print(f"{m['model']} prefix run {r['run'] + 1}: first prefill {f['request_id']} ttft "
                      f"{f['ttft_s']:.3f} s (queue {f['queue_s']:.3f}, prefill {f['prefill_s']:.3f}); chunks "
                      f"[step, tokens, decode rows, other prefill tokens, ms]: {f['chunks']}; the burst computed "
                      f"{f['burst_computed_tokens']} of {f['burst_prompt_tokens']} prompt tokens; "
                      f"{f['requests_with_prefix_hit']} requests hit the prefix")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
