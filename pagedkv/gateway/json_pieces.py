"""Large answers built and encoded off the event loop (``encoded``), in pieces (``pieces``), so that another request
is served meanwhile. Issue 46 (F4): a 229 MB answer was built and encoded on the loop and held it 8 s.

NOTE: a thread alone does not do it: json.dumps's C encoder holds the GIL for its whole call, so one dumps of a
60 MB body in a thread stopped the loop for all of its 1 s (measured: the longest gap between the loop's ticks was
0.96 s). Encoded as pieces of about PIECE_WEIGHT values each, the same C encoder runs at most ~1 ms at a time and
the interpreter hands the GIL to the loop between two pieces (within sys.getswitchinterval(), 5 ms). Building the
body (Python code) in the thread hands it over by itself."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

PIECE_WEIGHT = 4096  # values (numbers, strings, containers) encoded by one json.dumps call: ~100 KB, ~1 ms
CHUNK_CHARS = 1 << 20  # pieces joined into chunks of about this many characters (each one ASGI body message)
INLINE_BYTES = 256 << 10  # an answer bounded below this is built and encoded on the loop (a thread costs more)
T = TypeVar("T")
_SAMPLE = 3  # a long list's weight: its length times the heaviest of its first, middle and last elements


@dataclass(frozen=True, slots=True)
class Lazy:
    """A JSON array whose elements are made as they are written, and dropped once written (``pieces``): a large
    answer's choices, so that the objects of one choice live at a time, not of all (memory, and the garbage
    collector's passes, which hold the GIL, over them). ``dumps`` makes them all first."""

    count: int
    item: Callable[[int], object]

    def items(self) -> list:
        return [self.item(i) for i in range(self.count)]


def _default(obj):
    if isinstance(obj, Lazy):
        return obj.items()
    raise TypeError(f"Object of type {type(obj).__name__} is not JSON serializable")


def dumps(obj) -> str:
    """The gateway's JSON: compact, UTF-8 as it is."""
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False, default=_default)


def _sample(items: list) -> tuple:
    return (items[0], items[len(items) // 2], items[-1]) if len(items) >= _SAMPLE else tuple(items)


def weight(obj) -> int:
    """About how many values ``obj`` holds (a string counts one per 64 characters); lists, and dicts of more than
    64 entries, are weighed by a sample of their elements, so that this costs little more than the depth."""
    if isinstance(obj, Lazy):
        return 1 << 62  # (never written whole)
    if isinstance(obj, dict):
        values = list(obj.values()) if len(obj) > 64 else None
        if values is None:
            return 1 + sum(weight(v) for v in obj.values())
        return 1 + len(values) * max(weight(v) for v in _sample(values))
    if isinstance(obj, list):
        return 1 + len(obj) * max(weight(v) for v in _sample(obj)) if obj else 1
    if isinstance(obj, str):
        return 1 + len(obj) // 64
    return 1


def pieces(obj, limit: int = PIECE_WEIGHT) -> Iterator[str]:
    """``dumps(obj)`` as consecutive strings, none much heavier than ``limit`` unless one value is: a dict's entries
    one by one, a list's elements in slices of about ``limit`` (or one by one, each in pieces, when they are heavy).
    ``"".join(pieces(obj)) == dumps(obj)``."""
    if isinstance(obj, Lazy):
        for i in range(obj.count):
            yield "," if i else "["
            yield from pieces(obj.item(i), limit)
        yield "]" if obj.count else "[]"
        return
    if not isinstance(obj, dict | list) or weight(obj) <= limit:
        yield dumps(obj)
        return
    if isinstance(obj, dict):
        if not all(isinstance(k, str) for k in obj):  # (json turns other keys into strings its own way)
            yield dumps(obj)
            return
        sep = "{"
        for key, value in obj.items():
            yield sep + dumps(key) + ":"
            yield from pieces(value, limit)
            sep = ","
        yield "}"
        return
    each = max(weight(v) for v in _sample(obj))
    sep = "["
    if each * 2 > limit:
        for value in obj:
            yield sep
            yield from pieces(value, limit)
            sep = ","
    else:
        step = limit // each
        for at in range(0, len(obj), step):
            yield sep + dumps(obj[at:at + step])[1:-1]
            sep = ","
    yield "]"


def encode(obj) -> list[bytes]:
    """``dumps(obj)`` in UTF-8, as chunks of about CHUNK_CHARS characters (encoded a piece at a time)."""
    chunks: list[bytes] = []
    held: list[str] = []
    size = 0
    for piece in pieces(obj):
        held.append(piece)
        size += len(piece)
        if size >= CHUNK_CHARS:
            chunks.append("".join(held).encode())
            held, size = [], 0
    if held or not chunks:
        chunks.append("".join(held).encode())
    return chunks


async def encoded(build: Callable[[], object], bound: int,
                  keep: Callable[[object], T] | None = None) -> tuple[T | None, list[bytes]]:
    """``build()``'s JSON (chunks, to send in order), and ``keep`` of it (None without): on the loop when the answer
    is bounded by at most INLINE_BYTES (``bound``: response_budget's estimate), else in a thread, in pieces, where
    the built object is also dropped (freeing millions of small objects took the loop seconds)."""

    def run() -> tuple[T | None, list[bytes]]:
        obj = build()
        chunks = [dumps(obj).encode()] if bound <= INLINE_BYTES else encode(obj)
        return (keep(obj) if keep is not None else None), chunks

    return run() if bound <= INLINE_BYTES else await asyncio.to_thread(run)
