"""One child of ``pagedkv serve``'s supervisor (``pagedkv.supervisor``): its spec, and its process started, watched
and signalled.

- Children never outlive the supervisor: on Linux each gets ``PR_SET_PDEATHSIG`` (SIGTERM), so even a
  SIGKILLed supervisor takes them down (gracefully: the scheduler drains, the executor detaches). Every child
  is forked from the main thread, because the death signal fires when the *thread* that forked exits.
- Each child runs in a session of its own (``setsid``): a terminal's Ctrl-C reaches only the supervisor, which
  stops the children in order (reaching all three at once, it would make the executor drain while the scheduler
  still finishes streams). Everything a child starts stays in its session (pip, the kernel build's ninja and the
  cc1plus that ninja puts in process groups of their own), so once the child is gone -- stopped, crashed,
  killed -- whatever it left in its session is ended too (``proc_tree.stop_session``). Children start with SIGHUP
  ignored until they install a handler of their own, so a SIGHUP forwarded while one is starting cannot kill it.
- Ready means ``ready()`` and, for each of the child's ``ports``, a listener on it held by the child's session
  (not a stranger's that happens to answer on that port).
- A child that fails to start says why in one line: it writes it to the file ``START_ERROR_FILE_ENV`` names
  (``Child.start_failure`` reads it back for serve's last line).

No grpc at import: the unit tests drive this module with small stand-in children.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pagedkv import proc_tree
from pagedkv.port_check import listens_in

PR_SET_PDEATHSIG = 1  # linux/prctl.h
START_ERROR_FILE_ENV = "PAGEDKV_START_ERROR_FILE"  # a child writes its one-line start-up error there


@dataclass
class ChildSpec:
    name: str
    cmd: list[str]
    ready: Callable[[], bool]  # polled after the first start until True (e.g. grpc health SERVING)
    ready_timeout: float  # seconds the first start may take
    stop_timeout: float  # seconds from SIGTERM to SIGKILL: the child's own graceful drain plus a margin
    close: Callable[[], None] = field(default=lambda: None)  # releases what ``ready`` holds
    ports: tuple[int, ...] = ()  # TCP ports the child listens on once ready (its session must hold them)


def _child_setup(parent: int) -> Callable[[], None]:
    """Runs in the forked child before exec: own session, SIGHUP ignored, death signal on Linux."""
    prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None

    def setup() -> None:
        os.setsid()
        signal.signal(signal.SIGHUP, signal.SIG_IGN)  # inherited through exec, until the child handles it
        if prctl is not None:
            prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
            if os.getppid() != parent:  # the supervisor died before the death signal was armed
                os._exit(1)

    return setup


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


class Child:
    def __init__(self, spec: ChildSpec, env: dict[str, str], backoff_start: float) -> None:
        self.spec = spec
        self.env = env
        self.proc: subprocess.Popen | None = None
        self.started_at = 0.0
        self.restarts = 0
        self.backoff = backoff_start
        self.restart_at: float | None = None  # a restart is due then (the child exited on its own)
        self.awaiting_ready = False  # restarted, and not ready yet
        self.error_file = ""  # where the child writes its one-line start-up error (START_ERROR_FILE_ENV)

    @property
    def name(self) -> str:
        return self.spec.name

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> None:
        env = self.env
        if self.error_file:
            with contextlib.suppress(OSError):
                os.unlink(self.error_file)
            env = {**env, START_ERROR_FILE_ENV: self.error_file}
        self.proc = subprocess.Popen(self.spec.cmd, stdin=subprocess.DEVNULL, env=env,
                                     preexec_fn=_child_setup(os.getpid()))
        self.started_at = time.monotonic()
        self.restart_at = None

    def start_failure(self) -> str:
        """Why the start failed, for serve's last line: the child's own one-line error when it wrote one."""
        assert self.proc is not None
        said = ""
        if self.error_file:
            with contextlib.suppress(OSError, IndexError), open(self.error_file) as f:
                said = f.read().strip().splitlines()[0]
        return f"{self.name} {describe_exit(self.proc.returncode)} during start-up" + (
            f": {said}" if said else " (see its log above)")

    def is_ready(self) -> bool:
        """``ready()``, and each of its ports held by this child's session."""
        if self.proc is None or not self.spec.ready():
            return False
        session = {self.proc.pid, *proc_tree.session_members(self.proc.pid)}
        return all(listens_in(port, session) for port in self.spec.ports)

    def end_leftovers(self, log) -> None:
        """Once the child is gone: whatever it left running in its session (a compiler, pip) is ended."""
        if self.proc is not None and (left := proc_tree.stop_session(self.proc.pid)):
            log.warning("child_leftovers_stopped", child=self.name, session=self.proc.pid, pids=left)

    def signal(self, sig: int) -> None:
        if self.running():
            assert self.proc is not None
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(sig)
