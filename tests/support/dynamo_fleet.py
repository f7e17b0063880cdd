"""Two pagedkv schedulers behind NVIDIA Dynamo's frontend and KV router, all real processes on loopback, for
tests/e2e/test_dynamo_fleet.py: the tenants and secrets, Dynamo's environment (file discovery, TCP requests, ZMQ
events), the processes with their output kept, the fleet that starts and stops them, what Dynamo's router reports,
and what an answer says of the worker that served it. Imports no Dynamo itself: the test module skips without it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from pagedkv.cli import free_port
from pagedkv.local_server import ROOT, LocalServer
from pagedkv.tenancy import hash_key
from tests.conftest import wait_until

OPS_KEY, ALPHA_KEY, BETA_KEY, TIGHT_KEY = "key-fleet-ops", "key-fleet-alpha", "key-fleet-beta", "key-fleet-tight"
TENANTS = f"""
[tenants.ops]
keys = ["{hash_key(OPS_KEY)}"]
admin = true

[tenants.alpha]
keys = ["{hash_key(ALPHA_KEY)}"]

[tenants.beta]
keys = ["{hash_key(BETA_KEY)}"]

[tenants.tight]
keys = ["{hash_key(TIGHT_KEY)}"]
max_concurrent_requests = 1
max_queued_requests = 1
"""
HOP_SECRET = "hop-secret-for-the-fleet-test-0123456789"
FLEET_SECRET = "fleet-secret-for-the-fleet-test-0123456789"
NUM_PAGES = 48  # per scheduler, 16 tokens each: a handful of prompts evict the oldest pages (test_evictions...)
MODEL = "tiny-llama"
LOOPBACK = "127.0.0.1"
EXTRA = {"extra_fields": ["worker_id", "timing"]}


def dynamo_env(kv_dir: Path) -> dict[str, str]:
    """The environment every Dynamo process gets: file discovery in ``kv_dir``, TCP requests, ZMQ events, all on
    loopback (Dynamo's default is the host's address), few threads (this machine has 2 cores), no hub."""
    return {**os.environ, "DYN_DISCOVERY_BACKEND": "file", "DYN_FILE_KV": str(kv_dir), "DYN_REQUEST_PLANE": "tcp",
            "DYN_EVENT_PLANE": "zmq", "TOKIO_WORKER_THREADS": "2", "DYN_COMPUTE_THREADS": "1",
            "HF_HUB_OFFLINE": "1", "DYN_TCP_RPC_HOST": LOOPBACK, "DYN_TCP_RESPONSE_STREAM_HOST": LOOPBACK,
            "DYN_EVENT_PLANE_HOST": LOOPBACK}


class Process:
    """A process in a session of its own, its output kept (JSON lines parsed too)."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str]) -> None:
        self.name = name
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                                     env=env, start_new_session=True)
        self.lines: deque[str] = deque(maxlen=3000)
        self.events: list[dict] = []
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip())
            if line.startswith("{"):
                try:
                    self.events.append(json.loads(line))
                except ValueError:
                    pass

    def event(self, name: str) -> dict | None:
        return next((e for e in list(self.events) if e.get("event") == name), None)

    def log(self) -> str:
        return f"---- {self.name}\n" + "\n".join(list(self.lines)[-150:])

    def stop(self, timeout: float = 30.0) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        return self.proc.returncode


class Fleet:
    def __init__(self, tmp: Path) -> None:
        (tmp / "tenants.toml").write_text(TENANTS)
        (tmp / "hop.secret").write_text(HOP_SECRET)
        (tmp / "fleet.secret").write_text(FLEET_SECRET)
        self.kv_dir = tmp / "discovery"
        env = dynamo_env(self.kv_dir)
        self.processes: list[Process] = []
        self.servers: list[LocalServer] = []
        self.frontend = self.edge = None
        try:
            self._start(tmp, env)
        except BaseException:
            self.close()  # (what started does not outlive a fleet that did not come up)
            raise

    def _start(self, tmp: Path, env: dict[str, str]) -> None:
        self.http_port = free_port()
        self.processes.append(Process("frontend", [
            sys.executable, "-m", "dynamo.frontend", "--http-host", "127.0.0.1", "--http-port", str(self.http_port),
            "--router-mode", "kv", "--discovery-backend", "file", "--request-plane", "tcp", "--event-plane", "zmq",
            "--namespace", "dynamo", "--migration-limit", "3"], env))
        serve_args = ("--model", MODEL, "--threads", "1", "--num-pages", str(NUM_PAGES), "--max-model-len", "512",
                      "--tenants-file", str(tmp / "tenants.toml"), "--trusted-hop-secret-file", str(tmp / "hop.secret"),
                      "--kv-events-rpc", "--fleet-secret-file", str(tmp / "fleet.secret"))
        with ThreadPoolExecutor(2) as pool:
            starts = [pool.submit(LocalServer, *serve_args, timeout=300) for _ in range(2)]
            self.servers = [f.result() for f in starts if f.exception() is None]
            for f in starts:
                if f.exception() is not None:
                    raise f.exception()
        self.workers = [Process(f"dynamo-worker {i}", [
            sys.executable, "-m", "pagedkv", "dynamo-worker", "--model", MODEL, "--address", s.address,
            "--api-key", OPS_KEY, "--trusted-hop-secret-file", str(tmp / "hop.secret"),
            "--fleet-secret-file", str(tmp / "fleet.secret"), "--discovery-backend", "file", "--event-plane", "zmq",
            "--log-format", "json"], env) for i, s in enumerate(self.servers)]
        self.processes += self.workers
        self.gateway = Process("edge gateway", [
            sys.executable, "-m", "pagedkv", "gateway", "--port", str(gateway_port := free_port()), "--log-format",
            "json", "--edge-upstream", f"http://127.0.0.1:{self.http_port}", "--tenants-file",
            str(tmp / "tenants.toml"), "--fleet-secret-file", str(tmp / "fleet.secret")], env)
        self.processes.append(self.gateway)
        self.frontend = httpx.Client(base_url=f"http://127.0.0.1:{self.http_port}", timeout=120)
        self.edge = httpx.Client(base_url=f"http://127.0.0.1:{gateway_port}", timeout=120)
        if not wait_until(self._registered, timeout=240, interval=0.5):
            raise RuntimeError("the fleet did not come up:\n" + self.logs())
        # worker id (Dynamo's) -> the scheduler behind it
        self.server_of = {w.event("dynamo_worker_start")["worker_id"]: s for w, s in zip(self.workers, self.servers)}

    def _registered(self) -> bool:
        for p in self.processes:
            if p.proc.poll() is not None:
                raise RuntimeError(f"{p.name} exited with {p.proc.returncode}:\n" + self.logs())
        if not all(w.event("dynamo_worker_start") for w in self.workers):
            return False
        mdc = self.kv_dir / "v1" / "mdc"
        if not mdc.is_dir() or len(list(mdc.iterdir())) < 2:
            return False
        try:
            models = self.frontend.get("/v1/models").json()["data"]
            edge = self.edge.get("/health").status_code
        except (httpx.HTTPError, ValueError, KeyError):
            return False
        return [m["id"] for m in models] == [MODEL] and edge == 200

    def logs(self) -> str:
        return "\n".join(p.log() for p in self.processes) + "\n".join(s.log()[-3000:] for s in self.servers)

    def complete(self, prompt: str, via: str = "frontend", key: str = "", **body) -> dict:
        client = self.edge if via == "edge" else self.frontend
        headers = {"authorization": f"Bearer {key}"} if key else {}
        r = client.post("/v1/completions", headers=headers, json={
            "model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0, "nvext": EXTRA, **body})
        assert r.status_code == 200, r.text
        return r.json()

    def close(self) -> dict[str, int | None]:
        """Stops everything (SIGTERM, the schedulers Ctrl-C); the Dynamo processes' and the edge's exit codes."""
        for client in (self.frontend, self.edge):
            if client is not None:
                client.close()
        codes = {p.name: p.stop() for p in reversed(self.processes)}
        for s in self.servers:
            s.stop()
        return codes


def router_event_errors(fleet) -> list[str]:
    """KV events Dynamo's router could not apply (a removed page it did not know, a stored page whose parent it did
    not know), from its /metrics: a relay that kept its view equal to the scheduler's has none."""
    text = fleet.frontend.get("/metrics").text
    return [line for line in text.splitlines() if line.startswith("dynamo_component_kv_cache_events_applied")
            and 'status="ok"' not in line and not line.endswith(" 0")]


def router_events_applied(fleet) -> float:
    text = fleet.frontend.get("/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("dynamo_component_kv_cache_events_applied"))


def wait_for_the_router(fleet) -> None:
    """Until Dynamo's router applied every KV event sent so far (its count of applied events stays put): events
    reach it asynchronously, and on a loaded machine the last removals of a fill can still be on their way."""
    last = [-1.0]

    def settled() -> bool:
        now, before = router_events_applied(fleet), last[0]
        last[0] = now
        return now == before

    assert wait_until(settled, timeout=60, interval=1.0)


def worker_of(answer: dict) -> int:
    return answer["nvext"]["worker_id"]["decode_worker_id"]


def cached(answer: dict) -> int:
    return answer["usage"]["prompt_tokens_details"]["cached_tokens"]


def router_hit(answer: dict) -> float:
    return answer["nvext"]["timing"]["kv_hit_rate"]


def document(i: int, words: int = 20) -> str:
    """A prompt of ~100 tokens (tiny-llama's tokenizer is bytes) whose first page differs from every other's."""
    return f"{i:03d} document {i}: " + " ".join(f"w{(i * 7 + j) % 97}" for j in range(words))


def kill_the_busy_scheduler(fleet) -> int:
    """SIGKILLs the scheduler child of the serve whose scheduler runs a request now (serve restarts it); returns
    that serve's index."""
    import asyncio

    from pagedkv.client import Client

    async def running() -> list[int]:
        out = []
        for s in fleet.servers:
            async with Client(s.address, api_key=OPS_KEY) as c:
                out.append((await c.model_info()).num_running)
        return out

    counts = asyncio.run(running())
    busy = [s for s, n in zip(fleet.servers, counts) if n]
    assert len(busy) == 1, counts
    pid = busy[0].scheduler_pid()
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    return fleet.servers.index(busy[0])
