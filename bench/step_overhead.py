"""Step overhead with and without async scheduling, from the executor's own timers.

``pagedkv serve`` (tiny-llama, one executor) runs ``--running`` requests at once (32-token prompts, long outputs,
EOS ignored). Once all of them decode, a window of ``--window`` seconds is measured from the executor's metrics
(/metrics): its step time (``pagedkv_executor_step_seconds{part="total"}``), its model time (``forward``: the model
alone; building its inputs from the plan is ``prepare``) and its idle time between steps while requests are in
progress (``pagedkv_executor_idle_seconds``: sending the result, reading the next plan, waiting for it). Per mode:

    step overhead = (step wall time - forward time) / step wall time,   step wall time = idle + step

and, in the column "(inputs as forward)", the same with ``prepare`` counted as forward (as measured before the
executor timed it apart).

and the output tokens/s of the window. The scheduler's own plan and process times per step come from its
metrics. Modes alternate over ``--rounds`` rounds (one server each); medians are reported.

    python bench/step_overhead.py                 # -> bench/results/step_overhead.json
    python bench/step_overhead.py --running 64 --rounds 1
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
import urllib.request
from pathlib import Path

from common import Server, print_table, wait_idle, warm_up, write_report

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from pagedkv.cli import free_port  # noqa: E402
from pagedkv.client import Client  # noqa: E402

MAX_TOKENS = 900  # long enough to outlast settle + window; 256 x (32 + 900) tokens fit NUM_PAGES (no preemption)
NUM_PAGES = 16_000
MODES = {"sync": ["--no-async-scheduling"], "async": ["--async-scheduling"]}


def scrape(port: int) -> dict[tuple[str, str], float]:
    """Every sample of a /metrics page by (name, its ``part`` label or '')."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {(x.name, x.labels.get("part", "")): float(x.value)
            for family in text_string_to_metric_families(text) for x in family.samples}


def delta(after: dict, before: dict, name: str, part: str = "") -> float:
    return after.get((name, part), 0.0) - before.get((name, part), 0.0)


async def measure(server: Server, metrics_port: int, running: int, window: float, settle: float) -> dict:
    ex_port = metrics_port + 1
    async with Client(server.address) as client:
        await warm_up(client)
        prompts = [[1] + [(7 * i + j) % 250 + 3 for j in range(31)] for i in range(running)]
        tasks = [asyncio.create_task(client.complete(p, max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0))
                 for p in prompts]
        await asyncio.sleep(settle)  # prefill is over: every request decodes
        ex0, sc0, t0 = scrape(ex_port), scrape(metrics_port), time.perf_counter()
        await asyncio.sleep(window)
        ex1, sc1, t1 = scrape(ex_port), scrape(metrics_port), time.perf_counter()
        info = await client.model_info()
        failed = [t for t in tasks if t.done() and t.exception() is not None]
        if failed:
            raise RuntimeError(f"{len(failed)} requests failed: {failed[0].exception()}")
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    steps = delta(ex1, ex0, "pagedkv_executor_step_seconds_count", "total")
    step = delta(ex1, ex0, "pagedkv_executor_step_seconds_sum", "total")
    forward = delta(ex1, ex0, "pagedkv_executor_step_seconds_sum", "forward")
    prepare = delta(ex1, ex0, "pagedkv_executor_step_seconds_sum", "prepare")
    idle = delta(ex1, ex0, "pagedkv_executor_idle_seconds_sum")
    tokens = delta(ex1, ex0, "pagedkv_executor_tokens_total")
    plan = delta(sc1, sc0, "pagedkv_step_seconds_sum", "plan")
    process = delta(sc1, sc0, "pagedkv_step_seconds_sum", "process")
    sc_steps = max(1.0, delta(sc1, sc0, "pagedkv_step_seconds_count", "plan"))
    wall = idle + step
    return {
        "steps": steps, "running_at_end": info.num_running, "tokens_per_s": tokens / (t1 - t0),
        "step_ms": 1e3 * step / max(1, steps), "forward_ms": 1e3 * forward / max(1, steps),
        "idle_ms": 1e3 * idle / max(1, steps), "overhead": (wall - forward) / wall if wall else float("nan"),
        "prepare_ms": 1e3 * prepare / max(1, steps),
        # (as measured before the executor timed the forward's inputs apart: building them counted as forward)
        "overhead_prepare_as_forward": (wall - forward - prepare) / wall if wall else float("nan"),
        "idle_share": idle / wall if wall else float("nan"),
        "plan_ms": 1e3 * plan / sc_steps, "process_ms": 1e3 * process / sc_steps,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--running", type=int, default=256, help="requests decoding at once")
    ap.add_argument("--window", type=float, default=8.0, help="seconds measured once every request decodes")
    ap.add_argument("--settle", type=float, default=6.0, help="seconds after sending before the window starts")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="the executor's torch threads")
    ap.add_argument("--wait-idle", type=float, default=60.0, help="seconds to wait for a quiet machine per run")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "step_overhead.json"))
    args = ap.parse_args()
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    for r in range(args.rounds):
        for mode in (MODES if r % 2 == 0 else reversed(MODES)):
            wait_idle(args.wait_idle)
            load_before = os.getloadavg()[0]
            port = free_port()
            server = Server(["--max-num-seqs", str(args.running), "--max-num-batched-tokens", "2048",
                             "--threads", str(args.threads), "--num-pages", str(NUM_PAGES),
                             "--metrics-port", str(port), *MODES[mode]])
            try:
                run = asyncio.run(measure(server, port, args.running, args.window, args.settle))
            finally:
                server.stop()
            run["load_before"], run["load_after"] = load_before, os.getloadavg()[0]
            runs[mode].append(run)
            print(f"round {r + 1} {mode}: overhead {run['overhead']:.1%}, idle {run['idle_ms']:.2f} ms/step, "
                  f"{run['tokens_per_s']:.0f} tok/s, {run['running_at_end']} running", flush=True)
    med = {m: {k: statistics.median(run[k] for run in runs[m]) for k in runs[m][0]} for m in MODES}
    rows = [[m, f"{med[m]['overhead']:.1%}", f"{med[m]['overhead_prepare_as_forward']:.1%}",
             f"{med[m]['idle_ms']:.2f}", f"{med[m]['step_ms']:.1f}", f"{med[m]['prepare_ms']:.2f}",
             f"{med[m]['forward_ms']:.1f}", f"{med[m]['plan_ms']:.2f}", f"{med[m]['process_ms']:.2f}",
             f"{med[m]['tokens_per_s']:.0f}", f"{med[m]['load_before']:.2f}"] for m in MODES]
    print(f"\n{args.running} running (tiny-llama, 1 executor, {args.threads} torch thread(s)), medians of "
          f"{args.rounds} round(s)")
    print_table(["mode", "step overhead", "(inputs as forward)", "executor idle ms/step", "step ms", "prepare ms",
                 "forward ms", "plan ms", "process ms", "output tok/s", "load before"], rows)
    ratio = med["async"]["tokens_per_s"] / med["sync"]["tokens_per_s"]
    print(f"async / sync output tokens/s: {ratio:.3f}")
    write_report(args.out, {"args": vars(args), "runs": runs, "medians": med, "async_over_sync": ratio})


if __name__ == "__main__":
    main()
