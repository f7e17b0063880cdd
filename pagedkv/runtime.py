"""Process-wide settings the services apply once they have started."""

from __future__ import annotations

import gc

# Allocations (of objects the collector tracks) between two young-generation collections; CPython's default is
# 700. A step at 1,024 running allocates a few thousand (messages, token lists), so the default ran several
# collections per step, and every 100th a full one. Measured in-process at 1,024 running (bench/NOTES.md):
# result processing 2.08 -> 1.62 ms, its p99 8.4 -> 1.9 ms; the young generation then holds at most a few MB.
GC_YOUNG_THRESHOLD = 50_000


def settle_gc() -> None:
    """What start-up built (modules, the model or the tokenizer and its tables) lives as long as the process: it
    is frozen out of the collector, so a full collection no longer walks it; and the young generation is
    collected every GC_YOUNG_THRESHOLD allocations instead of 700 (older generations keep their ratios)."""
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, older, oldest)
