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
import http.client
import json
import os
import random
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from common import RESULTS, ROOT, percentile, print_table, wait_idle, write_report

from pagedkv.cli import free_port
from pagedkv.local_server import ServiceProcess

MODEL = "tiny-llama"
PROMPT = [1, 72, 105, 33]


class GatewayProcess:
    """``pagedkv gateway`` run from ``root`` (its own sources first on the path); waits for gateway_ready."""

    def __init__(self, root: Path, scheduler: str, *args: str) -> None:
        self.port = free_port()
        cmd = [sys.executable, "-m", "pagedkv", "gateway", "--port", str(self.port), "--address", scheduler,
               "--log-format", "json", *args]
        self.proc = subprocess.Popen(cmd, cwd=root, env={**os.environ, "PYTHONPATH": str(root)},
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        self.lines: deque[str] = deque(maxlen=5000)
        self.ready = threading.Event()
        threading.Thread(target=self._pump, daemon=True).start()
        if not self.ready.wait(120) or self.proc.poll() is not None:
            self.stop()
            raise RuntimeError("gateway not ready:\n" + "\n".join(self.lines))

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip())
            if '"gateway_ready"' in line:
                self.ready.set()
        self.ready.set()

    def rss_mb(self) -> float:
        with open(f"/proc/{self.proc.pid}/status") as f:
            kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        return kb / 1024

    def tracebacks(self) -> int:
        return sum("Traceback" in line or "RecursionError" in line for line in list(self.lines))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class RssPeak:
    """The gateway's RSS sampled every 50 ms on a thread until stopped; the peak in MB."""

    def __init__(self, gateway: GatewayProcess) -> None:
        self.gateway, self.peak, self.done = gateway, gateway.rss_mb(), threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.done.wait(0.05):
            self.peak = max(self.peak, self.gateway.rss_mb())

    def stop(self) -> float:
        self.done.set()
        self.thread.join()
        return self.peak


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


def completion(port: int) -> float | None:
    """Seconds for one one-token greedy completion on a connection of its own (None: it failed)."""
    body = json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": 1, "temperature": 0, "ignore_eos": True})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    t0 = time.perf_counter()
    try:
        conn.request("POST", "/v1/completions", body, {"content-type": "application/json"})
        r = conn.getresponse()
        r.read()
    except (OSError, http.client.HTTPException):
        return None
    finally:
        conn.close()
    return time.perf_counter() - t0 if r.status == 200 else None


def completion_latencies(port: int, seconds: float, interval: float = 0.2) -> list[float]:
    """Completions started every ``interval`` s for ``seconds``, each on its own connection (so that one stalled
    holds up no other, and a stall shows in every request it overlaps); the latencies of those that succeeded."""
    with ThreadPoolExecutor(max_workers=64) as pool:
        futures = []
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            futures.append(pool.submit(completion, port))
            time.sleep(interval)
        return [r for r in (f.result() for f in futures) if r is not None]


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
    def completion(prompt) -> bytes:
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


# ---- 5.: the guard's cost --------------------------------------------------------------------------
class _Transport:
    def get_extra_info(self, name: str, default=None):
        return {"sockname": ("127.0.0.1", 8000), "peername": ("127.0.0.1", 5555)}.get(name, default)

    def write(self, data: bytes) -> None:
        pass

    def is_closing(self) -> bool:
        return False

    def close(self) -> None:
        pass

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


async def _trivial_app(scope, receive, send) -> None:
    await receive()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


async def _cpu_per_request(protocol_class, requests: int) -> float:
    from uvicorn.config import Config
    from uvicorn.server import ServerState

    body = json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": 1, "temperature": 0}).encode()
    raw = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:8000\r\nAccept: application/json\r\n"
           b"Content-Type: application/json\r\nUser-Agent: OpenAI/Python\r\nAuthorization: Bearer sk-0123456789\r\n"
           b"Connection: keep-alive\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    config = Config(_trivial_app, lifespan="off", log_config=None, access_log=False, timeout_keep_alive=75)
    config.load()
    state = ServerState()
    protocol = protocol_class(config=config, server_state=state, app_state={})
    protocol.connection_made(_Transport())
    t0 = time.process_time()
    for _ in range(requests):
        protocol.data_received(raw)
        await asyncio.sleep(0)  # the request's ASGI task runs
        await asyncio.sleep(0)
    seconds = time.process_time() - t0
    assert state.total_requests >= requests - 1, state.total_requests
    protocol.connection_lost(None)
    return seconds / requests


def guard_cost(requests: int = 5000, rounds: int = 8) -> dict:
    import uvloop
    from uvicorn.protocols.http.h11_impl import H11Protocol
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class Quiet:
        def info(self, *a, **k) -> None:
            pass

    stacks = {"httptools": HttpToolsProtocol, "h11": H11Protocol}
    try:
        from pagedkv.gateway.guards import bounded_protocol
    except ImportError:  # a checkout from before the gateway package, or before the bounds
        try:
            from pagedkv.gateway import bounded_protocol
        except ImportError:
            bounded_protocol = None
    if bounded_protocol is not None:
        stacks["httptools + bounds"] = bounded_protocol(Quiet())

    async def run() -> dict:
        seen: dict[str, list[float]] = {name: [] for name in stacks}
        for i in range(rounds):  # the order reversed every other round: a stack pays for its predecessor's garbage
            for name, cls in list(stacks.items())[::-1 if i % 2 else 1]:
                seen[name].append(await _cpu_per_request(cls, requests))
        return {name: percentile(v, 50) * 1e6 for name, v in seen.items()}

    return uvloop.run(run())


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
