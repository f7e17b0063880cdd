"""Attention with soft-capped scores (Gemma 2), over the paged KV pool.

softmax(cap * tanh(q.k * scale / cap)) is not a scaled dot product, so it cannot go through the backends'
SDPA or kernels. The model writes the step's K/V with the backend (same page layout on every backend) and
reads the pages here, in torch, on any device and KV dtype: causal, the model's per-layer window, the
request's sink + window, exactly the positions the backends make visible. fp32 softmax, as transformers'
eager Gemma 2.
"""

from __future__ import annotations

import torch

from executor_svc.attention.metadata import AttentionMetadata
from executor_svc.attention.torch_backend import decode_visible, gather_pages, prefill_visible


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, scale: float,
            cap: float) -> torch.Tensor:
    """q [B, kv_heads, G, Lq, D] over k, v [B, kv_heads, L, D]; visible broadcasts to [B, 1, 1, Lq, L]."""
    scores = torch.matmul(q, k.unsqueeze(2).transpose(-1, -2)) * scale
    scores = torch.tanh(scores / cap) * cap
    scores = scores.masked_fill(~visible, float("-inf"))
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(weights, v.unsqueeze(2))


def softcapped_attention(q: torch.Tensor, k_cache, v_cache, meta: AttentionMetadata, num_kv_heads: int,
                         scale: float, cap: float) -> torch.Tensor:
    """q [T, heads, head_dim] -> [T, heads, head_dim]; the step's K/V must already be in the pages."""
    n, heads, dim = q.shape
    group = heads // num_kv_heads
    window = meta.sliding_window
    out = torch.empty_like(q)
    for g in meta.decodes:
        batch = g.token_idx.numel()
        if not batch:
            continue
        k = gather_pages(k_cache, g.page_tables, q.dtype)
        v = gather_pages(v_cache, g.page_tables, q.dtype)
        visible = decode_visible(g, window, k.shape[-2], q.device)
        qg = q[g.token_idx].view(batch, num_kv_heads, group, 1, dim)
        out[g.token_idx] = _attend(qg, k, v, visible.view(batch, 1, 1, 1, -1), scale, cap).reshape(batch, heads, dim)
    for seg in meta.prefills:
        k = gather_pages(k_cache, seg.page_ids.view(1, -1), q.dtype)[:, :, : seg.ctx_len]
        v = gather_pages(v_cache, seg.page_ids.view(1, -1), q.dtype)[:, :, : seg.ctx_len]
        visible = prefill_visible(seg, window, q.device)
        rows = slice(seg.q_start, seg.q_start + seg.q_len)
        qs = q[rows].view(seg.q_len, num_kv_heads, group, dim).permute(1, 2, 0, 3).unsqueeze(0)
        o = _attend(qs, k, v, visible.view(1, 1, 1, seg.q_len, -1), scale, cap)  # [1, kv_heads, G, q_len, D]
        out[rows] = o[0].permute(2, 0, 1, 3).reshape(seg.q_len, heads, dim)
    return out
