"""structlog set-up: JSON lines in services, readable lines on a terminal."""

from __future__ import annotations

import logging
import sys

import structlog


class _CurrentStderr:
    """Writes to whatever ``sys.stderr`` is at the time (loggers cached on first use keep this object, not a stream
    that a caller's redirection, or a test's capture, has closed since)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

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
