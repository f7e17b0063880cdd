"""Shared fixtures: a hermetic model cache, small HF models, and real server processes on loopback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path

import pytest

from pagedkv.cli import free_port

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session", autouse=True)
def model_cache(tmp_path_factory) -> Path:
    """Every test (and every process it starts) builds tiny-llama into a fresh cache of its own."""
    path = tmp_path_factory.mktemp("pagedkv-cache")
    os.environ["PAGEDKV_CACHE_DIR"] = str(path)
    return path


@pytest.fixture(scope="session")
def tiny_llama_dir(model_cache) -> Path:
    from pagedkv.models import resolve_model

    return resolve_model("tiny-llama")


@pytest.fixture(scope="session")
def qwen2_dir(tmp_path_factory) -> Path:
    """A random Qwen2-style model (qkv bias, tied embeddings) built and saved by the test itself."""
    from pagedkv.models import build_random_model

    return build_random_model(tmp_path_factory.mktemp("qwen2-tiny"), arch="qwen2", seed=7, hidden_size=192,
                              intermediate_size=512, num_layers=3, num_heads=6, num_kv_heads=2)


class Server:
    """``pagedkv serve`` as a child process; its output is kept for failure messages."""

    def __init__(self, *args: str, timeout: float = 180.0) -> None:
        self.port = free_port()
        cmd = [sys.executable, "-m", "pagedkv", "serve", "--port", str(self.port),
               "--log-format", "console", *args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     cwd=ROOT, start_new_session=True)
        self.lines: deque[str] = deque(maxlen=400)
        self.ready = threading.Event()
        threading.Thread(target=self._pump, daemon=True).start()
        if not self.ready.wait(timeout):
            self.stop()
            raise RuntimeError(f"server not ready after {timeout}s:\n" + self.log())
        if self.proc.poll() is not None:
            raise RuntimeError(f"server exited with {self.proc.returncode}:\n" + self.log())

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip())
            if "pagedkv ready" in line:
                self.ready.set()
        self.ready.set()

    def log(self) -> str:
        return "\n".join(self.lines)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        return self.proc.returncode


@pytest.fixture
def start_server():
    servers: list[Server] = []

    def start(*args: str) -> Server:
        s = Server(*args)
        servers.append(s)
        return s

    yield start
    for s in servers:
        s.stop()


def wait_until(predicate, timeout: float = 10.0, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()
