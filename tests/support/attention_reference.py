"""Dense attention over contiguous K/V: what the paged backends are checked against (test_attention.py,
test_kv_quant.py)."""

from __future__ import annotations

import torch


def dense(q, k, v, ctx_len, q_len, scale, window=None):
    """q [q_len, Hq, D]; k, v [ctx_len, Hkv, D]; causal over the last q_len positions."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, 1).transpose(0, 1)
    v = v.repeat_interleave(group, 1).transpose(0, 1)
    s = q.transpose(0, 1) @ k.transpose(1, 2) * scale
    qp = torch.arange(ctx_len - q_len, ctx_len).view(-1, 1)
    kp = torch.arange(ctx_len).view(1, -1)
    mask = kp > qp
    if window:
        mask |= kp <= qp - window
    s = s.masked_fill(mask, float("-inf"))
    return (torch.softmax(s.float(), -1).to(q.dtype) @ v).transpose(0, 1)
