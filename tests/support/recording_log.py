"""A stand-in for a bound structlog logger that keeps what it is told."""

from __future__ import annotations


class RecordingLog:
    """A bound logger that keeps its lines (event, fields)."""

    def __init__(self, lines: list | None = None, **bound) -> None:
        self.lines = [] if lines is None else lines
        self.bound = bound

    def bind(self, **kw) -> RecordingLog:
        return RecordingLog(self.lines, **self.bound, **kw)

    def _line(self, event: str, **kw) -> None:
        self.lines.append((event, {**self.bound, **kw}))

    debug = info = warning = error = exception = _line
