"""The executor's torch CPU threads: ``--threads N`` or ``auto``, the default.

``auto`` is half the CPUs this process may run on (its affinity), at least one: 1 on a 2-core machine. Measured
there (``bench/threads.py``, tiny-llama, one 128-token greedy stream; bench/NOTES.md): one thread decoded as fast as
two on an idle machine and several times faster with one busy process beside the server, because torch's OpenMP
threads wait for each other at every op, so one preempted thread holds up the others (and they spin while they
wait, taking the CPU the scheduler needs). Half the cores leaves the other half to the scheduler, the gateway and
whatever else runs there. ``0`` is torch's own default (one thread per core).
"""

from __future__ import annotations

import argparse
import os

AUTO = "auto"


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


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity where the platform has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def torch_threads(value: str | int) -> int:
    """The count for torch.set_num_threads (0: leave torch's default)."""
    if value == AUTO:
        return max(1, usable_cpus() // 2)
    return int(value)
