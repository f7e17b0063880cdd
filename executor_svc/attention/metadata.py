"""What one flattened step looks like to the attention backend."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Decodes are grouped so that a group's longest page table is at most this x its shortest (tables are padded to
# the group's longest); a backend may ask for another grouping (``decode_group_slack``: math.inf, one group).
DECODE_SLACK = 1.25


@dataclass(slots=True)
class PrefillSegment:
    """Tokens [q_start, q_start + q_len) of the flat batch attend over context positions [0, ctx_len)."""

    q_start: int
    q_len: int
    ctx_len: int
    page_ids: torch.Tensor  # the pages holding positions [0, ctx_len) (dropped ones: any page, masked)
    sink: int = 0  # attention sink + window of the request (window 0: none)
    window: int = 0


@dataclass(slots=True)
class DecodeGroup:
    """Decodes of similar context length, attended together; tables padded with page 0 to the longest."""

    token_idx: torch.Tensor  # [B] flat index of each decode token
    page_tables: torch.Tensor  # [B, max_pages]
    ctx_lens: torch.Tensor  # [B] context length including the new token
    sinks: torch.Tensor | None = None  # [B] per-request attention sink and window (None: nobody has one;
    windows: torch.Tensor | None = None  # a window of 0 means none)
    mask: torch.Tensor | None = None  # built by the backend on first use, shared by every layer
    in_order: bool = False  # token_idx is ascending (the runner sets it)
    last_pos: torch.Tensor | None = None  # ctx_lens - 1, the query positions: made on first use, for every layer
    # The page ids every row's table starts with, when the backend attends them as one shared prefix (a cascade;
    # executor_svc/attention/torch_backend.py); an empty tensor when it does not. Made on first use.
    shared_pages: torch.Tensor | None = None

    def query_positions(self) -> torch.Tensor:
        if self.last_pos is None:
            self.last_pos = self.ctx_lens - 1
        return self.last_pos

    def new_step(self) -> None:
        """Drops what was made from this step's values (mask, query positions, shared pages): for a group whose
        tensors are refilled in place for the next step (the static batch of a CUDA graph)."""
        self.mask = None
        self.last_pos = None
        self.shared_pages = None


@dataclass(slots=True)
class AttentionMetadata:
    """Built once per step by the runner; shared by every layer.

    Token layout of the flat batch (T tokens): each scheduled request contributes a contiguous run.
    Requests with exactly one new token (decodes) are attended in batched calls, one per group of
    similar context length (little padding); the others (prefill chunks, possibly with cached context
    before them) one segment at a time.
    """

    slot_pages: torch.Tensor  # [T] page id of each new token's slot
    slot_offsets: torch.Tensor  # [T] offset of that slot inside its page
    decodes: list[DecodeGroup]
    prefills: list[PrefillSegment]
    sliding_window: int | None = None
    # How a backend splits the prefill chunks' attention (executor_svc/attention/torch_backend.py
    # ``split_prefills``), or the chunks' tokens as the CPU kernel's queries (``PrefillQueries``): made on first use,
    # shared by every layer.
    prefill_split: object | None = None
    prefill_queries: object | None = None

    @property
    def one_decode_group(self) -> bool:
        """Every token is a decode, all in one group, in token order (token_idx is 0..T-1): a backend may
        attend q as a whole instead of gathering and scattering its rows."""
        return (not self.prefills and len(self.decodes) == 1
                and self.decodes[0].token_idx.numel() == self.slot_pages.numel() and self.decodes[0].in_order)


_NONE = torch.empty(0, dtype=torch.long)


@dataclass(slots=True)
class PrefillQueries:
    """A step's prefill tokens as queries of the CPU kernel's ``paged_attention`` (torch_backend.py): the i-th (flat
    index ``token_idx[i]``; None: the step is these tokens, in order) at position ``q_pos[i]`` reads table row
    ``q_rows[i]`` (its chunk's pages, padded with page 0), with its chunk's sink and window (empty: none has one)."""

    token_idx: torch.Tensor | None
    tables: torch.Tensor
    q_rows: torch.Tensor
    q_pos: torch.Tensor
    sinks: torch.Tensor
    windows: torch.Tensor


def prefill_queries(meta: AttentionMetadata) -> PrefillQueries:
    """The step's prefill chunks as kernel queries (made on first use, shared by every layer)."""
    if meta.prefill_queries is None:
        segs = meta.prefills
        tables = torch.zeros(len(segs), max(seg.page_ids.numel() for seg in segs), dtype=torch.long)
        whole, at = not meta.decodes, 0  # (the chunks are the step's tokens, in order)
        for i, seg in enumerate(segs):
            tables[i, :seg.page_ids.numel()] = seg.page_ids
            whole, at = whole and seg.q_start == at, at + seg.q_len
        sinks, windows = _NONE, _NONE
        if any(seg.window for seg in segs):
            sinks, windows = torch.tensor([seg.sink for seg in segs]), torch.tensor([seg.window for seg in segs])
        meta.prefill_queries = PrefillQueries(
            None if whole else torch.cat([torch.arange(seg.q_start, seg.q_start + seg.q_len) for seg in segs]),
            tables, torch.repeat_interleave(torch.arange(len(segs)), torch.tensor([seg.q_len for seg in segs])),
            torch.cat([torch.arange(seg.ctx_len - seg.q_len, seg.ctx_len) for seg in segs]), sinks, windows)
    return meta.prefill_queries
