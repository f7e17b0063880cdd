"""Decode speed of ``pagedkv serve`` by executor ``--threads``, on an idle machine and with busy processes beside it.

For each ``--threads`` value one ``pagedkv serve`` (the built-in tiny-llama on CPU by default) is started; then, run
by run, a greedy stream of ``--tokens`` tokens (EOS ignored) is timed on an idle machine and again with ``--busy``
spinning processes (``python -c "while True: pass"``) beside the server. tok/s is the stream's tokens over its whole
time (a 6-token prompt: the prefill is a small part); decode tok/s (tokens after the first over the time after the
first message) is kept too, but a client starved of CPU reads a stream's messages late and together, which makes it
unreliable on a busy machine. Every timed window also records how much CPU other processes (not this bench,
not its busy spinners) used: the noise of a shared machine, reported per row. Prints median/min/max per
(threads, load) and writes every run as JSON under bench/results/.

    python bench/threads.py                                   # --threads 1 and 2, idle and 1 busy process, 5 runs
    python bench/threads.py --threads 1 2 0 --runs 7 --busy 1 # 0: torch's default (one thread per core)
    python bench/threads.py -- --model smollm2-135m-instruct  # flags after -- go to serve
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field

from common import RESULTS, CpuWatch, Machine, Server, format_table, write_report

from pagedkv.client import Client

PROMPT = [1, 72, 101, 108, 108, 111]  # BOS "Hello" in the byte tokenizer's ids


@dataclass(slots=True, kw_only=True)
class Config(Machine):
    threads: list[int]
    runs: int
    tokens: int
    busy: int
    serve_args: list[str] = field(default_factory=list)


@dataclass(slots=True)
class Run:
    threads: int
    load: str  # idle | busy
    run: int
    tok_s: float
    decode_tok_s: float
    ttft_s: float
    tokens: int
    foreign_share: float  # CPU share (of the machine) used by processes other than this bench and its spinners


@contextlib.contextmanager
def spinners(n: int):
    """``n`` busy processes (one core each) for the duration."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        time.sleep(0.5)  # (running before the window opens)
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


async def one_stream(address: str, tokens: int) -> tuple[float, float, float, int]:
    """(tok/s, decode tok/s, TTFT s, tokens) of one greedy stream."""
    async with Client(address) as client:
        await client.wait_ready(timeout=120)
        t0 = time.perf_counter()
        first, got = 0.0, 0
        async for msg in client.generate(PROMPT, max_tokens=tokens, ignore_eos=True, temperature=0):
            if msg.token_ids and not got:
                first = time.perf_counter()
            got += len(msg.token_ids)
        end = time.perf_counter()
    return got / (end - t0), (got - 1) / max(end - first, 1e-9), first - t0, got


def timed(address: str, tokens: int) -> tuple[float, float, float, int, float]:
    """One timed stream and the CPU share other processes used meanwhile (the server and the spinners are this
    bench's children: its own)."""
    watch = CpuWatch()
    rate, decode, ttft, got = asyncio.run(one_stream(address, tokens))
    return rate, decode, ttft, got, watch.stop().get("foreign_share", 0.0)


def measure(cfg: Config) -> list[Run]:
    runs: list[Run] = []
    for threads in cfg.threads:
        server = Server(["--threads", str(threads), *cfg.serve_args])
        try:
            asyncio.run(one_stream(server.address, 8))  # warm-up, untimed
            for i in range(cfg.runs):
                for load in ("idle", "busy"):  # (alternating: a shared machine's load falls on both alike)
                    with spinners(cfg.busy if load == "busy" else 0):
                        rate, decode, ttft, got, noise = timed(server.address, cfg.tokens)
                    runs.append(Run(threads, load, i, rate, decode, ttft, got, noise))
                    print(f"  threads={threads} {load:4} run {i}: {rate:7.1f} tok/s (others' CPU {noise:.0%})",
                          flush=True)
        finally:
            server.stop()
    return runs


def table(cfg: Config, runs: list[Run]) -> str:
    rows = []
    idle_median = {t: statistics.median(r.tok_s for r in runs if r.threads == t and r.load == "idle")
                   for t in cfg.threads}
    for threads in cfg.threads:
        for load in ("idle", "busy"):
            v = [r.tok_s for r in runs if r.threads == threads and r.load == load]
            noise = [r.foreign_share for r in runs if r.threads == threads and r.load == load]
            rows.append([str(threads or "0 (torch)"), load if load == "idle" else f"{cfg.busy} busy",
                         f"{statistics.median(v):.1f}", f"{min(v):.1f}", f"{max(v):.1f}",
                         f"{statistics.median(v) / idle_median[threads]:.2f}x", f"{max(noise):.0%}"])
    return format_table(["threads", "load", "tok/s median", "min", "max", "vs idle", "others' CPU max"], rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="executor --threads values (0: torch's)")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--tokens", type=int, default=128, help="tokens per timed stream")
    p.add_argument("--busy", type=int, default=1, help="busy processes beside the server in the busy runs")
    p.add_argument("serve_args", nargs="*", help="after --: more flags for pagedkv serve")
    a = p.parse_args()
    cfg = Config(threads=a.threads, runs=a.runs, tokens=a.tokens, busy=a.busy,
                 serve_args=["--device", "cpu", *a.serve_args])
    runs = measure(cfg)
    print(table(cfg, runs))
    write_report(RESULTS / "threads.json", {"config": asdict(cfg), "runs": [asdict(r) for r in runs]})


if __name__ == "__main__":
    main()
