"""Resume on scheduler death: the largest gap a client stream sees across a scheduler's SIGKILL, and whether the
stream is still exactly the undisturbed one.

tiny-llama on CPU, ``--streams`` (48) streams at once from one ``pagedkv.client.Client`` (two thirds greedy, a third
seeded sampling; EOS ignored, ``--max-tokens`` 128 each). One undisturbed run, then the same run while a scheduler is
SIGKILLed ``--kills`` (3) times, each once the streams have received another share of their tokens. Two deployments:

- ``restart``: one ``pagedkv serve``; its supervisor restarts the killed scheduler (backoff 1 s, then 2 s, 4 s: they
  double while it keeps dying within a minute), which takes the executor over; the clients resume there. The gap is
  the restart: backoff + the scheduler's start + reconnecting + recomputing the received tokens.
- ``failover``: two ``pagedkv serve`` (each its own executor, ``--threads 1``), the Client given both addresses
  (client-side round robin); each kill hits the other server's scheduler (the one killed before is back by then).
  The streams of the killed scheduler resume on the survivor at once; the gap is noticing the break, the new call
  and the recompute there.

A resumed call's first message carries the seed again, so the bench sees which streams resumed and when: a stream's
gap across a kill is from its last token before the break to the first token of the resumed call.

    python bench/resume.py                    # both modes -> bench/results/resume.json
    python bench/resume.py --modes failover --streams 16
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import time
from typing import Any

from common import ROOT, Server, make_workload, percentile, wait_idle, write_report

from pagedkv.client import Client, Completion, accumulate
from pagedkv.models import resolve_model

VOCAB = 259  # tiny-llama's byte vocabulary


def workload(n: int, max_tokens: int) -> list[tuple[list[int], dict]]:
    reqs = make_workload(n, seed=29, vocab_size=VOCAB, prompt_range=(16, 96), output_range=(max_tokens, max_tokens))
    out = []
    for i, r in enumerate(reqs):
        params = dict(max_tokens=r.max_tokens, ignore_eos=True, temperature=0.0)
        if i % 3 == 2:
            params.update(temperature=0.9, top_p=0.95, seed=700 + i)
        out.append((r.prompt, params))
    return out


class Stream:
    def __init__(self) -> None:
        self.out = Completion()
        self.token_times: list[float] = []
        self.resumed_at: list[tuple[float, float]] = []  # (last token before the break, first token after)
        self.error = ""


async def one(client: Client, prompt, params, s: Stream) -> None:
    first = True
    try:
        async for msg in client.generate(prompt, **params):
            now = time.perf_counter()
            if msg.HasField("seed") and not first and s.token_times:  # a resumed call's first message
                s.resumed_at.append((s.token_times[-1], now))
            first = False
            if msg.token_ids:
                s.token_times.append(now)
            accumulate(s.out, msg)
    except Exception as err:  # noqa: BLE001 -- counted, not raised: the table says how many
        s.error = f"{type(err).__name__}: {err}"


async def run(address: str, reqs, killer=None) -> tuple[list[Stream], list[float]]:
    streams = [Stream() for _ in reqs]
    kills: list[float] = []
    async with Client(address) as client:
        await client.wait_ready(120)
        tasks = [asyncio.create_task(one(client, p, kw, s)) for (p, kw), s in zip(reqs, streams)]
        if killer is not None:
            await killer(streams, kills)
        await asyncio.gather(*tasks)
    return streams, kills


def make_killer(servers: list[Server], shares: list[float], total: int):
    """Kills a scheduler each time the streams have ``share`` of ``total`` tokens: with one server its (restarted)
    scheduler, with two each in turn (after the one killed before serves again)."""
    async def killer(streams: list[Stream], kills: list[float]) -> None:
        for k, share in enumerate(shares):
            while sum(len(s.out.token_ids) for s in streams) < share * total:
                await asyncio.sleep(0.005)
            server = servers[k % len(servers)]
            while (pid := server.scheduler_pid()) is None:
                await asyncio.sleep(0.01)
            if len(servers) > 1:  # the other one must be serving again before this one goes
                other = servers[(k + 1) % len(servers)]
                async with Client(other.address) as probe:
                    await probe.wait_ready(120)
            kills.append(time.perf_counter())
            os.kill(pid, signal.SIGKILL)
    return killer


def gaps_by_kill(streams: list[Stream], kills: list[float]) -> list[list[float]]:
    """For each kill, the gaps of the streams that resumed after it (before the next kill)."""
    out: list[list[float]] = [[] for _ in kills]
    for s in streams:
        for before, after in s.resumed_at:
            k = max((i for i, t in enumerate(kills) if t <= after), default=None)
            if k is not None:
                out[k].append(after - before)
    return out


def measure(mode: str, args) -> dict[str, Any]:
    reqs = workload(args.streams, args.max_tokens)
    common_args = ["--num-pages", str(args.num_pages), "--threads", "1"]
    n = 1 if mode == "restart" else 2
    servers: list[Server] = []
    try:
        for _ in range(n):
            servers.append(Server(common_args))
        address = ",".join(s.address for s in servers)
        reference, _ = asyncio.run(run(address, reqs))
        shares = [(k + 1) / (args.kills + 2) for k in range(args.kills)]
        t0 = time.perf_counter()
        streams, kills = asyncio.run(run(address, reqs, make_killer(servers, shares, args.max_tokens * len(reqs))))
        wall = time.perf_counter() - t0
    finally:
        for s in servers:
            s.stop()
    compared = [(a, b) for a, b in zip(reference, streams)]
    differ = sum(1 for a, b in compared if (a.out.token_ids, a.out.text) != (b.out.token_ids, b.out.text))
    per_kill = gaps_by_kill(streams, kills)
    every = [g for gs in per_kill for g in gs]
    itl = [b - a for s in reference for a, b in zip(s.token_times, s.token_times[1:])]
    return {"mode": mode, "streams": len(reqs), "kills": len(kills), "wall_s": wall,
            "differ": differ, "errors": [s.error for s in streams if s.error],
            "incomplete": sum(1 for s in streams if len(s.out.token_ids) != args.max_tokens),
            "undisturbed_itl_p50_s": percentile(itl, 50), "undisturbed_itl_max_s": max(itl) if itl else float("nan"),
            "gap_p50_s": percentile(every, 50), "gap_max_s": max(every) if every else float("nan"),
            "per_kill": [{"resumed": len(g), "gap_p50_s": percentile(g, 50),
                          "gap_max_s": max(g) if g else float("nan")} for g in per_kill]}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--modes", default="restart,failover", help="restart (one serve), failover (two serves)")
    p.add_argument("--streams", type=int, default=48)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--kills", type=int, default=3)
    p.add_argument("--num-pages", type=int, default=1024)
    p.add_argument("--wait-idle", type=float, default=60.0,
                   help="wait up to this long for other processes to leave the CPUs before each mode (0: off)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "resume.json"))
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    resolve_model("tiny-llama")
    results = []
    for mode in args.modes.split(","):
        wait_idle(args.wait_idle)
        results.append(measure(mode, args))
        print(f"{mode}: done", file=sys.stderr)
    print(f"\nresume across a scheduler SIGKILL, tiny-llama on CPU ({os.cpu_count()} cores), {args.streams} streams "
          f"of {args.max_tokens} tokens (2/3 greedy, 1/3 seeded)\n")
    print("| mode | kill | streams resumed | gap p50 (s) | gap max (s) |")
    print("|---|---|---|---|---|")
    for r in results:
        for k, row in enumerate(r["per_kill"], 1):
            print(f"| {r['mode']} | {k} | {row['resumed']} | {row['gap_p50_s']:.2f} | {row['gap_max_s']:.2f} |")
        print(f"| {r['mode']} | all | {sum(x['resumed'] for x in r['per_kill'])} | {r['gap_p50_s']:.2f} | "
              f"{r['gap_max_s']:.2f} |")
    print()
    for r in results:
        print(f"{r['mode']}: {r['differ']} of {r['streams']} streams differ from the undisturbed run, "
              f"{len(r['errors'])} errors, {r['incomplete']} incomplete; undisturbed inter-token gap p50 "
              f"{r['undisturbed_itl_p50_s'] * 1e3:.0f} ms, max {r['undisturbed_itl_max_s'] * 1e3:.0f} ms; "
              f"{r['wall_s']:.1f} s with {r['kills']} kills")
    write_report(args.out, {"config": vars(args), "results": results})
    return 0 if all(not r["differ"] and not r["errors"] and not r["incomplete"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
