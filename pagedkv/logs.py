"""structlog set-up: JSON lines in services, readable lines on a terminal; ``--log-level`` for every service.

Levels: per-request lines (admitted, finished, cancelled) are DEBUG; INFO has start, stop and configuration lines,
and the scheduler's periodic stats line (``--log-stats-interval``, as vLLM's); WARNING and ERROR what needs a look.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading

import structlog

LEVELS = ("debug", "info", "warning", "error")
LEVEL_ENV = "PAGEDKV_LOG_LEVEL"  # --log-level's default (as vLLM's VLLM_LOGGING_LEVEL)


def default_level() -> str:
    """$PAGEDKV_LOG_LEVEL (any case), else info (also when it is not a level, which is said on stderr)."""
    level = os.environ.get(LEVEL_ENV, "info").strip().lower() or "info"
    if level not in LEVELS:
        print(f"warning: ${LEVEL_ENV}={level!r} is not one of {', '.join(LEVELS)}: logging at info", file=sys.stderr)
        return "info"
    return level


def add_log_level_arg(p: argparse.ArgumentParser) -> None:
    """--log-level, declared alike by every service (pagedkv serve passes one value to all its children)."""
    p.add_argument("--log-level", choices=LEVELS, default=default_level(),
                   help="least severe log lines written: debug adds one line per request admitted, finished or "
                   "cancelled; info has start-up, shutdown and the periodic stats line (default: "
                   f"${LEVEL_ENV}, else info; now %(default)s)")


class _CurrentStderr:
    """Writes to whatever ``sys.stderr`` is at the time (loggers cached on first use keep this object, not a stream
    that a caller's redirection, or a test's capture, has closed since), one whole line per write: structlog prints
    a line and its newline as two writes, and where another writer shares the descriptor (Dynamo's Rust runtime in
    ``pagedkv dynamo-worker``), an unbuffered stderr let its line land between them, so two JSON lines became one."""

    def __init__(self) -> None:
        self._pending = ""
        self._lock = threading.Lock()

    def write(self, text: str) -> int:
        with self._lock:
            self._pending += text
            if "\n" not in text:
                return len(text)
            line, self._pending = self._pending, ""
        sys.stderr.write(line)
        sys.stderr.flush()
        return len(text)

    def flush(self) -> None:
        sys.stderr.flush()


def configure(service: str, json: bool | None = None, level: str = "info") -> structlog.stdlib.BoundLogger:
    if json is None:
        json = not sys.stderr.isatty()
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO), stream=sys.stderr,
                        format="%(message)s")
    renderer = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper(), logging.INFO)),
        logger_factory=structlog.PrintLoggerFactory(file=_CurrentStderr()),
        cache_logger_on_first_use=True,
    )
    return structlog.get_logger(service=service)


def wants_json(log_format: str) -> bool | None:
    """--log-format → the json argument of configure (None: decide by whether stderr is a terminal)."""
    return {"json": True, "console": False}.get(log_format)
