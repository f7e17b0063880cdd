"""The fixed per-request part of time to first token at batch 1: where it goes, from the client to the first token.

Starts one ``pagedkv serve --http-port`` (tiny-llama by default: its 512-token prefill is ~5 ms, so what is left of
TTFT is overhead), warms it up, then sends --requests sequential streaming requests (a fresh ~512-token prompt of
random tokens decoded to text each, max_tokens 8, temperature 0): first over HTTP (/v1/completions through the
gateway, aiohttp, first SSE chunk with choices = TTFT, as ``vllm bench serve``), then over gRPC straight to the
scheduler (pagedkv.client). Per request the scheduler's DEBUG ``request_first_token`` line
(scheduler_svc/ttft_trace.py) gives received -> tokenized -> queued -> first planned -> first token read -> taken;
/metrics of the scheduler, the executor and the gateway (deltas over each phase) give the plan holds, the gateway's
own TTFT and, from a third phase of max_tokens 1 requests, the executor's own time for the prefill step.

``--checkout DIR`` runs another checkout's pagedkv (e.g. ``git worktree add /tmp/ttft_before HEAD``) with this
script's driver, so a before/after pair is measured the same way in one run: ``--checkout /tmp/ttft_before
--checkout .`` (each one server after the other). Prints a table (ms: mean, p50) and writes
bench/results/ttft_fixed.json."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import statistics
import sys
import time
import urllib.request
from pathlib import Path

import aiohttp

from pagedkv.cli import free_port
from pagedkv.client import Client
from pagedkv.local_server import LocalServer

ROOT = Path(__file__).resolve().parent.parent
TRACE = ("tokenize_s", "prepare_s", "queue_s", "behind_s", "prefill_s", "send_s", "ttft_s")
SERIES = {  # /metrics histogram -> name here (sum and count deltas: means)
    "pagedkv_step_seconds": "step_{part}",
    "pagedkv_plan_hold_seconds": "plan_hold",
    "pagedkv_gateway_ttft_seconds": "gateway_ttft",
    "pagedkv_request_latency_seconds": "e2e",
    "pagedkv_executor_step_seconds": "exec_{part}",
    "pagedkv_executor_idle_seconds": "exec_idle",
}


def scrape(url: str) -> dict[str, float]:
    """Histogram sums and counts of SERIES (labels: part only) from a /metrics page."""
    try:
        text = urllib.request.urlopen(url, timeout=5).read().decode()
    except OSError:
        return {}
    out: dict[str, float] = {}
    for m in re.finditer(r'^(\w+)_(sum|count)(?:\{([^}]*)\})? (\S+)$', text, re.M):
        base, kind, labels, value = m.groups()
        if base not in SERIES:
            continue
        part = re.search(r'part="(\w+)"', labels or "")
        name = SERIES[base].format(part=part.group(1) if part else "")
        out[f"{name}_{kind}"] = out.get(f"{name}_{kind}", 0.0) + float(value)
    return out


def metric_means(before: dict, after: dict) -> dict[str, dict]:
    names = {k.rsplit("_", 1)[0] for k in after if k.endswith("_count")}
    out = {}
    for n in sorted(names):
        count = after.get(f"{n}_count", 0) - before.get(f"{n}_count", 0)
        if count > 0:
            out[n] = {"mean_s": (after[f"{n}_sum"] - before.get(f"{n}_sum", 0)) / count, "count": count}
    return out


async def http_one(session: aiohttp.ClientSession, url: str, model: str, prompt: str, max_tokens: int,
                   rid: str) -> float:
    """TTFT as vllm bench serve takes it (the first SSE chunk with choices), and the completion tokens that chunk
    covers (stream_options.continuous_usage_stats): above 1, the first token(s) sent no chunk."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    start = time.perf_counter()
    ttft, tokens = 0.0, 0
    async with session.post(url, json=body, headers={"x-request-id": rid}) as r:
        r.raise_for_status()
        async for line in r.content:
            line = line.strip()
            if ttft or not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices"):
                ttft = time.perf_counter() - start
                tokens = (chunk.get("usage") or {}).get("completion_tokens", 0)
    return ttft, tokens


async def grpc_one(client: Client, prompt: str, max_tokens: int, rid: str) -> float:
    start = time.perf_counter()
    ttft = 0.0
    async for msg in client.generate(prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                                     request_id=rid):
        if msg.token_ids and not ttft:
            ttft = time.perf_counter() - start
    return ttft


async def prompts_for(client: Client, n: int, tokens: int, seed: int) -> list[str]:
    """n texts of about ``tokens`` tokens each (random lowercase words, cut to ``tokens`` by the model's tokenizer)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        words = " ".join("".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9)))
                         for _ in range(tokens))
        ids = await client.tokenize(words, add_special_tokens=False)
        out.append(await client.detokenize(ids[:tokens - 1]))
    return out


def stats(values: list[float]) -> dict:
    if not values:
        return {}
    return {"mean": statistics.fmean(values), "p50": statistics.median(values), "min": min(values),
            "max": max(values), "n": len(values)}


async def drive(server: LocalServer, http_port: int, metrics_port: int, args, tag: str) -> dict:
    """Three phases, each --requests long: http (the gateway), grpc (straight to the scheduler), prefill (gRPC with
    max_tokens 1: a prefill step and the step that forgets the request, so the executor's step time per request is
    the prefill's)."""
    pages = [f"http://127.0.0.1:{metrics_port}/metrics", f"http://127.0.0.1:{metrics_port + 1}/metrics",
             f"http://127.0.0.1:{http_port}/metrics"]  # the scheduler's, the executor's, the gateway's
    url = f"http://127.0.0.1:{http_port}/v1/completions"
    phases = (("http", args.max_tokens), ("grpc", args.max_tokens), ("prefill", 1))
    async with Client(server.address) as client:
        await client.wait_ready()
        model = (await client.model_info()).model
        prompts = await prompts_for(client, args.warmup + len(phases) * args.requests, args.prompt_tokens, args.seed)
        result: dict = {}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            for i in range(args.warmup):  # both paths: connections, kernels, the step clock's model
                await http_one(session, url, model, prompts[i], args.max_tokens, f"{tag}-warm-h{i}")
                await grpc_one(client, prompts[i], args.max_tokens, f"{tag}-warm-g{i}")
            for k, (phase, max_tokens) in enumerate(phases):
                base = args.warmup + k * args.requests
                m0 = {key: v for page in pages for key, v in scrape(page).items()}
                ttfts, first_chunk_tokens = [], []
                for i in range(args.requests):
                    rid, prompt = f"{tag}-{phase}-{i}", prompts[base + i]
                    if phase == "http":
                        ttft, tokens = await http_one(session, url, model, prompt, max_tokens, rid)
                        first_chunk_tokens.append(tokens)
                    else:
                        ttft = await grpc_one(client, prompt, max_tokens, rid)
                    ttfts.append(ttft)
                    await asyncio.sleep(args.gap)
                await asyncio.sleep(0.5)  # (the last log lines reach the pump)
                m1 = {key: v for page in pages for key, v in scrape(page).items()}
                lines = [e for e in list(server.events) if e.get("event") == "request_first_token"
                         and str(e.get("request_id", "")).startswith(f"{tag}-{phase}-")]
                trace = {key: stats([e[key] for e in lines]) for key in TRACE}
                trace["prefill_steps"] = stats([e["prefill_steps"] for e in lines])
                trace["plans_ahead"] = stats([e["plans_ahead"] for e in lines])
                result[phase] = {"client_ttft_s": stats(ttfts), "trace": trace, "metrics": metric_means(m0, m1),
                                 "first_chunk_tokens": stats(first_chunk_tokens)}
    return result


def run_checkout(checkout: Path, args) -> dict:
    http_port, metrics_port = free_port(), free_port()
    env = {**os.environ, "PYTHONPATH": str(checkout)}  # (that checkout's pagedkv, not this venv's editable one)
    server = LocalServer("--model", args.model, "--http-port", str(http_port), "--metrics-port", str(metrics_port),
                         "--log-format", "json", "--log-level", "debug", *args.serve_args.split(),
                         command=(sys.executable, "-m", "pagedkv"), cwd=checkout, env=env, timeout=300)
    try:
        out = asyncio.run(drive(server, http_port, metrics_port, args, checkout.name or "main"))
    finally:
        server.stop()
    return {"checkout": str(checkout), **out}


def rows(r: dict) -> list[tuple[str, str, float]]:
    """(label, statistic, ms): the HTTP path's TTFT in parts (means add up), then the gRPC path's."""
    h, g, pre = r["http"], r["grpc"], r["prefill"]
    ht, hm = h["trace"], h["metrics"]
    nan = float("nan")

    def ms(s: dict, key: str = "mean") -> float:
        return s[key] * 1e3 if s else nan

    def metric(m: dict, name: str, key: str = "mean_s") -> float:  # (a count: 0 when nothing was observed)
        return m.get(name, {}).get(key, nan) * 1e3 if key == "mean_s" else m.get(name, {}).get(key, 0)
    n = max(1, h["client_ttft_s"].get("n", 1))
    gw, sched = metric(hm, "gateway_ttft"), ms(ht["ttft_s"])
    steps = metric(pre["metrics"], "exec_total", "count")
    prefill_exec = metric(pre["metrics"], "exec_total") * steps / max(1, pre["client_ttft_s"].get("n", 1))
    holds = metric(hm, "plan_hold", "count")
    return [
        ("HTTP client TTFT", "p50", ms(h["client_ttft_s"], "p50")),
        ("HTTP client TTFT", "mean", ms(h["client_ttft_s"])),
        ("tokens the first SSE chunk covers (1: the first token's own chunk)", "mean", h["first_chunk_tokens"]["mean"]),
        ("client <-> gateway (HTTP both ways) = client TTFT - gateway TTFT", "mean", ms(h["client_ttft_s"]) - gw),
        ("gateway: parse, gRPC to the scheduler and back, SSE = gateway - scheduler TTFT", "mean", gw - sched),
        ("scheduler TTFT (received -> first token taken by the handler)", "mean", sched),
        ("  tokenize (received -> prompt ids)", "mean", ms(ht["tokenize_s"])),
        ("  prepare (checks, the Request)", "mean", ms(ht["prepare_s"])),
        ("  queue (handed over -> first planned)", "mean", ms(ht["queue_s"])),
        ("  plan holds (plan_clock.wait_to_plan) per request", "count", holds / n),
        ("  plan hold, when held (the result still ends it early)", "mean", metric(hm, "plan_hold")),
        ("  prefill (first planned -> first token read)", "mean", ms(ht["prefill_s"])),
        ("    the executor's own prefill step (max_tokens 1 phase)", "mean", prefill_exec),
        ("    behind a plan in flight", "mean", ms(ht["behind_s"])),
        ("  send (first token read -> taken by the handler)", "mean", ms(ht["send_s"])),
        ("gRPC client TTFT", "p50", ms(g["client_ttft_s"], "p50")),
        ("gRPC client TTFT", "mean", ms(g["client_ttft_s"])),
        ("  client <-> scheduler (gRPC both ways) = client - scheduler TTFT", "mean",
         ms(g["client_ttft_s"]) - ms(g["trace"]["ttft_s"])),
        ("  scheduler TTFT", "mean", ms(g["trace"]["ttft_s"])),
        ("the gateway's share = HTTP - gRPC client TTFT", "mean", ms(h["client_ttft_s"]) - ms(g["client_ttft_s"])),
        ("fixed part: HTTP client TTFT - the executor's prefill step", "mean", ms(h["client_ttft_s"]) - prefill_exec),
        ("fixed part: gRPC client TTFT - the executor's prefill step", "mean", ms(g["client_ttft_s"]) - prefill_exec),
    ]


def table(results: list[dict], columns: list[list[tuple[str, str, float]]] | None = None) -> str:
    names = [Path(r["checkout"]).name or r["checkout"] for r in results]
    out = ["| part (ms unless a count) | stat | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(results)]
    columns = columns or [rows(r) for r in results]
    for i, (label, stat, _) in enumerate(columns[0]):
        out.append(f"| {label} | {stat} | " + " | ".join(f"{c[i][2]:.2f}" for c in columns) + " |")
    return "\n".join(out)


def median_table(rounds: list[list[dict]]) -> str:
    """Each cell's median over the rounds."""
    per_round = [[rows(r) for r in results] for results in rounds]
    columns = [[(label, stat, statistics.median(rnd[c][i][2] for rnd in per_round))
                for i, (label, stat, _) in enumerate(per_round[0][c])] for c in range(len(rounds[0]))]
    return table(rounds[0], columns)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkout", action="append", default=[], help="a pagedkv checkout to serve (repeatable; "
                   "default: this one)")
    p.add_argument("--model", default="tiny-llama")
    p.add_argument("--requests", type=int, default=50)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--gap", type=float, default=0.0, help="seconds between requests (0: the next goes when the last "
                   "ended, as vllm bench serve --max-concurrency 1)")
    p.add_argument("--rounds", type=int, default=1, help="each checkout this many times, interleaved")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--serve-args", default="", help="more flags for pagedkv serve (one string)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "ttft_fixed.json"))
    args = p.parse_args(argv)
    checkouts = [Path(c).resolve() for c in (args.checkout or [str(ROOT)])]
    report = {"args": vars(args), "load_start": os.getloadavg(), "cpus": os.cpu_count(), "rounds": []}
    for rnd in range(args.rounds):
        results = [run_checkout(c, args) for c in checkouts]
        report["rounds"].append(results)
        print(f"\nround {rnd + 1}: ms (means unless p50)\n" + table(results), flush=True)
    if args.rounds > 1:
        print(f"\nmedian of {args.rounds} rounds\n" + median_table(report["rounds"]), flush=True)
    report["load_end"] = os.getloadavg()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
