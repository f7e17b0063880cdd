"""The gateway under issue 29's HTTP probes, unauthenticated, over loopback: executor + scheduler (tiny-llama, CPU)
started from this checkout, the gateway from ``--gateway-root`` (default: this checkout), so one command gives the
before and the after figures of a change to the gateway alone.

1. Big headers: one request to /health/live with a ``--header-mb`` MB header (sent by a thread while the answer is
   read): its status and the time from the first byte sent to the status line.
2. A bystander during the header attack: two connections sending such headers in a loop for ``--attack-s`` s while
   another client starts a one-token completion every 0.2 s; their latency p50/p90 against the same client's
   with no attack, and the gateway's peak RSS.
3. Slowloris, on a fresh gateway: ``--slow-connections`` connections that each send a request line, then a header
   line every 0.5-1 s; how many the gateway closed within ``--slow-cap-s`` s and when, and its RSS with them open.
4. Refusals: ``[`` x 100,000 as a body, a 1 MiB prompt, a 200 KiB prompt, a GET on a POST endpoint, two
   Authorization headers: the status and error type each got (and whether the gateway logged a traceback).
5. What the bounds cost, in this process: CPU per keep-alive request (a 400-byte POST) through uvicorn's httptools
   protocol, the gateway's bounded one (this checkout's), and h11 (the stack that bounds a head by itself), to a
   trivial ASGI app; rounds in alternating order, the median.

    python bench/gateway_attacks.py                          # -> bench/results/gateway_attacks.json
    python bench/gateway_attacks.py --gateway-root ../before --out bench/results/gateway_attacks_before.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import threading
import time
from pathlib import Path

from common import RESULTS, ROOT, percentile, print_table, wait_idle, write_report
from gateway_attacks_cost import guard_cost

# (completion: bench/response_budget.py imports it, GatewayProcess, RssPeak and completion_latencies from here)
from gateway_attacks_target import MODEL, GatewayProcess, RssPeak, completion, completion_latencies  # noqa: F401

from pagedkv.local_server import ServiceProcess


# ---- 1. and 2.: big headers ---------------------------------------------------------------------
def _send_quietly(sock: socket.socket, data: bytes) -> None:
    try:
        sock.sendall(data)
    except OSError:
        pass  # the gateway closed the connection: what a bounded server does


def big_header(port: int, payload: bytes, timeout: float = 120.0) -> tuple[int | None, float]:
    """(status, seconds from the first byte sent to the status line); status None when the connection closed
    without one."""
    sock = socket.create_connection(("127.0.0.1", port))
    sock.settimeout(timeout)
    t0 = time.perf_counter()
    sender = threading.Thread(target=_send_quietly, args=(sock, payload), daemon=True)
    sender.start()
    got = b""
    try:
        while b"\r\n" not in got:
            chunk = sock.recv(4096)
            if not chunk:
                break
            got += chunk
    except OSError:
        pass
    elapsed = time.perf_counter() - t0
    sock.close()
    sender.join(timeout)
    parts = got.split(b" ", 2)
    return (int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else None), elapsed


def header_payload(mb: int) -> bytes:
    return b"GET /health/live HTTP/1.1\r\nHost: gateway\r\nX-Big: " + b"a" * (mb << 20) + b"\r\n\r\n"


def bystander(gateway: GatewayProcess, payload: bytes, seconds: float) -> dict:
    idle = completion_latencies(gateway.port, min(seconds, 5.0))
    stop = threading.Event()
    attacks = [0, 0]

    def attack(i: int) -> None:
        while not stop.is_set():
            big_header(gateway.port, payload)
            attacks[i] += 1

    peak = RssPeak(gateway)
    rss0 = gateway.rss_mb()
    threads = [threading.Thread(target=attack, args=(i,), daemon=True) for i in range(2)]
    for t in threads:
        t.start()
    busy = completion_latencies(gateway.port, seconds)
    stop.set()
    for t in threads:
        t.join(180)
    return {"idle_p50_ms": percentile(idle, 50) * 1e3, "idle_p90_ms": percentile(idle, 90) * 1e3,
            "attack_p50_ms": percentile(busy, 50) * 1e3, "attack_p90_ms": percentile(busy, 90) * 1e3,
            "attack_completions": len(busy), "attack_headers_sent": sum(attacks), "rss_before_mb": rss0,
            "rss_peak_mb": peak.stop()}


# ---- 3.: slowloris --------------------------------------------------------------------------------
async def _slow_client(port: int, cap: float, t0: float) -> float | None:
    """Seconds until the gateway closed this connection (None: still open at ``cap``)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /health/live HTTP/1.1\r\nHost: gateway\r\n")

    async def closed() -> float:
        while await reader.read(65536):
            pass
        return time.perf_counter() - t0

    waiter = asyncio.ensure_future(closed())
    try:
        i = 0
        while not waiter.done() and time.perf_counter() - t0 < cap:
            await asyncio.wait({waiter}, timeout=random.uniform(0.5, 1.0))
            if not waiter.done():
                writer.write(b"X-Slow-%d: %d\r\n" % (i, i))
                i += 1
        return waiter.result() if waiter.done() else None
    except (OSError, ConnectionError):
        return time.perf_counter() - t0
    finally:
        waiter.cancel()
        writer.close()


async def _slowloris(gateway: GatewayProcess, n: int, cap: float) -> dict:
    t0 = time.perf_counter()
    peak = RssPeak(gateway)
    clients = [asyncio.ensure_future(_slow_client(gateway.port, cap, t0)) for _ in range(n)]
    await asyncio.sleep(min(5.0, cap / 2))
    rss_open = gateway.rss_mb()
    results = await asyncio.gather(*clients, return_exceptions=True)
    closed = [r for r in results if isinstance(r, float)]
    return {"connections": n, "cap_s": cap, "closed": len(closed), "still_open_at_cap": results.count(None),
            "close_p50_s": percentile(closed, 50), "close_max_s": max(closed, default=float("nan")),
            "rss_with_them_open_mb": rss_open, "rss_peak_mb": peak.stop()}


# ---- 4.: refusals ---------------------------------------------------------------------------------
def _request(port: int, method: str, path: str, body: bytes = b"", headers=()) -> tuple[int, str]:
    sock = socket.create_connection(("127.0.0.1", port), timeout=120)
    head = [f"{method} {path} HTTP/1.1", "Host: gateway", "Connection: close", "Content-Type: application/json",
            f"Content-Length: {len(body)}", *headers]
    _send_quietly(sock, ("\r\n".join(head) + "\r\n\r\n").encode() + body)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except OSError:
        pass
    sock.close()
    head_bytes, _, rest = data.partition(b"\r\n\r\n")
    status = int(head_bytes.split(b" ", 2)[1]) if head_bytes.startswith(b"HTTP/") else 0
    try:
        error = json.loads(rest).get("error", {})
        kind = f"{error.get('type')}" + (f" ({error.get('param')})" if error.get("param") else "")
    except ValueError:
        kind = rest[:40].decode(errors="replace")
    return status, kind


def refusals(gateway: GatewayProcess) -> dict:
    def completion(prompt) -> bytes:  # noqa: F811  (the module's completion is a re-export)
        return json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 1}).encode()

    before = gateway.tracebacks()
    cases = {
        "[ x 100,000 as the body": ("POST", "/v1/completions", b"[" * 100_000, ()),
        "1 MiB text prompt": ("POST", "/v1/completions", completion("a" * (1 << 20)), ()),
        "200 KiB text prompt": ("POST", "/v1/completions", completion("a" * (200 << 10)), ()),
        "GET /v1/completions": ("GET", "/v1/completions", b"", ()),
        "two Authorization headers": ("POST", "/v1/completions", completion("hi"),
                                      ("Authorization: Bearer a", "Authorization: Bearer b")),
    }
    out = {}
    for name, (method, path, body, headers) in cases.items():
        status, kind = _request(gateway.port, method, path, body, headers)
        out[name] = {"status": status, "error": kind}
    time.sleep(0.5)  # the log pump
    out["tracebacks_logged"] = gateway.tracebacks() - before
    return out


# ---- the run ----------------------------------------------------------------------------------------
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gateway-root", default=str(ROOT), metavar="DIR", help="run the gateway from this checkout")
    p.add_argument("--gateway-args", default="", help="extra gateway flags, space-separated")
    p.add_argument("--header-mb", type=int, default=64)
    p.add_argument("--attack-s", type=float, default=10.0, help="seconds of header attack the bystander runs in")
    p.add_argument("--slow-connections", type=int, default=200)
    p.add_argument("--slow-cap-s", type=float, default=30.0, help="how long the slowloris clients keep trickling")
    p.add_argument("--max-wait-idle", type=float, default=0.0)
    p.add_argument("--out", default=str(RESULTS / "gateway_attacks.json"))
    args = p.parse_args()
    wait_idle(args.max_wait_idle)
    root = Path(args.gateway_root).resolve()
    executor = ServiceProcess("executor", "--num-pages", "256", "--threads", "1")
    procs: list = [executor]
    try:
        scheduler = ServiceProcess("scheduler", "--executor", executor.address)
        procs.append(scheduler)
        gateway = GatewayProcess(root, scheduler.address, *args.gateway_args.split())
        procs.append(gateway)
        completion_latencies(gateway.port, 1.0)  # warm-up
        idle_rss = gateway.rss_mb()
        payload = header_payload(args.header_mb)
        status, seconds = big_header(gateway.port, payload)
        report = {"gateway_root": str(root), "idle_rss_mb": idle_rss,
                  "big_header": {"mb": args.header_mb, "status": status, "seconds": seconds},
                  "bystander": bystander(gateway, payload, args.attack_s)}
        gateway.stop()  # a fresh gateway: its RSS then shows the slow connections, not the big headers before
        gateway = GatewayProcess(root, scheduler.address, *args.gateway_args.split())
        procs[-1] = gateway
        report["slowloris"] = {"rss_idle_mb": gateway.rss_mb(),
                               **asyncio.run(_slowloris(gateway, args.slow_connections, args.slow_cap_s))}
        report["refusals"] = refusals(gateway)
    finally:
        for proc in reversed(procs):
            proc.stop()
    report["cpu_us_per_request"] = guard_cost()
    report["machine"] = {"cpus": os.cpu_count(), "load_avg_1m": os.getloadavg()[0]}
    b, s, h = report["bystander"], report["slowloris"], report["big_header"]
    rows = [
        [f"one {h['mb']} MB header: status, time to it", f"{h['status']} in {h['seconds']:.3f} s"],
        [f"bystander completion p50 (p90), 2 x {h['mb']} MB headers in a loop",
         f"{b['attack_p50_ms']:.1f} ms ({b['attack_p90_ms']:.1f}); idle {b['idle_p50_ms']:.1f} ms "
         f"({b['idle_p90_ms']:.1f}); {b['attack_completions']} completions, {b['attack_headers_sent']} headers"],
        ["gateway RSS: idle -> peak during the header attack",
         f"{report['idle_rss_mb']:.0f} -> {b['rss_peak_mb']:.0f} MB"],
        [f"slowloris: {s['connections']} connections closed by the gateway within {s['cap_s']:.0f} s",
         f"{s['closed']}/{s['connections']} (p50 {s['close_p50_s']:.1f} s, max {s['close_max_s']:.1f} s)"],
        ["gateway RSS (a fresh one): idle -> with the slow connections open (peak)",
         f"{s['rss_idle_mb']:.0f} -> {s['rss_with_them_open_mb']:.0f} MB ({s['rss_peak_mb']:.0f})"],
    ]
    rows += [[name, f"{r['status']} {r['error']}"] for name, r in report["refusals"].items() if isinstance(r, dict)]
    rows.append(["tracebacks in the gateway's log", str(report["refusals"]["tracebacks_logged"])])
    rows += [[f"CPU per request through uvicorn: {name} (in-process)", f"{us:.1f} us"]
             for name, us in report["cpu_us_per_request"].items()]
    print_table(["probe", f"gateway from {root}"], rows)
    write_report(args.out, report)


if __name__ == "__main__":
    main()
