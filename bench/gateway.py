"""The HTTP gateway's overhead against the scheduler's gRPC API, on one executor + scheduler + gateway started
here on loopback (tiny-llama, CPU), in one run:

1. Added latency per request: ``--requests`` one-token greedy completions, alternating gRPC (pagedkv Client) and
   HTTP (POST /v1/completions, not streamed, keep-alive); p50 of each path and the p50 of the paired differences.
2. Added latency per streamed token: ``--stream-pairs`` pairs of identical greedy streams (``--stream-tokens``
   tokens, logprobs on so every token is its own message/chunk), the gRPC and the SSE stream of a pair started
   together; for each token, its arrival over SSE minus the arrival over gRPC of the token the same step made
   (see per_token on the alignment), and the gateway's own relay time per chunk (gRPC message read -> SSE bytes
   written, its pagedkv_gateway_relay_seconds histogram). Also the inter-token gap p50 of each path.
3. Throughput at ``--concurrency`` concurrent streams (256), ``--concurrent-tokens`` tokens each: tokens/s over
   gRPC directly and over SSE through the gateway (``--rounds`` alternating rounds, the median one), and the CPU
   the gateway process and this client spent per streamed token.

Everything (executor, scheduler, gateway and this client) shares this machine's cores, so 3. measures the
whole stack under the gateway's extra CPU, not the gateway alone; the CPU per token is the machine-independent
figure. HTTP is parsed by httpx (the transport the openai SDK uses) with a minimal SSE reader, so the client's
own cost stays small on both paths.

    python bench/gateway.py            # -> bench/results/gateway.json
    python bench/gateway.py --quick    # smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time

from common import RESULTS, percentile, print_table, wait_idle, write_report

from pagedkv.client import Client
from pagedkv.local_server import ServiceProcess

CLK_TCK = os.sysconf("SC_CLK_TCK")
BOS_ID = 1


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        rest = f.read().rsplit(")", 1)[1].split()
    return (int(rest[11]) + int(rest[12])) / CLK_TCK


def prompt(i: int, length: int = 8) -> list[int]:
    return [BOS_ID] + [3 + (i * 7 + j * 13) % 250 for j in range(length - 1)]


class Http:
    def __init__(self, base: str, connections: int) -> None:
        import httpx2

        self.client = httpx2.AsyncClient(base_url=base, timeout=None, limits=httpx2.Limits(
            max_connections=connections, max_keepalive_connections=connections))

    async def close(self) -> None:
        await self.client.aclose()

    async def complete(self, body: dict) -> dict:
        r = await self.client.post("/v1/completions", json=body)
        r.raise_for_status()
        return r.json()

    async def stream(self, body: dict, arrivals: list[float] | None = None) -> tuple[int, float]:
        """(completion tokens, time to first token); appends each token's arrival time to ``arrivals``."""
        t0, ttft, tokens = time.perf_counter(), 0.0, 0
        async with self.client.stream("POST", "/v1/completions", json={**body, "stream": True,
                                                                       "stream_options": {"include_usage": True}}) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(chunk["error"]["message"])
                now = time.perf_counter()
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                for c in chunk["choices"]:
                    if c.get("logprobs") and arrivals is not None:
                        arrivals.extend([now] * len(c["logprobs"]["tokens"]))
                    if not ttft and (c.get("text") or c.get("logprobs")):
                        ttft = now - t0
        return tokens, ttft


async def grpc_stream(client: Client, ids: list[int], params: dict, arrivals: list[float] | None = None
                      ) -> tuple[int, float]:
    t0, ttft, tokens = time.perf_counter(), 0.0, 0
    async for msg in client.generate(ids, **params):
        now = time.perf_counter()
        if msg.token_ids:
            if arrivals is not None:
                arrivals.extend([now] * len(msg.token_ids))
            if not ttft:
                ttft = now - t0
        if msg.finish_reason:
            tokens = msg.usage.completion_tokens
    return tokens, ttft


async def per_request(client: Client, http: Http, n: int) -> dict:
    grpc_s, http_s = [], []
    for i in range(n):
        ids = prompt(i)
        order = (0, 1) if i % 2 else (1, 0)
        for which in order:
            t0 = time.perf_counter()
            if which == 0:
                out = await client.complete(ids, max_tokens=1, temperature=0, ignore_eos=True)
                assert len(out.token_ids) == 1
                grpc_s.append(time.perf_counter() - t0)
            else:
                out = await http.complete({"model": "tiny-llama", "prompt": ids, "max_tokens": 1, "temperature": 0,
                                           "ignore_eos": True})
                assert out["usage"]["completion_tokens"] == 1
                http_s.append(time.perf_counter() - t0)
    diffs = [h - g for h, g in zip(http_s, grpc_s)]
    return {"requests": n, "grpc_p50_ms": percentile(grpc_s, 50) * 1e3, "http_p50_ms": percentile(http_s, 50) * 1e3,
            "grpc_p90_ms": percentile(grpc_s, 90) * 1e3, "http_p90_ms": percentile(http_s, 90) * 1e3,
            "added_p50_ms": percentile(diffs, 50) * 1e3}


async def per_token(client: Client, http: Http, pairs: int, tokens: int, metrics_url: str) -> dict:
    """The two streams of a pair are in one batch, but the gateway's hop may make the HTTP request miss the step
    that admitted the gRPC one: then its token i comes from the step of gRPC token i + k. Both streams are sent
    by the scheduler at the same instant only for tokens of the same step, so each pair is aligned at the
    largest shift k (0..3) whose median delta is still >= 0 (SSE cannot arrive before gRPC for the same step;
    this assumes the overhead is under one step, which the gateway's own relay time below confirms). A
    background stream keeps steps running between pairs."""
    background = asyncio.ensure_future(grpc_stream(client, prompt(999), dict(max_tokens=100_000, temperature=0,
                                                                             ignore_eos=True)))
    await asyncio.sleep(0.5)
    relay0 = await relay_seconds(metrics_url)
    deltas, raw, itl_grpc, itl_http, shifts = [], [], [], [], [0, 0, 0, 0]
    try:
        for k in range(pairs):
            ids = prompt(1000 + k)
            g_arr: list[float] = []
            h_arr: list[float] = []
            params = dict(max_tokens=tokens, temperature=0, ignore_eos=True, logprobs=True)
            body = {"model": "tiny-llama", "prompt": ids, "max_tokens": tokens, "temperature": 0,
                    "ignore_eos": True, "logprobs": 0}
            (g, _), (h, _) = await asyncio.gather(grpc_stream(client, ids, params, g_arr), http.stream(body, h_arr))
            assert g == h == tokens == len(g_arr) == len(h_arr), (g, h, len(g_arr), len(h_arr))
            itl_grpc += [b - a for a, b in zip(g_arr, g_arr[1:])]
            itl_http += [b - a for a, b in zip(h_arr, h_arr[1:])]
            raw += [b - a for a, b in zip(g_arr[1:], h_arr[1:])]
            shift = max(s for s in range(4) if s == 0 or percentile(
                [h_arr[i] - g_arr[i + s] for i in range(1, tokens - s)], 50) >= 0)
            shifts[shift] += 1
            deltas += [h_arr[i] - g_arr[i + shift] for i in range(1, tokens - shift)]
    finally:
        background.cancel()
    relay1 = await relay_seconds(metrics_url)
    chunks = relay1[1] - relay0[1]
    return {"pairs": pairs, "admission_shift_counts": shifts, "tokens_per_stream": tokens,
            "added_p50_ms": percentile(deltas, 50) * 1e3, "added_p90_ms": percentile(deltas, 90) * 1e3,
            "unaligned_added_p50_ms": percentile(raw, 50) * 1e3,
            "gateway_relay_mean_ms": (relay1[0] - relay0[0]) / max(chunks, 1) * 1e3, "relayed_chunks": chunks,
            "grpc_itl_p50_ms": percentile(itl_grpc, 50) * 1e3, "http_itl_p50_ms": percentile(itl_http, 50) * 1e3}


async def relay_seconds(metrics_url: str) -> tuple[float, float]:
    """(sum, count) of the gateway's pagedkv_gateway_relay_seconds histogram."""
    import urllib.request

    text = await asyncio.to_thread(lambda: urllib.request.urlopen(metrics_url, timeout=10).read().decode())
    values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
              if line.startswith("pagedkv_gateway_relay_seconds_")}
    return values.get("pagedkv_gateway_relay_seconds_sum", 0.0), values.get("pagedkv_gateway_relay_seconds_count",
                                                                            0.0)


async def concurrent(client: Client, http: Http, gateway_pid: int, streams: int, tokens: int, rounds: int) -> dict:
    """``rounds`` alternating rounds per path (other jobs on this machine come and go); the median round each."""
    # warm-up at full concurrency: HTTP/1.1 streams need a connection each (gRPC multiplexes one); open them
    await asyncio.gather(*(http.stream({"model": "tiny-llama", "prompt": prompt(i), "max_tokens": 1})
                           for i in range(streams)))
    runs: dict[str, list[dict]] = {"grpc": [], "http": []}
    for _ in range(rounds):
        for path in ("grpc", "http"):
            runs[path].append(await _one_round(client, http, gateway_pid, path, streams, tokens))
    out: dict = {}
    for path, rs in runs.items():
        ordered = sorted(rs, key=lambda r: r["tokens_per_s"])
        out[path] = {**ordered[len(ordered) // 2], "rounds_tokens_per_s": [r["tokens_per_s"] for r in rs]}
    out["throughput_ratio"] = out["http"]["tokens_per_s"] / out["grpc"]["tokens_per_s"]
    return out


async def _one_round(client: Client, http: Http, gateway_pid: int, path: str, streams: int, tokens: int) -> dict:
    cpu0, client0 = cpu_seconds(gateway_pid), time.process_time()
    t0 = time.perf_counter()
    if path == "grpc":
        params = dict(max_tokens=tokens, temperature=0, ignore_eos=True)
        results = await asyncio.gather(*(grpc_stream(client, prompt(5000 + i), params) for i in range(streams)),
                                       return_exceptions=True)
    else:
        results = await asyncio.gather(*(http.stream({"model": "tiny-llama", "prompt": prompt(5000 + i),
                                                      "max_tokens": tokens, "temperature": 0, "ignore_eos": True})
                                         for i in range(streams)), return_exceptions=True)
    wall = time.perf_counter() - t0
    ok = [r for r in results if not isinstance(r, BaseException)]
    errors = [repr(r)[:200] for r in results if isinstance(r, BaseException)]
    total = sum(t for t, _ in ok)
    gw_cpu, client_cpu = cpu_seconds(gateway_pid) - cpu0, time.process_time() - client0
    return {"streams": streams, "ok": len(ok), "errors": len(errors), "first_errors": errors[:3], "tokens": total,
            "wall_s": wall, "tokens_per_s": total / wall, "ttft_p50_ms": percentile([f for _, f in ok], 50) * 1e3,
            "gateway_cpu_s": gw_cpu, "gateway_cpu_us_per_token": gw_cpu / max(total, 1) * 1e6,
            "client_cpu_us_per_token": client_cpu / max(total, 1) * 1e6}


async def run(args, gateway: ServiceProcess, scheduler: ServiceProcess) -> dict:
    base = f"http://127.0.0.1:{gateway.port}"
    async with Client(scheduler.address) as client:
        http = Http(base, args.concurrency + 8)
        try:
            for i in range(8):  # warm-up: both paths, connections open
                await client.complete(prompt(i), max_tokens=4, ignore_eos=True)
                await http.complete({"model": "tiny-llama", "prompt": prompt(i), "max_tokens": 4, "ignore_eos": True})
            report = {"per_request": await per_request(client, http, args.requests),
                      "per_token": await per_token(client, http, args.stream_pairs, args.stream_tokens,
                                                   f"{base}/metrics")}
            report["concurrent"] = await concurrent(client, http, gateway.proc.pid, args.concurrency,
                                                    args.concurrent_tokens, args.rounds)
        finally:
            await http.close()
    return report


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--stream-pairs", type=int, default=20)
    p.add_argument("--stream-tokens", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=256)
    p.add_argument("--concurrent-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds per path at --concurrency")
    p.add_argument("--quick", action="store_true", help="a smoke run: few requests, 32 streams")
    p.add_argument("--max-wait-idle", type=float, default=60.0)
    p.add_argument("--out", default=str(RESULTS / "gateway.json"))
    args = p.parse_args()
    if args.quick:
        args.requests, args.stream_pairs, args.concurrency, args.rounds = 20, 4, 32, 1
    wait_idle(args.max_wait_idle)
    executor = ServiceProcess("executor", "--num-pages", "4096", "--threads", "1")
    procs = [executor]
    try:
        scheduler = ServiceProcess("scheduler", "--executor", executor.address, "--max-num-seqs", "512")
        procs.append(scheduler)
        gateway = ServiceProcess("gateway", "--address", scheduler.address, "--max-streams", "4096")
        procs.append(gateway)
        report = asyncio.run(run(args, gateway, scheduler))
    finally:
        for proc in reversed(procs):
            proc.stop()
    report["machine"] = {"cpus": os.cpu_count(), "load_avg_1m": os.getloadavg()[0]}
    r, t, c = report["per_request"], report["per_token"], report["concurrent"]
    print_table(["what", "gRPC direct", "HTTP gateway", "added"], [
        ["request p50 (1 token, not streamed)", f"{r['grpc_p50_ms']:.2f} ms", f"{r['http_p50_ms']:.2f} ms",
         f"{r['added_p50_ms']:+.2f} ms (paired p50)"],
        ["streamed token delivery p50 (same step)", "-", "-",
         f"{t['added_p50_ms']:+.2f} ms (p90 {t['added_p90_ms']:+.2f})"],
        ["  gateway relay per chunk (its own, mean)", "-", f"{t['gateway_relay_mean_ms']:.3f} ms", ""],
        ["inter-token gap p50", f"{t['grpc_itl_p50_ms']:.2f} ms", f"{t['http_itl_p50_ms']:.2f} ms", ""],
        [f"{c['grpc']['streams']} concurrent streams x {args.concurrent_tokens} tokens",
         f"{c['grpc']['tokens_per_s']:.0f} tok/s", f"{c['http']['tokens_per_s']:.0f} tok/s",
         f"x{c['throughput_ratio']:.2f}"],
        ["  TTFT p50", f"{c['grpc']['ttft_p50_ms']:.0f} ms", f"{c['http']['ttft_p50_ms']:.0f} ms", ""],
        ["  errors", str(c["grpc"]["errors"]), str(c["http"]["errors"]), ""],
        ["  gateway CPU per streamed token", "-", f"{c['http']['gateway_cpu_us_per_token']:.0f} us", ""],
        ["  client CPU per streamed token", f"{c['grpc']['client_cpu_us_per_token']:.0f} us",
         f"{c['http']['client_cpu_us_per_token']:.0f} us", ""],
    ])
    print(f"machine: {os.cpu_count()} CPUs shared by executor, scheduler, gateway and this client")
    write_report(args.out, report)


if __name__ == "__main__":
    main()
