"""The executor's torch CPU threads: ``--threads N`` or ``auto``, the default (``$PAGEDKV_THREADS`` overrides it).

``auto`` is every CPU this process may use: its affinity, capped by a cgroup CPU quota (a container limited to 2 CPUs
on a 64-core node gets 2 threads, not 64), at least one. It is what torch and vLLM's CPU build do (one OpenMP thread
per core, spinning between parallel regions), and the fastest on a machine that serves and does little else: on this
2-core VM, SmolLM2 served over HTTP decoded a batch-1 stream at 26.5 ms a token with 2 threads against 37.6 with one,
and kept up with 4 req/s of Poisson arrivals where one thread fell behind (bench/NOTES.md, #49).

On a machine shared with busy processes fewer threads are faster: torch's OpenMP threads wait for each other at every
op and spin while they wait, so one preempted thread holds the others up (2 threads beside one busy process on 2
cores: 1.3 tok/s against 23 with one thread). There, give ``--threads`` below the free cores, or set
``OMP_WAIT_POLICY=PASSIVE`` (threads sleep while they wait: 28 tok/s idle, 22 beside the busy process). Bounding the
spin (``GOMP_SPINCOUNT``) cost 25% of batch-1 speed when serving and was not kept (bench/NOTES.md). ``0`` leaves torch's
own default.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

AUTO = "auto"
ENV = "PAGEDKV_THREADS"
CGROUP_V2 = Path("/sys/fs/cgroup/cpu.max")
CGROUP_V1 = Path("/sys/fs/cgroup/cpu")


def threads_arg(value: str) -> str:
    """argparse type of --threads: ``auto`` or a count >= 0 (kept as text, so that serve passes it on as given)."""
    if value == AUTO:
        return value
    try:
        n = int(value)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"{value!r}: give auto, 0 (torch's default: one per core) or a count >= 1")
    return str(n)


def default_threads() -> str:
    """--threads' default: $PAGEDKV_THREADS when it holds a valid value, else auto."""
    value = os.environ.get(ENV, "").strip()
    try:
        return threads_arg(value) if value else AUTO
    except argparse.ArgumentTypeError as err:
        raise SystemExit(f"error: ${ENV}: {err}") from None


def cgroup_cpus(v2: Path = CGROUP_V2, v1: Path = CGROUP_V1) -> float | None:
    """The CPUs a cgroup quota allows this process (quota / period), or None without a quota."""
    try:
        quota, period = v2.read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota_us = int((v1 / "cpu.cfs_quota_us").read_text())
        period_us = int((v1 / "cpu.cfs_period_us").read_text())
        return quota_us / period_us if quota_us > 0 and period_us > 0 else None
    except (OSError, ValueError):
        return None


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity where the platform has one), capped by a cgroup quota."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    quota = cgroup_cpus()
    if quota is not None:
        cpus = min(cpus, max(1, int(quota)))
    return max(1, cpus)


def torch_threads(value: str | int) -> int:
    """The count for torch.set_num_threads (0: leave torch's default)."""
    if value == AUTO:
        return usable_cpus()
    return int(value)
