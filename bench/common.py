"""What the benchmarks share: the random-prompt workload, a served ``pagedkv serve``, timed streams, percentiles,
the CPU-contention watch, the machine's description, tables and the JSON report.

Imported as ``common`` by the scripts next to it (``python bench/x.py`` puts ``bench/`` on the path).
Percentiles are pagedkv.loadgen's (linear interpolation between closest ranks), NaN for no values.
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import random
import statistics
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pagedkv.loadgen.report import percentile as _loadgen_percentile
from pagedkv.local_server import LocalServer

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
BOS_ID = 1
FIRST_BYTE_ID = 3  # token ids below this are special (pad 0, BOS 1, EOS 2)
WARMUP_PROMPT = [BOS_ID, 72, 105]


# ---- workload ----------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Request:
    index: int
    prompt: list[int]
    max_tokens: int


def make_workload(num_requests: int, seed: int, vocab_size: int, prompt_range: tuple[int, int],
                  output_range: tuple[int, int]) -> list[Request]:
    """Random prompts (BOS then ids in [3, vocab)) and output lengths, both uniform in their ranges."""
    rng = random.Random(seed)
    reqs: list[Request] = []
    for i in range(num_requests):
        plen = rng.randint(*prompt_range)
        olen = rng.randint(*output_range)
        prompt = [BOS_ID] + [rng.randrange(FIRST_BYTE_ID, vocab_size) for _ in range(plen - 1)]
        reqs.append(Request(i, prompt, olen))
    return reqs


def pages_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


# ---- statistics --------------------------------------------------------------------------------
def percentile(values: Sequence[float], q: float) -> float:
    """q in [0, 100]; NaN for no values."""
    return _loadgen_percentile(values, q) if values else float("nan")


def latency_summary(ttfts: Sequence[float], latencies: Sequence[float]) -> dict[str, float]:
    """Mean, p50 and p99 of time to first token and of whole-request latency, in seconds."""
    out: dict[str, float] = {}
    for name, xs in (("ttft", ttfts), ("latency", latencies)):
        out[f"{name}_mean_s"] = statistics.fmean(xs) if xs else float("nan")
        out[f"{name}_p50_s"] = percentile(xs, 50)
        out[f"{name}_p99_s"] = percentile(xs, 99)
    return out


def first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    """The first position where two token sequences differ (the shorter length when one extends the other)."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


# ---- CPU accounting (Linux): how much of the machine did something other than the bench use? ----------
CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
CONTENDED_SHARE = 0.05  # a run during which other processes used more of the machine is not trustworthy


def _system_cpu_s() -> tuple[float, float]:
    """(busy, steal) CPU seconds of the whole machine since boot (all cores, /proc/stat)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    steal = fields[7] if len(fields) > 7 else 0
    return (sum(fields[:8]) - idle - steal) / CLK_TCK, steal / CLK_TCK


def _tree_cpu_s(root: int) -> float:
    """utime + stime of ``root`` and all its live descendants."""
    procs: dict[int, tuple[int, float]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        rest = stat[stat.rfind(")") + 2:].split()
        procs[int(entry)] = (int(rest[1]), (int(rest[11]) + int(rest[12])) / CLK_TCK)
    total, stack = 0.0, [root]
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in procs.items():
        children.setdefault(ppid, []).append(pid)
    while stack:
        pid = stack.pop()
        total += procs.get(pid, (0, 0.0))[1]
        stack.extend(children.get(pid, []))
    return total


class CpuWatch:
    """Busy CPU time of processes outside this bench's process tree during a timed window."""

    def __init__(self) -> None:
        self.ok = os.path.exists("/proc/stat")
        self.t0 = time.perf_counter()
        self.sys0, self.steal0 = _system_cpu_s() if self.ok else (0.0, 0.0)
        self.own0 = _tree_cpu_s(os.getpid()) if self.ok else 0.0

    def stop(self) -> dict[str, float]:
        wall = time.perf_counter() - self.t0
        if not self.ok:
            return {}
        busy, steal = _system_cpu_s()
        busy, steal = busy - self.sys0, steal - self.steal0
        own = _tree_cpu_s(os.getpid()) - self.own0
        foreign = max(0.0, busy - own)
        return {"busy_cpu_s": busy, "own_cpu_s": own, "foreign_cpu_s": foreign, "steal_cpu_s": steal,
                "foreign_share": foreign / (wall * (os.cpu_count() or 1))}


def wait_idle(max_wait_s: float, quiet_s: float = 3.0, threshold: float = 0.1) -> float:
    """Waits until other processes use < ``threshold`` of the CPUs for ``quiet_s`` seconds in a row.

    Returns the seconds waited; gives up (and says so) after ``max_wait_s``."""
    if max_wait_s <= 0 or not os.path.exists("/proc/stat"):
        return 0.0
    start = time.perf_counter()
    quiet = 0.0
    announced = False
    while quiet < quiet_s:
        watch = CpuWatch()
        time.sleep(1.0)
        if watch.stop()["foreign_share"] < threshold:
            quiet += 1.0
            continue
        quiet = 0.0
        waited = time.perf_counter() - start
        if waited > max_wait_s:
            print(f"  machine still busy after {waited:.0f}s; running anyway", flush=True)
            break
        if not announced:
            print("  other processes are using the CPUs; waiting for the machine to go idle ...", flush=True)
            announced = True
    return time.perf_counter() - start


def is_contended(result: dict[str, Any]) -> bool:
    """Whether other processes used more than CONTENDED_SHARE of the machine during ``result``'s run."""
    return result["cpu"].get("foreign_share", 0.0) > CONTENDED_SHARE


# ---- the machine -------------------------------------------------------------------------------
def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def _torch_version() -> str:
    import torch

    return torch.__version__


@dataclass(slots=True, kw_only=True)
class Machine:
    """Where a bench ran; a bench's config dataclass extends it, so every report carries it."""

    nproc: int = field(default_factory=lambda: os.cpu_count() or 0)
    torch_threads: int = field(default_factory=_torch_threads)
    torch_version: str = field(default_factory=_torch_version)
    python: str = field(default_factory=platform.python_version)
    platform: str = field(default_factory=platform.platform)


# ---- pagedkv serve and its streams -------------------------------------------------------------
class Server(LocalServer):
    """``pagedkv serve`` with these flags, on a free port; waits up to ``timeout`` s for it to be ready."""

    def __init__(self, args: list[str], timeout: float = 600.0) -> None:
        super().__init__(*args, timeout=timeout)


@dataclass(slots=True)
class StreamResult:
    """One streamed request, timed from the moment the whole workload was sent."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    ttft_s: float = float("nan")
    latency_s: float = float("nan")
    finish_reason: int = 0
    cached_tokens: int = 0
    prompt_tokens: int = 0

    @property
    def tokens(self) -> int:
        return len(self.token_ids)


async def stream_one(client: Any, req: Request, t0: float) -> StreamResult:
    """Streams ``req`` (greedy, EOS ignored) and times its first token and its end from ``t0``."""
    out = StreamResult(req.index)
    async for msg in client.generate(req.prompt, max_tokens=req.max_tokens, ignore_eos=True, temperature=0):
        if msg.token_ids and not out.token_ids:
            out.ttft_s = time.perf_counter() - t0
        out.token_ids.extend(msg.token_ids)
        if msg.finish_reason:
            out.finish_reason = msg.finish_reason
            out.cached_tokens = msg.usage.cached_tokens
            out.prompt_tokens = msg.usage.prompt_tokens
    out.latency_s = time.perf_counter() - t0
    return out


async def warm_up(client: Any, prompt: list[int] = WARMUP_PROMPT) -> None:
    """Waits for the server, then one untimed 4-token request (it shares nothing with a workload)."""
    await client.wait_ready(timeout=120)
    warm = await client.complete(prompt, max_tokens=4, ignore_eos=True)
    if len(warm.token_ids) != 4:
        raise RuntimeError(f"warm-up returned {len(warm.token_ids)} tokens, expected 4")


async def timed_streams(client: Any, reqs: Iterable[Request]) -> tuple[float, list[StreamResult], dict[str, float]]:
    """All of ``reqs`` at once: (wall seconds, results in order, CpuWatch's figures for the window)."""
    watch = CpuWatch()
    t0 = time.perf_counter()
    results = await asyncio.gather(*(stream_one(client, r, t0) for r in reqs))
    wall = time.perf_counter() - t0
    return wall, list(results), watch.stop()


def check_lengths(reqs: Sequence[Request], results: Sequence[StreamResult], who: str = "request") -> None:
    """Every request got exactly the tokens it asked for (EOS is ignored, so anything else is a bug)."""
    for r, res in zip(reqs, results, strict=True):
        if res.tokens != r.max_tokens:
            raise RuntimeError(f"{who} {r.index}: {res.tokens} tokens, asked for {r.max_tokens}")


# ---- output ------------------------------------------------------------------------------------
def format_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Left-aligned columns separated by ' | ', a dashed rule under the header."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    lines = [" | ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)),
             "-+-".join("-" * w for w in widths)]
    lines += [" | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(lines)


def print_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    print(format_table(header, rows))


def write_report(path: Path | str, report: dict[str, Any], indent: int = 2) -> Path:
    """Writes ``report`` as JSON (creating the folder) and says where."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=indent) + "\n")
    print(f"wrote {path}")
    return path
