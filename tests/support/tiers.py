"""The test tiers (tests/README.md): each test module names its tier in ``pytestmark`` and sits in that tier's
folder (checked at collection: a module without a tier, or in the wrong folder, stops the run), and a unit test
that starts a process or opens a socket fails (the guard below, on while a unit test's set-up, call and
tear-down run).

The guard wraps where processes and sockets begin: ``subprocess.Popen`` (so ``subprocess.run`` and asyncio's
subprocesses too), ``os.fork``/``os.posix_spawn``/``os.system``, multiprocessing's spawn, ``socket.connect``/
``connect_ex``/``bind`` (any family), and gRPC's servers and channels (gRPC's sockets are its C core's, not
Python's). Compilers are allowed (COMPILERS): the CPU kernels and the CUDA emulator are C++ built on first use
and cached, a build step rather than a service. A violation is recorded as well as raised, so a test that
catches the error still fails.
"""

from __future__ import annotations

import os
import socket
import subprocess
import threading
from pathlib import Path

import pytest

TIERS = ("unit", "e2e", "gpu")
# folder under tests/ -> the tiers its modules may have
FOLDERS = {"unit": ("unit",), "e2e": ("e2e",), "gpu": ("gpu",), "adversarial": ("unit", "e2e")}
# what a unit test may start: compilers and the build tools torch's cpp_extension asks about
COMPILERS = frozenset({"c++", "g++", "gcc", "cc", "clang", "clang++", "ninja", "nvcc", "ccache"})
TESTS = Path(__file__).resolve().parents[1]


class TierViolation(RuntimeError):
    """A unit test started a process or opened a socket."""


# ---- the collection check ----------------------------------------------------------------------------------

def module_tiers(module: pytest.Module) -> list[str]:
    return [m.name for m in module.own_markers if m.name in TIERS]


def check_tiers(items: list[pytest.Item]) -> None:
    """Raises pytest.UsageError naming every module that has no tier (or two), sits outside the tier folders
    or in one that is not its tier's, or marks one of its tests with another tier than its own."""
    problems: dict[str, str] = {}
    for item in items:
        module = item.getparent(pytest.Module)
        if module is None:
            continue
        path = Path(str(module.path)).resolve()
        rel = path.relative_to(TESTS).as_posix() if path.is_relative_to(TESTS) else str(path)
        if rel in problems:
            continue
        tiers = module_tiers(module)
        folder = rel.split("/")[0] if "/" in rel else ""
        if len(tiers) != 1:
            problems[rel] = (f"has {'no tier marker' if not tiers else 'two tier markers ' + str(tiers)}: set "
                             f"`pytestmark = pytest.mark.<{'|'.join(TIERS)}>`")
        elif folder not in FOLDERS:
            problems[rel] = f"is marked {tiers[0]} but is not under a tier folder ({', '.join(FOLDERS)})"
        elif tiers[0] not in FOLDERS[folder]:
            problems[rel] = f"is marked {tiers[0]} but sits in tests/{folder}/ (tiers {', '.join(FOLDERS[folder])})"
        else:
            other = [t for t in TIERS if t != tiers[0] and item.get_closest_marker(t)]
            if other:
                problems[rel] = (f"is {tiers[0]}, but {item.name} is marked {other[0]}: one tier a module "
                                 "(split the module)")
    if problems:
        lines = "\n".join(f"  tests/{rel} {why}" for rel, why in sorted(problems.items()))
        raise pytest.UsageError(f"test tiers (tests/README.md):\n{lines}")


# ---- the unit guard ----------------------------------------------------------------------------------------

class _Guard:
    """Installed once; refuses only while ``active`` (a unit test is running), in any thread."""

    def __init__(self) -> None:
        self.active: str | None = None
        self.violations: list[str] = []
        self._lock = threading.Lock()
        self._vetted = threading.local()
        self._installed = False

    def refuse(self, what: str) -> None:
        if self.active is None:
            return
        message = f"unit test {self.active} {what} (unit tests start no process and open no socket; tests/README.md)"
        with self._lock:
            self.violations.append(message)
        raise TierViolation(message)

    def install(self) -> None:
        if self._installed:
            return
        self._installed = True
        guard = self

        execute_child = subprocess.Popen._execute_child

        def _execute_child(popen, args, executable, *rest, **kw):
            argv = [args] if isinstance(args, (str, bytes, os.PathLike)) else list(args)
            program = os.fsdecode(executable or argv[0]).split()[0] if argv or executable else ""
            if os.path.basename(program) not in COMPILERS:
                guard.refuse(f"started a process: {' '.join(map(os.fsdecode, argv))[:200]}")
            guard._vetted.on = True  # (subprocess may go on through os.posix_spawn: already decided)
            try:
                return execute_child(popen, args, executable, *rest, **kw)
            finally:
                guard._vetted.on = False

        subprocess.Popen._execute_child = _execute_child

        for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system"):
            if hasattr(os, name):
                setattr(os, name, self._refusing(getattr(os, name), f"called os.{name}"))
        import multiprocessing.util

        multiprocessing.util.spawnv_passfds = self._refusing(multiprocessing.util.spawnv_passfds,
                                                             "started a multiprocessing process")

        for name in ("connect", "connect_ex", "bind"):
            original = getattr(socket.socket, name)

            def wrapped(sock, address, _original=original, _name=name):
                guard.refuse(f"opened a socket: {_name}({address!r})")
                return _original(sock, address)

            setattr(socket.socket, name, wrapped)

        try:
            import grpc
            import grpc.aio
        except ImportError:  # (the GPU check's machine may lack the services' packages: no gRPC, no channels)
            return
        for module in (grpc, grpc.aio):
            for name in ("server", "insecure_channel", "secure_channel"):
                setattr(module, name, self._refusing(getattr(module, name), f"made a gRPC {module.__name__}.{name}"))

    def _refusing(self, function, what: str):
        guard = self

        def refusing(*args, **kw):
            if not getattr(guard._vetted, "on", False):
                guard.refuse(what)
            return function(*args, **kw)

        refusing.__wrapped__ = function
        return refusing

    def run(self, item: pytest.Item):
        """Context for one phase of a unit test: refuses, then fails the test for whatever it refused (even
        where the test's code caught the error)."""
        return _Phase(self, item)


class _Phase:
    def __init__(self, guard: _Guard, item: pytest.Item) -> None:
        self.guard, self.item = guard, item

    def __enter__(self) -> None:
        self.guard.violations.clear()
        self.guard.active = self.item.nodeid

    def __exit__(self, *exc) -> None:
        self.guard.active = None
        violations = list(self.guard.violations)
        self.guard.violations.clear()
        if violations and exc[0] is None:
            raise TierViolation(violations[0])


GUARD = _Guard()


def is_unit(item: pytest.Item) -> bool:
    return item.get_closest_marker("unit") is not None
