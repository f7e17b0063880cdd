"""One process of deploy/fleet_local.py's fleet: started in a session (process group) of its own from the checkout,
its output appended to <log_dir>/NAME.log; its log's tail read back, signalled, and its whole group SIGKILLed when it
outlives its stop timeout."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the checkout: every process runs there (python -m pagedkv ...)


class Proc:
    """A child in a session (process group) of its own, its output appended to a log file."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], log_dir: Path) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=env,
                                         start_new_session=True)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            text = []
        return f"---- {self.name} ({self.log_path})\n" + "\n".join(text)

    def signal(self, sig: int) -> None:
        if self.alive():
            self.proc.send_signal(sig)

    def wait_or_kill(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=max(timeout, 0.1))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            return self.proc.wait()
