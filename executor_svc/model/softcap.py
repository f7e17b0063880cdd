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


def _gather(cache, page_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Pages [B, n] of one layer's K or V -> [B, kv_heads, n * block_size, head_dim]."""
    batch = page_ids.shape[0]
    flat = page_ids.reshape(-1)
    pages = cache.index_select(0, flat).to(dtype) if isinstance(cache, torch.Tensor) else cache.gather(flat, dtype)
    return pages.reshape(batch, -1, pages.shape[-2], pages.shape[-1]).transpose(1, 2)


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
        k = _gather(k_cache, g.page_tables, q.dtype)
        v = _gather(v_cache, g.page_tables, q.dtype)
        pos = torch.arange(k.shape[-2], device=q.device).view(1, -1)
        ctx = g.ctx_lens.view(batch, 1)
        visible = pos < ctx
        if window:
            visible &= pos > ctx - 1 - window
        if g.windows is not None:
            w = g.windows.view(batch, 1)
            visible &= (w == 0) | (pos < g.sinks.view(batch, 1)) | (pos > ctx - 1 - w)
        qg = q[g.token_idx].view(batch, num_kv_heads, group, 1, dim)
        out[g.token_idx] = _attend(qg, k, v, visible.view(batch, 1, 1, 1, -1), scale, cap).reshape(batch, heads, dim)
    for seg in meta.prefills:
        k = _gather(k_cache, seg.page_ids.view(1, -1), q.dtype)[:, :, : seg.ctx_len]
        v = _gather(v_cache, seg.page_ids.view(1, -1), q.dtype)[:, :, : seg.ctx_len]
        q_pos = torch.arange(seg.ctx_len - seg.q_len, seg.ctx_len, device=q.device).view(-1, 1)
        k_pos = torch.arange(seg.ctx_len, device=q.device).view(1, -1)
        visible = k_pos <= q_pos
        if window:
            visible &= k_pos > q_pos - window
        if seg.window:
            visible &= (k_pos < seg.sink) | (k_pos > q_pos - seg.window)
        rows = slice(seg.q_start, seg.q_start + seg.q_len)
        qs = q[rows].view(seg.q_len, num_kv_heads, group, dim).permute(1, 2, 0, 3).unsqueeze(0)
        o = _attend(qs, k, v, visible.view(1, 1, 1, seg.q_len, -1), scale, cap)  # [1, kv_heads, G, q_len, D]
        out[rows] = o[0].permute(2, 0, 1, 3).reshape(seg.q_len, heads, dim)
    return out
