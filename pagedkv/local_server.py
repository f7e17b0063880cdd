"""``pagedkv serve`` as a child process on loopback, for tests and benchmarks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections import deque
from pathlib import Path

from pagedkv.cli import free_port

ROOT = Path(__file__).resolve().parent.parent


class LocalServer:
    """Starts ``pagedkv serve --port <free> *args`` and waits for its ready line; keeps its output."""

    def __init__(self, *args: str, timeout: float = 180.0) -> None:
        self.port = free_port()
        cmd = [sys.executable, "-m", "pagedkv", "serve", "--port", str(self.port), "--log-format", "console", *args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     cwd=ROOT, start_new_session=True)
        self.lines: deque[str] = deque(maxlen=400)
        self.ready = threading.Event()  # set on the ready line, or when the output ends
        self.serving = False
        threading.Thread(target=self._pump, daemon=True).start()
        if not self.ready.wait(timeout):
            self.stop()
            raise RuntimeError(f"server not ready after {timeout}s:\n" + self.log())
        if not self.serving:
            code = self.proc.wait(timeout=30)
            raise RuntimeError(f"server exited with {code}:\n" + self.log())

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip())
            if "pagedkv ready" in line:
                self.serving = True
                self.ready.set()
        self.ready.set()

    def log(self) -> str:
        return "\n".join(self.lines)

    def stop(self) -> int:
        """Ctrl-C, as a user would; SIGKILL to the whole group if it does not stop within 30 s."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        return self.proc.returncode
