"""Start-up measurements the scheduler needs to choose between swap and recompute for a victim.

Both are measured with the executor's own code paths (the page mover, a real step through the model)
before the server starts, while the pools hold nothing. A measurement is kept (``costs_cached``) under the
cache directory, keyed by everything it depends on (the model's files, dtypes, device, block size, threads, the
kernels, torch and the CPU): later starts of the same executor read it instead of spending seconds on it (on a
2-core CPU the prefill probe alone took 7.5 of a 20 s start). Delete the file to measure again.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import tempfile
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from pagedkv.executor.v1 import executor_pb2 as pb


@dataclass(frozen=True, slots=True)
class Costs:
    swap_bytes_per_second: float  # 0: no host tier
    prefill_seconds_per_token: float


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best_of(fn, device: torch.device, repeats: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def swap_bandwidth(runner, max_pages: int = 64, repeats: int = 3) -> float:
    """Bytes per second of page swap-out + swap-in, pages scattered (no two adjacent) as under load."""
    mover = runner.mover
    if mover is None:
        return 0.0
    k = min(max_pages, runner.num_pages, mover.host.num_pages)  # (runner.num_pages: no scratch page)
    dev = list(range(k))
    host = list(range(k))[::-1]  # reversed: no runs to merge, one copy per page
    pairs_out, pairs_in = list(zip(dev, host)), list(zip(host, dev))

    def once() -> None:
        mover.run(pairs_out, [])
        mover.run([], pairs_in)

    seconds = _best_of(once, runner.device, repeats)
    return 2 * k * mover.host.page_bytes / seconds


def prefill_cost(runner, max_tokens: int = 256, repeats: int = 2) -> float:
    """Seconds per token of a prefill chunk (one step over a random prompt)."""
    cfg = runner.model.cfg
    bs = runner.block_size
    n = max(2, min(max_tokens, runner.num_pages * bs, cfg.max_position_embeddings - 1))
    rng = random.Random(0)
    tokens = [rng.randrange(cfg.vocab_size) for _ in range(n)]
    counter = iter(range(1 << 30))

    def once() -> None:
        rid = f"__prefill_probe_{next(counter)}"
        plan = pb.StepPlan(step_id=0)
        plan.new_requests.add(request_id=rid, token_ids=tokens, num_computed_tokens=0, num_scheduled_tokens=n,
                              page_ids=list(range(-(-n // bs))), sampling=pb.SamplingParams())
        result = runner.step(plan)
        if result.error:
            raise RuntimeError(f"prefill probe failed: {result.error}")
        runner.requests.pop(rid, None)

    seconds = _best_of(once, runner.device, repeats)
    runner.reset()
    return seconds / n


def measure_costs(runner) -> Costs:
    return Costs(swap_bandwidth(runner), prefill_cost(runner))


def cost_key(parts: Iterable[str]) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:24]


def cached_costs(runner, key: str, directory: Path) -> tuple[Costs, bool]:
    """The costs kept under ``directory`` for ``key``, else measured now and kept (best effort: a cache that
    cannot be written only means measuring again next time). Returns them and whether they were kept ones."""
    path = directory / f"costs-{key}.json"
    try:
        data = json.loads(path.read_text())
        costs = Costs(float(data["swap_bytes_per_second"]), float(data["prefill_seconds_per_token"]))
        if costs.swap_bytes_per_second >= 0 and costs.prefill_seconds_per_token > 0:
            return costs, True
    except (OSError, ValueError, TypeError, KeyError):
        pass
    costs = measure_costs(runner)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".costs-", dir=directory)
        with os.fdopen(fd, "w") as f:
            json.dump(asdict(costs), f)
        os.replace(tmp, path)
    except OSError:
        pass
    return costs, False
