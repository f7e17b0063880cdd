"""Reference paged attention in plain PyTorch (CPU and GPU).

It reads K/V through page tables from the per-layer views of the page pool
``[num_pages, num_kv_heads, block_size, head_dim]`` and follows the arithmetic of
transformers' eager attention (matmul, fp32 softmax, matmul) so that greedy output matches it.
"""

from __future__ import annotations

import torch

from executor_svc.attention.metadata import AttentionMetadata, PrefillSegment


class TorchPagedAttention:
    name = "torch"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.group = num_heads // num_kv_heads
        self.head_dim = head_dim
        self.scale = scale

    def write_cache(
        self, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        meta: AttentionMetadata,
    ) -> None:
        """Stores the step's new K/V ([T, kv_heads, head_dim]) into their slots."""
        k_cache[meta.slot_pages, :, meta.slot_offsets] = k
        v_cache[meta.slot_pages, :, meta.slot_offsets] = v

    def forward(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """q: [T, heads, head_dim] -> [T, heads, head_dim]; the step's K/V must already be written."""
        out = torch.empty_like(q)
        if meta.num_decodes:
            out[meta.decode_token_idx] = self._decode(q[meta.decode_token_idx], k_cache, v_cache, meta)
        for seg in meta.prefills:
            rows = slice(seg.q_start, seg.q_start + seg.q_len)
            out[rows] = self._prefill(q[rows], k_cache, v_cache, seg, meta.sliding_window)
        return out

    def _gather(self, cache: torch.Tensor, page_ids: torch.Tensor) -> torch.Tensor:
        """[..., pages] -> [..., kv_heads, pages * block_size, head_dim]."""
        pages = cache[page_ids]  # [..., P, H, bs, D]
        pages = pages.transpose(-3, -4)  # [..., H, P, bs, D]
        return pages.reshape(*pages.shape[:-3], -1, self.head_dim)

    def _decode(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        batch = q.shape[0]
        k = self._gather(k_cache, meta.decode_page_tables)  # [B, H, L, D]
        v = self._gather(v_cache, meta.decode_page_tables)
        qg = q.view(batch, self.num_kv_heads, self.group, self.head_dim)
        scores = torch.matmul(qg, k.transpose(-1, -2)) * self.scale  # [B, H, G, L]
        pos = torch.arange(k.shape[-2], device=q.device)
        ctx = meta.decode_ctx_lens.view(batch, 1)
        invisible = pos.view(1, -1) >= ctx
        if meta.sliding_window:
            invisible |= pos.view(1, -1) <= ctx - 1 - meta.sliding_window
        scores.masked_fill_(invisible.view(batch, 1, 1, -1), float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(probs, v).reshape(batch, self.num_heads, self.head_dim)

    def _prefill(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seg: PrefillSegment,
        window: int | None,
    ) -> torch.Tensor:
        k = self._gather(k_cache, seg.page_ids)[:, : seg.ctx_len]  # [H, ctx, D]
        v = self._gather(v_cache, seg.page_ids)[:, : seg.ctx_len]
        k = k.repeat_interleave(self.group, dim=0)  # [heads, ctx, D]
        v = v.repeat_interleave(self.group, dim=0)
        qh = q.transpose(0, 1)  # [heads, q_len, D]
        scores = torch.matmul(qh, k.transpose(-1, -2)) * self.scale  # [heads, q_len, ctx]
        q_pos = torch.arange(seg.ctx_len - seg.q_len, seg.ctx_len, device=q.device).view(-1, 1)
        k_pos = torch.arange(seg.ctx_len, device=q.device).view(1, -1)
        invisible = k_pos > q_pos
        if window:
            invisible |= k_pos <= q_pos - window
        scores.masked_fill_(invisible, float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(probs, v).transpose(0, 1)
