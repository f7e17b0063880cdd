"""What one flattened step looks like to the attention backend."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class PrefillSegment:
    """Tokens [q_start, q_start + q_len) of the flat batch attend over context positions [0, ctx_len)."""

    q_start: int
    q_len: int
    ctx_len: int
    page_ids: torch.Tensor  # the pages holding positions [0, ctx_len)


@dataclass(slots=True)
class AttentionMetadata:
    """Built once per step by the runner; shared by every layer.

    Token layout of the flat batch (T tokens): each scheduled request contributes a contiguous run.
    Requests with exactly one new token (decodes) are attended in one batched call; the others
    (prefill chunks, possibly with cached context before them) one segment at a time.
    """

    slot_pages: torch.Tensor  # [T] page id of each new token's slot
    slot_offsets: torch.Tensor  # [T] offset of that slot inside its page
    decode_token_idx: torch.Tensor  # [B] flat index of each decode token
    decode_page_tables: torch.Tensor  # [B, max_pages] padded with page 0
    decode_ctx_lens: torch.Tensor  # [B] context length including the new token
    prefills: list[PrefillSegment]
    sliding_window: int | None = None

    @property
    def num_decodes(self) -> int:
        return int(self.decode_token_idx.numel())
