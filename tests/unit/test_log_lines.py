"""Each log line reaches stderr in one write (pagedkv/logs.py): structlog prints a line and its newline as two
writes, and where another writer shares the descriptor (Dynamo's Rust runtime beside ``pagedkv dynamo-worker``),
its line landed between them in CI, so two JSON lines read as one and an event was lost."""

from __future__ import annotations

import sys

import pytest

from pagedkv.logs import _CurrentStderr

pytestmark = pytest.mark.unit


class _Writes:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def write(self, text: str) -> int:
        self.calls.append(text)
        return len(text)

    def flush(self) -> None:
        pass


def test_a_printed_line_is_one_write(monkeypatch) -> None:
    seen = _Writes()
    monkeypatch.setattr(sys, "stderr", seen)
    out = _CurrentStderr()
    print('{"event": "dynamo_worker_ready"}', file=out, flush=True)
    print('{"event": "b"}', file=out, flush=True)
    assert seen.calls == ['{"event": "dynamo_worker_ready"}\n', '{"event": "b"}\n']
