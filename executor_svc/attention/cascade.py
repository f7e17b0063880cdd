"""Which pages a step attends apart from the rest, for the torch backend (torch_backend.py): a decode group's shared
prompt prefix, attended as a cascade (``shared_prefix``), and prefill chunks' context before their first query, split
off and shared between chunks over the same first pages (``split_prefills``); the thresholds at which each pays
(bench/NOTES.md "Shared prefix: a cascade", "Prefill chunks over cached context, split"), and whether the CPU kernel
library does the work itself (``shared_in_kernel``, ``prefill_in_kernel``).
"""
from __future__ import annotations

import torch

from executor_svc.attention.metadata import AttentionMetadata, DecodeGroup, PrefillSegment

# When a decode group attends its shared prefix as a cascade: at least this many rows, prefix tokens, and rows x
# prefix tokens (below, the extra calls cost more than they save: bench/NOTES.md "Shared prefix: a cascade").
CASCADE_MIN_ROWS = 8
CASCADE_MIN_TOKENS = 128
CASCADE_MIN_WORK = 4096
# A prefill chunk's context is split off (above) when it has at least this many tokens in whole pages before the
# chunk's first query; chunks share one call over their common first pages when those hold CASCADE_MIN_TOKENS.
PREFILL_SPLIT_MIN_TOKENS = 64
_EMPTY = torch.empty(0, dtype=torch.long)  # no pages


def split_prefills(meta: AttentionMetadata, block_size: int) -> list[tuple[torch.Tensor, list[PrefillSegment]]]:
    """The prefill segments whose context is attended apart from their own keys, in groups: (the context pages
    each group's segments all start with and attend in one call, its segments). Segments with a window (the
    model's or their own) or too little context before their first query are in no group (one masked SDPA)."""
    if meta.prefill_split is not None:
        return meta.prefill_split
    groups: list[tuple[torch.Tensor, list[PrefillSegment]]] = []
    by_first: dict[int, list[tuple[PrefillSegment, int]]] = {}
    if not meta.sliding_window:
        for seg in meta.prefills:
            pages = (seg.ctx_len - seg.q_len) // block_size  # whole pages before the first query
            if seg.window or pages * block_size < PREFILL_SPLIT_MIN_TOKENS:
                continue
            by_first.setdefault(int(seg.page_ids[0]), []).append((seg, pages))
    for members in by_first.values():
        common = min(pages for _, pages in members)
        if len(members) > 1:
            tables = torch.stack([seg.page_ids[:common] for seg, _ in members])
            same = (tables == tables[:1]).all(0)
            common = common if bool(same.all()) else int(same.logical_not().nonzero()[0, 0])
        if len(members) > 1 and common * block_size >= CASCADE_MIN_TOKENS:
            groups.append((members[0][0].page_ids[:common].contiguous(), [seg for seg, _ in members]))
        else:
            groups += [(seg.page_ids[:pages].contiguous(), [seg]) for seg, pages in members]
    meta.prefill_split = groups
    return groups


def shared_prefix(group: DecodeGroup, block_size: int, window: int) -> torch.Tensor:
    """The page ids that begin every row's table of ``group`` and lie wholly before every row's query (so every
    query sees all of them, and none writes into them), when attending them as a cascade pays; else empty.
    Requests' windows and the model's sliding window keep the plain kernel."""
    tables = group.page_tables
    rows = tables.shape[0]
    if rows < CASCADE_MIN_ROWS or group.windows is not None or window:
        return _EMPTY
    limit = int(group.query_positions().min()) // block_size  # pages before every query's own
    if limit * block_size < CASCADE_MIN_TOKENS:
        return _EMPTY
    same = (tables[:, :limit] == tables[:1, :limit]).all(0)
    pages = limit if bool(same.all()) else int(same.logical_not().nonzero()[0, 0])
    if pages * block_size < CASCADE_MIN_TOKENS or rows * pages * block_size < CASCADE_MIN_WORK:
        return _EMPTY
    return tables[0, :pages].contiguous()


_SHARED_DIMS: dict[int, frozenset[int]] = {}


def prefill_in_kernel(kernel, q: torch.Tensor) -> bool:
    """Whether prefill chunks are attended by the kernel, each token as a decode is (where ``shared_in_kernel``:
    the kernel's vector path, whose runs of a chunk's tokens read their keys once); else SDPA."""
    return shared_in_kernel(kernel, q)


def shared_in_kernel(kernel, q: torch.Tensor) -> bool:
    """Whether the kernel library attends a shared prefix itself (``paged_attention_cascade``: float32, the head
    sizes of its vector path on this CPU, ``paged_attention_shared_dims``); else the cascade's first half is an SDPA
    call over the gathered prefix."""
    dims = _SHARED_DIMS.get(id(kernel))
    if dims is None:
        dims = _SHARED_DIMS[id(kernel)] = frozenset(kernel.paged_attention_shared_dims()
                                                     if hasattr(kernel, "paged_attention_shared_dims") else ())
    return q.dtype == torch.float32 and q.shape[-1] in dims
