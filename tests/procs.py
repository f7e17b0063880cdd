"""Executor and scheduler processes started one by one on loopback (as docker-compose or Kubernetes runs
them), for the scale-out and compose tests."""

from __future__ import annotations

import time

from pagedkv.local_server import ROOT, ServiceProcess

Proc = ServiceProcess
__all__ = ["ROOT", "Proc", "executor", "scheduler", "wait_for"]


def executor(*args: str, port: int = 0, wait: bool = True) -> Proc:
    """A tiny-llama executor with one torch thread (several share this machine's cores)."""
    return Proc("executor", "--threads", "1", *args, port=port, wait=wait)


def scheduler(*executors: str, args: tuple[str, ...] = ()) -> Proc:
    flags = [f for a in executors for f in ("--executor", a)]
    return Proc("scheduler", *flags, *args)


def wait_for(predicate, timeout: float = 30.0, interval: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())
