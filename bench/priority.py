"""Priority classes (#49 item 3): an interactive class at 1 request/s beside a batch class flooding the server, under
``--scheduling-policy fcfs`` and ``priority``, side by side in one run, on tiny-llama by default.

One ``pagedkv serve`` per policy, one at a time (``--max-num-seqs 16`` by default, so that the flood queues), with a
tenants file of four tenants: ``mixed`` (both classes of one tenant; ``max_priority = -10``), ``inter`` (the
interactive class of the two-tenant runs; ``max_priority = -10``), ``batch`` (the flood of the two-tenant runs) and
``ops`` (admin: it polls the server's counts). On each server, in this order:

* ``idle``: the interactive class alone (tenant ``inter``): the reference its TTFT p99 under the flood is held to;
* ``same tenant``: ``mixed`` floods and sends the interactive class too;
* ``two tenants``: ``batch`` floods, ``inter`` sends the interactive class.

The interactive class: ``--inter-requests`` requests (20), one every ``1 / --inter-rate`` s (1 req/s) on a fixed
schedule, each a ``--inter-prompt``-token prompt (32) asking for ``--inter-tokens`` tokens (16), priority -10. The
batch class: ``--batch-concurrency`` closed-loop workers (48: three times the seats), each sending a
``--batch-prompt``-token prompt (512) for ``--batch-tokens`` tokens (128) and the next as soon as one ends, priority
0; they start ``--flood-lead`` s (3) before the interactive class, so that the queue is full, and are cancelled when
its last request ended. Prompts are random ids from a seeded generator, distinct per request (no prefix-cache hit);
decoding is greedy, EOS ignored. Under fcfs the priorities are sent too and only order preemption victims.

Reported per server and run: the interactive class's TTFT p50 and p99 (from its own send to its first token; with
20 requests the p99 is close to the maximum), its p99 over the same server's idle p99 (target: at most 1.5 under
the flood), the batch class's output tokens/s over the interactive window (its tokens received between the first
interactive send and the last interactive end), the server's preemptions in that window (swap / recompute), and
the load average (1 min) before the run: the machine is shared. Table on stdout, JSON in
bench/results/priority.json (``--out``).

    python bench/priority.py                 # ~3 minutes on 2 CPUs
    python bench/priority.py --quick         # smoke run: 6 interactive requests, 16 batch workers
    python bench/priority.py --policies priority --trace -- --max-num-batched-tokens 256 --no-async-scheduling

``--trace`` serves at DEBUG and prints, for the slowest interactive requests, the scheduler's own parts of their
first token (``request_first_token``, scheduler_svc/ttft_trace.py: queue, prefill, behind, each prefill chunk's
step with what else it computed); they go into the JSON too (``inter_trace``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import RESULTS, Server, percentile, print_table, write_report

from pagedkv.client import Client
from pagedkv.tenancy import hash_key

KEYS = {"mixed": "key-prio-mixed", "inter": "key-prio-inter", "batch": "key-prio-batch", "ops": "key-prio-ops"}
TENANTS = "".join(f'[tenants.{t}]\nkeys = ["{hash_key(k)}"]\n' + ("max_priority = -10\n" if t in ("mixed", "inter")
                  else "admin = true\n" if t == "ops" else "") + "\n" for t, k in KEYS.items())
INTER_PRIORITY, BATCH_PRIORITY = -10, 0
RUNS = {"idle": (None, "inter"), "same tenant": ("mixed", "mixed"), "two tenants": ("batch", "inter")}
POLICIES = ("fcfs", "priority")
BOS_ID, FIRST_ID, VOCAB = 1, 3, 256  # tiny-llama's byte-level vocabulary


def prompt(rng: random.Random, length: int) -> list[int]:
    return [BOS_ID] + [rng.randrange(FIRST_ID, VOCAB) for _ in range(length - 1)]


async def _ttft(client: Client, ids: list[int], max_tokens: int, priority: int, request_id: str = "",
                ) -> tuple[float, int]:
    """(seconds from send to the first token, tokens received)."""
    sent, first, tokens = time.perf_counter(), float("nan"), 0
    async for msg in client.generate(ids, max_tokens=max_tokens, ignore_eos=True, temperature=0, priority=priority,
                                     request_id=request_id):
        if msg.token_ids and not tokens:
            first = time.perf_counter() - sent
        tokens += len(msg.token_ids)
    return first, tokens


async def interactive(client: Client, args: argparse.Namespace, seed: int, tag: str,
                      ) -> tuple[list[float], float, float]:
    """The interactive class on its schedule: (TTFTs, first send, last end)."""
    rng = random.Random(seed)
    prompts = [prompt(rng, args.inter_prompt) for _ in range(args.inter_requests)]
    t0 = time.perf_counter()

    async def one(i: int) -> float:
        await asyncio.sleep(max(0.0, t0 + i / args.inter_rate - time.perf_counter()))
        ttft, tokens = await _ttft(client, prompts[i], args.inter_tokens, INTER_PRIORITY, f"{tag}-{i}")
        if tokens != args.inter_tokens:
            raise RuntimeError(f"interactive request {i}: {tokens} tokens, asked for {args.inter_tokens}")
        return ttft

    ttfts = await asyncio.gather(*(one(i) for i in range(args.inter_requests)))
    return list(ttfts), t0, time.perf_counter()


class Flood:
    """The batch class: closed-loop workers; the times of the tokens they received (for the window's tok/s)."""

    def __init__(self, client: Client, args: argparse.Namespace, seed: int) -> None:
        self.client, self.args, self.rng = client, args, random.Random(seed)
        self.token_times: list[tuple[float, int]] = []
        self.tasks = [asyncio.create_task(self._worker()) for _ in range(args.batch_concurrency)]

    async def _worker(self) -> None:
        a = self.args
        while True:
            ids = prompt(self.rng, a.batch_prompt)
            async for msg in self.client.generate(ids, max_tokens=a.batch_tokens, ignore_eos=True, temperature=0,
                                                  priority=BATCH_PRIORITY):
                if msg.token_ids:
                    self.token_times.append((time.perf_counter(), len(msg.token_ids)))

    def tokens_between(self, start: float, end: float) -> int:
        return sum(n for t, n in self.token_times if start <= t <= end)

    async def stop(self) -> None:
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


async def _drained(ops: Client, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while (info := await ops.model_info()).num_running or info.num_waiting or info.num_swapped:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the server did not drain in {timeout} s: {info}")
        await asyncio.sleep(0.2)


async def measure(server: Server, args: argparse.Namespace, seed: int) -> dict[str, dict[str, Any]]:
    address = server.address
    clients = {t: Client(address, api_key=k, resume=None) for t, k in KEYS.items()}
    ops = clients["ops"]
    await ops.wait_ready(timeout=120)
    await clients["inter"].complete(prompt(random.Random(0), 8), max_tokens=4, ignore_eos=True)  # warm-up
    out: dict[str, dict[str, Any]] = {}
    for k, (name, (flooder, asker)) in enumerate(RUNS.items()):
        await _drained(ops)
        load = os.getloadavg()[0]
        before = await ops.model_info()
        flood = Flood(clients[flooder], args, seed + 1000 * k) if flooder else None
        if flood:
            await asyncio.sleep(args.flood_lead)
        tag = f"inter{k}"
        ttfts, start, end = await interactive(clients[asker], args, seed + k, tag)
        after = await ops.model_info()
        if flood:
            await flood.stop()
        batch_tokens = flood.tokens_between(start, end) if flood else 0
        out[name] = {
            "load_avg_1m": round(load, 2), "inter_ttft_s": [round(x, 4) for x in ttfts],
            "inter_ttft_p50_s": percentile(ttfts, 50), "inter_ttft_p99_s": percentile(ttfts, 99),
            "batch_tokens": batch_tokens, "window_s": end - start, "batch_tok_s": batch_tokens / (end - start),
            "swap_preemptions": after.num_swap_preemptions - before.num_swap_preemptions,
            "recompute_preemptions": after.num_recompute_preemptions - before.num_recompute_preemptions}
        if args.trace:
            await asyncio.sleep(0.5)  # (the last lines reach the pump)
            out[name]["inter_trace"] = traces(server, tag, ttfts)
        print(f"  {name}: TTFT p99 {out[name]['inter_ttft_p99_s'] * 1e3:.0f} ms, batch {out[name]['batch_tok_s']:.0f} "
              f"tok/s, load {load:.2f}", flush=True)
    await _drained(ops)
    for c in clients.values():
        await c.close()
    return out


TRACE_FIELDS = ("tokenize_s", "prepare_s", "queue_s", "prefill_s", "behind_s", "send_s", "ttft_s", "prefill_steps")


def traces(server: Server, tag: str, ttfts: list[float]) -> list[dict[str, Any]]:
    """The server's ``request_first_token`` breakdown of each interactive request (``--trace``), with its client
    TTFT, slowest first."""
    lines = {e["request_id"]: e for e in list(server.events) if e.get("event") == "request_first_token"
             and str(e.get("request_id", "")).startswith(tag + "-")}
    rows = []
    for i, ttft in enumerate(ttfts):
        e = lines.get(f"{tag}-{i}", {})
        rows.append({"i": i, "client_ttft_s": round(ttft, 4), **{f: e.get(f) for f in TRACE_FIELDS},
                     "chunks": e.get("chunks")})
    return sorted(rows, key=lambda r: -r["client_ttft_s"])


def print_traces(results: dict[str, Any], top: int = 6) -> None:
    for policy, runs in results.items():
        for name, r in runs.items():
            print(f"\n{policy} / {name}: the {top} slowest interactive requests, client TTFT and the server's "
                  "parts (ms)")
            print("  i  client  " + "  ".join(f.removesuffix("_s") for f in TRACE_FIELDS) + "  chunks [step, tokens, "
                  "decodes, other prefill, ms]")
            for t in r.get("inter_trace", [])[:top]:
                parts = "  ".join("-" if t[f] is None else f"{t[f] * 1e3:.1f}" if f.endswith("_s") else str(t[f])
                                  for f in TRACE_FIELDS)
                print(f"  {t['i']:>2} {t['client_ttft_s'] * 1e3:7.1f}  {parts}  {t['chunks']}")


def serve_args(args: argparse.Namespace, policy: str, tenants: Path) -> list[str]:
    trace = ["--log-format", "json", "--log-level", "debug"] if args.trace else []
    return ["--model", args.model, "--scheduling-policy", policy, "--tenants-file", str(tenants),
            "--max-num-seqs", str(args.max_num_seqs), *trace, *args.serve_args]


def table(results: dict[str, dict[str, dict[str, Any]]]) -> tuple[list[str], list[list[str]]]:
    header = ["run", "policy", "inter TTFT p50 ms", "p99 ms", "p99 / idle p99", "batch tok/s", "preempt swap/recomp",
              "load 1m"]
    rows = []
    for name in RUNS:
        for policy in results:
            r, idle = results[policy][name], results[policy]["idle"]["inter_ttft_p99_s"]
            rows.append([name, policy, f"{r['inter_ttft_p50_s'] * 1e3:.0f}", f"{r['inter_ttft_p99_s'] * 1e3:.0f}",
                         f"{r['inter_ttft_p99_s'] / idle:.2f}", f"{r['batch_tok_s']:.0f}" if name != "idle" else "-",
                         f"{r['swap_preemptions']}/{r['recompute_preemptions']}", f"{r['load_avg_1m']:.2f}"])
    return header, rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny-llama")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--inter-requests", type=int, default=20)
    p.add_argument("--inter-rate", type=float, default=1.0, help="interactive requests per second")
    p.add_argument("--inter-prompt", type=int, default=32)
    p.add_argument("--inter-tokens", type=int, default=16)
    p.add_argument("--batch-concurrency", type=int, default=48)
    p.add_argument("--batch-prompt", type=int, default=512)
    p.add_argument("--batch-tokens", type=int, default=128)
    p.add_argument("--flood-lead", type=float, default=3.0, help="seconds the flood runs before the interactive class")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="6 interactive requests, 16 batch workers")
    p.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES))
    p.add_argument("--trace", action="store_true", help="serve at DEBUG and print the server's first-token parts of "
                   "the slowest interactive requests (scheduler_svc/ttft_trace.py)")
    p.add_argument("--out", default=str(RESULTS / "priority.json"))
    p.add_argument("serve_args", nargs="*", help="more pagedkv serve flags (after --)")
    args = p.parse_args(argv)
    if args.quick:
        args.inter_requests, args.batch_concurrency = 6, 16
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        tenants = Path(tmp) / "tenants.toml"
        tenants.write_text(TENANTS)
        for policy in args.policies:  # one server at a time
            print(f"--scheduling-policy {policy}", flush=True)
            server = Server(serve_args(args, policy, tenants))
            try:
                results[policy] = asyncio.run(measure(server, args, args.seed))
            finally:
                server.stop()
    header, rows = table(results)
    if args.trace:
        print_traces(results)
    print_table(header, rows)
    write_report(args.out, {"config": vars(args), "nproc": os.cpu_count(),
                            "results": results, "table": [dict(zip(header, r, strict=True)) for r in rows]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
