"""Executor and scheduler processes started one by one on loopback (as docker-compose or Kubernetes runs
them), for the scale-out and compose tests."""

from __future__ import annotations

import socket

from pagedkv.local_server import ROOT, ServiceProcess
from tests.conftest import wait_until as wait_for

Proc = ServiceProcess
__all__ = ["METRICS_HOST", "ROOT", "Proc", "can_bind", "executor", "scheduler", "wait_for"]
METRICS_HOST = "127.0.0.2"  # loopback too, but not the API's address: /metrics on an address of its own


def executor(*args: str, port: int = 0, wait: bool = True) -> Proc:
    """A tiny-llama executor with one torch thread (several share this machine's cores)."""
    return Proc("executor", "--threads", "1", *args, port=port, wait=wait)


def scheduler(*executors: str, args: tuple[str, ...] = ()) -> Proc:
    flags = [f for a in executors for f in ("--executor", a)]
    return Proc("scheduler", *flags, *args)


def can_bind(host: str) -> bool:
    """Whether this machine lets a socket bind ``host`` (127.0.0.2 is loopback on Linux, not everywhere)."""
    with socket.socket() as s:
        try:
            s.bind((host, 0))
        except OSError:
            return False
    return True
