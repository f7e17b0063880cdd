"""JSON nesting, bounded before anything recurses over it: ``nests_deeper_than`` scans JSON text without recursion
(json.loads recurses once a level, so ``[`` x 100,000 was a RecursionError). The gateway checks request bodies with it,
the scheduler the JSON texts a chat request carries (tool call arguments, chat_template_kwargs)."""

from __future__ import annotations

import itertools
import re

# A JSON string, or an unterminated one to the end (so that no quote is ever scanned twice), and what is not a
# bracket: nests_deeper_than's regular expressions, both linear.
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"?', re.DOTALL)
_NOT_BRACKET = re.compile(rb"[^\[\]{}]+")
_NESTING_STEP = [0] * 256
for _c in b"[{":
    _NESTING_STEP[_c] = 1
for _c in b"]}":
    _NESTING_STEP[_c] = -1


def nests_deeper_than(body: bytes | bytearray, limit: int) -> bool:
    """Whether arrays and objects nest more than ``limit`` deep in ``body`` (outside strings), found without
    recursion: json.loads recurses once a level, so ``[`` x 100,000 was a RecursionError. The strings skipped are
    the ones json.loads lexes, so it never goes deeper than this counts, valid JSON or not. A body with at most
    ``limit`` brackets is not scanned at all."""
    if body.count(b"[") + body.count(b"{") <= limit:
        return False
    brackets = _NOT_BRACKET.sub(b"", _JSON_STRING.sub(b"", body))
    return max(itertools.accumulate(map(_NESTING_STEP.__getitem__, brackets)), default=0) > limit
