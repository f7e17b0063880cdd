"""The target of gateway_attacks.py (and bench/response_budget.py): a ``pagedkv gateway`` run from a checkout, its RSS
sampled on a thread, and the one-token completion a bystander sends it, one connection each."""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from pagedkv.cli import free_port

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
