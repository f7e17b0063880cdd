"""Processes seen through /proc: a process's descendants, the members of a session, and stopping them all.

``pagedkv serve`` starts each child in a session of its own (``setsid``), so everything a child starts -- pip, the
kernel build's ``ninja`` and the ``cc1plus`` that ninja puts in process groups of their own -- shares the child's
session id, even once orphaned. ``stop_session`` ends them all when the child is gone.

``interruptible_start`` turns SIGINT/SIGTERM during a service's start-up into an exception (``StartInterrupted``)
after ending the process's descendants, so that every ``finally`` on the way out removes its temporary folder
(a half-fetched wheel, a half-converted model, a half-built kernel); ``StartInterrupted.die`` then ends the
process by that same signal, as the default action would have.

Linux only (/proc); elsewhere the lists are empty and the functions do nothing.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

PROC = Path("/proc")


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, ppid, session) of ``pid``, or None when it is gone."""
    try:
        fields = (PROC / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0], int(fields[1]), int(fields[3])


def _pids() -> list[int]:
    try:
        return [int(p.name) for p in PROC.iterdir() if p.name.isdigit()]
    except OSError:
        return []


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (children first, then theirs)."""
    children: dict[int, list[int]] = {}
    for p in _pids():
        st = _stat(p)
        if st is not None and st[0] != "Z":
            children.setdefault(st[1], []).append(p)
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def session_members(sid: int) -> list[int]:
    """The live (not zombie) processes of session ``sid``, this process excepted."""
    me = os.getpid()
    members = []
    for p in _pids():
        st = _stat(p)
        if st is not None and st[2] == sid and st[0] != "Z" and p != me:
            members.append(p)
    return members


def signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def stop_session(sid: int, grace: float = 2.0) -> list[int]:
    """SIGTERM to every process left in session ``sid``, SIGKILL to those still there after ``grace`` seconds.
    Returns the pids that were found (empty: nothing was left)."""
    left = session_members(sid)
    if not left:
        return []
    signal_all(left, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and session_members(sid):
        time.sleep(0.05)
    signal_all(session_members(sid), signal.SIGKILL)
    return left


def alive(pid: int) -> bool:
    st = _stat(pid)
    return st is not None and st[0] != "Z"


def remove_stale(folder: Path, prefix: str) -> list[Path]:
    """Removes the temporary folders ``<prefix>...-<pid>-<random>`` in ``folder`` whose process is gone (one
    SIGKILLed mid-build had no chance to remove its own). Returns what it removed."""
    import shutil

    removed = []
    try:
        entries = list(folder.iterdir()) if folder.is_dir() else []
    except OSError:
        return removed
    for entry in entries:
        parts = entry.name.split("-")
        if entry.is_dir() and entry.name.startswith(prefix) and len(parts) >= 3 and parts[-2].isdigit() \
                and not alive(int(parts[-2])):
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed


class StartInterrupted(BaseException):  # noqa: N818 - as KeyboardInterrupt: not an Exception, nothing catches it
    """SIGINT/SIGTERM arrived while a service was starting; its descendants were already signalled."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"start-up interrupted by {signal.Signals(signum).name}")
        self.signum = signum

    def die(self) -> None:
        """Ends this process by the signal that interrupted it (after the ``finally`` blocks have run)."""
        signal.signal(self.signum, signal.SIG_DFL)
        os.kill(os.getpid(), self.signum)
        time.sleep(5)  # (the signal is delivered before this returns)
        os._exit(128 + self.signum)


@contextlib.contextmanager
def interruptible_start(log=None) -> Iterator[None]:
    """Within: SIGINT/SIGTERM end this process's descendants (the compiler, pip) and raise StartInterrupted."""
    def on_signal(signum: int, _frame) -> None:
        for sig in sigs:  # a second signal must not cut the clean-up short (the supervisor SIGKILLs if need be)
            signal.signal(sig, signal.SIG_IGN)
        below = descendants(os.getpid())
        signal_all(below, signal.SIGTERM)
        if log is not None:
            log.warning("start_interrupted", signal=signal.Signals(signum).name, stopped_pids=below)
        raise StartInterrupted(signum)

    sigs = (signal.SIGINT, signal.SIGTERM)
    try:
        previous = {sig: signal.signal(sig, on_signal) for sig in sigs}
    except ValueError:  # not the main thread: signals stay as they were
        yield
        return
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
