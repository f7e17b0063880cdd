"""How long the executor's OpenMP threads spin before they sleep, served over HTTP on this machine's cores.

Between two parallel regions torch's OpenMP workers (libgomp) spin, by default for 300,000 rounds (milliseconds),
before they sleep: through the Python between two ops of a step, and after the step while the executor sends its
result and waits for the next plan. On a machine where the scheduler, the gateway and the client share the
executor's cores, that spinning takes the CPU they need at that very moment (``perf`` on the executor serving
tiny-llama's 64-request burst: 44% of its CPU in libgomp's wait loops; SmolLM2's: 13%).

``pagedkv serve --http-port`` is started once per mode and round (modes alternate), with ``GOMP_SPINCOUNT`` set in
its environment (libgomp reads it when the executor starts); the whole workload runs once untimed (its first touch of
memory and its shapes), then again, timed: all requests at once, streamed from ``/v1/completions`` (token-id
prompts, greedy, EOS ignored) by this process. Reported per mode, medians over the rounds: output tok/s, TTFT p50,
and the CPU seconds the server's processes (executor, scheduler, gateway) took in the window.

    python bench/omp_spin.py                                   # tiny-llama and SmolLM2, 3 rounds
    python bench/omp_spin.py --models tiny-llama --modes 300000,10000 --rounds 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common import Server, percentile, print_table, write_report  # noqa: E402

from pagedkv.cli import free_port  # noqa: E402
from pagedkv.models import resolve_model  # noqa: E402

WORKLOADS = {  # model -> (requests, prompt tokens, output tokens): e2e_peers.py's uniform burst
    "tiny-llama": (64, 128, 64),
    "smollm2-135m-instruct": (32, 128, 64),
}


def _cpu_ticks(pid: int) -> int:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])
    except (OSError, IndexError, ValueError):
        return 0


def _tree(pid: int) -> list[int]:
    out = [pid]
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            for child in (task / "children").read_text().split():
                out += _tree(int(child))
        except OSError:
            pass
    return out


async def _one(session, url: str, model: str, prompt: list[int], max_tokens: int, t0: float) -> tuple[float, int]:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    ttft, tokens = float("nan"), 0
    async with session.post(url, json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:500]}")
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            event = json.loads(line[5:])
            if event.get("choices") and event["choices"][0].get("text") and ttft != ttft:
                ttft = time.perf_counter() - t0
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    return ttft, tokens


async def _burst(port: int, model: str, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[float], int]:
    import aiohttp

    url = f"http://127.0.0.1:{port}/v1/completions"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800)) as session:
        t0 = time.perf_counter()
        got = await asyncio.gather(*(_one(session, url, model, p, max_tokens, t0) for p in prompts))
        wall = time.perf_counter() - t0
    return wall, [g[0] for g in got], sum(g[1] for g in got)


def run(model: str, spin: str, rounds_seed: int) -> dict:
    n, prompt_len, out_len = WORKLOADS[model]
    http = free_port()
    os.environ["GOMP_SPINCOUNT"] = spin
    server = Server(["--model", model, "--http-port", str(http), "--served-model-name", "m", "--max-num-seqs", "256",
                     "--max-num-batched-tokens", "2048"])
    try:
        import random

        rng = random.Random(rounds_seed)
        vocab = 250 if model == "tiny-llama" else 40000  # (tiny-llama: 259 ids)
        fresh = [[1] + [3 + rng.randrange(vocab) for _ in range(prompt_len - 1)] for _ in range(2 * n)]
        asyncio.run(_burst(http, "m", fresh[:n], out_len))  # untimed: the shapes and the memory, once
        pids = _tree(server.proc.pid)
        before = {p: _cpu_ticks(p) for p in pids}
        wall, ttfts, tokens = asyncio.run(_burst(http, "m", fresh[n:], out_len))
        cpu = sum(_cpu_ticks(p) - before[p] for p in pids) / os.sysconf("SC_CLK_TCK")
    finally:
        server.stop()
        os.environ.pop("GOMP_SPINCOUNT", None)
    if tokens != n * out_len:
        raise RuntimeError(f"{model}: {tokens} tokens, expected {n * out_len}")
    return {"tok_s": tokens / wall, "ttft_p50_s": percentile(ttfts, 50), "server_cpu_s": cpu, "wall_s": wall,
            "load": os.getloadavg()[0]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="tiny-llama,smollm2-135m-instruct")
    p.add_argument("--modes", default="300000,10000", help="GOMP_SPINCOUNT values (300000: libgomp's default)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "omp_spin.json"))
    args = p.parse_args()
    modes = args.modes.split(",")
    report: dict = {"modes": modes, "rounds": args.rounds, "runs": {}}
    rows = []
    for model in args.models.split(","):
        resolve_model(model)
        runs: dict[str, list[dict]] = {m: [] for m in modes}
        for r in range(args.rounds):
            for mode in (modes if r % 2 == 0 else modes[::-1]):  # alternate, and the order too
                got = run(model, mode, r)
                runs[mode].append(got)
                print(f"  {model} round {r + 1} GOMP_SPINCOUNT={mode}: {got['tok_s']:.1f} tok/s, TTFT p50 "
                      f"{got['ttft_p50_s'] * 1e3:.0f} ms, server CPU {got['server_cpu_s']:.2f} s in "
                      f"{got['wall_s']:.2f} s, load {got['load']:.2f}", flush=True)
        report["runs"][model] = runs
        base = statistics.median(x["tok_s"] for x in runs[modes[0]])
        for mode in modes:
            xs = runs[mode]
            tok = statistics.median(x["tok_s"] for x in xs)
            rows.append([model, mode, f"{tok:.1f}", f"{tok / base:.2f}x",
                         f"{statistics.median(x['ttft_p50_s'] for x in xs) * 1e3:.0f}",
                         f"{statistics.median(x['server_cpu_s'] / x['wall_s'] for x in xs):.2f}",
                         " ".join(f"{x['tok_s']:.0f}" for x in xs)])
    print_table(["model", "GOMP_SPINCOUNT", "out tok/s (median)", f"vs {modes[0]}", "TTFT p50 ms",
                 "server cores busy", "tok/s per round"], rows)
    write_report(args.out, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
