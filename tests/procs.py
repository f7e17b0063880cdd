"""Executor and scheduler processes started one by one on loopback (as docker-compose or Kubernetes runs
them), for the scale-out and compose tests."""

from __future__ import annotations

from pagedkv.local_server import ROOT, ServiceProcess
from tests.conftest import wait_until as wait_for

Proc = ServiceProcess
__all__ = ["ROOT", "Proc", "executor", "scheduler", "wait_for"]


def executor(*args: str, port: int = 0, wait: bool = True) -> Proc:
    """A tiny-llama executor with one torch thread (several share this machine's cores)."""
    return Proc("executor", "--threads", "1", *args, port=port, wait=wait)


def scheduler(*executors: str, args: tuple[str, ...] = ()) -> Proc:
    flags = [f for a in executors for f in ("--executor", a)]
    return Proc("scheduler", *flags, *args)
