"""``pagedkv serve``, or one service (executor, scheduler) alone, as a child process on loopback, for tests and
benchmarks."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
from collections import Counter, deque
from pathlib import Path

from pagedkv.cli import free_port
from pagedkv.security import EXECUTOR_SECRET_ENV

_LIFECYCLE = re.compile(r"\bchild_(?:started|ready|restarted|exited|stopping|stopped)\b")

ROOT = Path(__file__).resolve().parent.parent
# The executor secret every ServiceProcess gets unless its env says otherwise, so that the executors and
# schedulers a test or benchmark starts one by one authenticate to each other. A test value, not a secret.
TEST_EXECUTOR_SECRET = "pagedkv-test-executor-secret-0123456789abcdef"


class LocalServer:
    """Starts ``pagedkv serve --port <free> *args`` and waits for its ready line; keeps its output, and the JSON
    log events of its children when ``*args`` asks for ``--log-format json``."""

    def __init__(self, *args: str, timeout: float = 180.0, command: tuple[str, ...] = (),
                 cwd: Path | None = None, env: dict[str, str] | None = None) -> None:
        """``command``: the pagedkv to run (default: this interpreter's ``-m pagedkv``; an installed wheel's
        ``bin/pagedkv``), in ``cwd`` (default: the checkout) with ``env`` (default: this process's)."""
        self.port = free_port()
        cmd = [*(command or (sys.executable, "-m", "pagedkv")), "serve", "--port", str(self.port),
               "--log-format", "console", *args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     cwd=cwd or ROOT, env=env, start_new_session=True)
        self.lines: deque[str] = deque(maxlen=4000)
        self.lifecycle: Counter[str] = Counter()  # serve's child_* events, all of them (lines keeps the last 4000)
        self.events: list[dict] = []
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
            self.lifecycle.update(_LIFECYCLE.findall(line))
            if line.startswith("{"):
                try:
                    self.events.append(json.loads(line))
                except ValueError:
                    pass
            if "pagedkv ready" in line:
                self.serving = True
                self.ready.set()
        self.ready.set()

    def log(self) -> str:
        """The last 4000 lines of serve's output (at debug, a few requests' lines: count events with ``lifecycle``)."""
        return "\n".join(self.lines)

    def child_pids(self) -> list[int]:
        """serve's children (executor, scheduler), from /proc."""
        pids: list[int] = []
        for task in Path(f"/proc/{self.proc.pid}/task").glob("*"):
            try:
                pids += [int(p) for p in (task / "children").read_text().split()]
            except OSError:
                pass
        return pids

    def scheduler_pid(self) -> int | None:
        """serve's live scheduler child now (a restarted one has a new pid; None between a death and the restart,
        or while the restarted one has not yet exec'd), from /proc."""
        return self.child_pid("scheduler")

    def child_pid(self, role: str) -> int | None:
        """serve's live ``role`` child (scheduler, executor) now, as scheduler_pid."""
        for pid in self.child_pids():
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if role.encode() in argv and state != "Z":
                return pid
        return None

    def saw(self, event: str, **fields) -> bool:
        """Whether a child logged ``event`` with ``fields`` (its JSON log events: serve run with --log-format json)."""
        return any(e.get("event") == event and all(e.get(k) == v for k, v in fields.items())
                   for e in list(self.events))

    def stop(self) -> int:
        """Ctrl-C, as a user would; SIGKILL to serve and everything in its children's sessions (each child has one
        of its own) if it does not stop within 30 s."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                from pagedkv.proc_tree import session_members, signal_all

                children = self.child_pids()
                os.killpg(self.proc.pid, signal.SIGKILL)
                for pid in children:
                    signal_all(session_members(pid), signal.SIGKILL)
                self.proc.wait()
        return self.proc.returncode


class ServiceProcess:
    """``pagedkv <role> --port <free> *args`` with JSON logs; waits for its ``<role>_ready`` line. The child's
    environment has ``PAGEDKV_EXECUTOR_SECRET=TEST_EXECUTOR_SECRET`` unless ``env`` sets it ("" unsets it)."""

    def __init__(self, role: str, *args: str, port: int = 0, timeout: float = 120.0, wait: bool = True,
                 env: dict[str, str] | None = None) -> None:
        self.role = role
        self.port = port or free_port()
        cmd = [sys.executable, "-m", "pagedkv", role, "--port", str(self.port), "--log-format", "json", *args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                                     env={**os.environ, EXECUTOR_SECRET_ENV: TEST_EXECUTOR_SECRET, **(env or {})},
                                     start_new_session=True)
        self.lines: deque[str] = deque(maxlen=2000)
        self.events: list[dict] = []
        self.ready = threading.Event()
        threading.Thread(target=self._pump, daemon=True).start()
        if wait:
            self.wait_ready(timeout)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip())
            try:
                event = json.loads(line)
            except ValueError:
                continue
            self.events.append(event)
            if event.get("event") == f"{self.role}_ready":
                self.ready.set()
        self.ready.set()

    def wait_ready(self, timeout: float = 120.0) -> None:
        if not self.ready.wait(timeout) or self.proc.poll() is not None:
            self.kill()
            raise RuntimeError(f"{self.role} not ready:\n{self.log()}")

    def saw(self, event: str, **fields) -> bool:
        return any(e.get("event") == event and all(e.get(k) == v for k, v in fields.items())
                   for e in list(self.events))

    def log(self) -> str:
        return "\n".join(self.lines)

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def wait(self, timeout: float = 60.0) -> int:
        return self.proc.wait(timeout=timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self, timeout: float = 30.0) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.proc.returncode
