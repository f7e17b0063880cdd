"""Paged K/V pools, decodes whose tables share a prefix, and the pair of torch backends (reference: gather, then
SDPA; fast: the CPU kernel in place), shared by the CPU attention kernel's tests (test_attention_cpu_kernel.py,
test_attention_cpu_cascade.py)."""

from __future__ import annotations

import torch

from executor_svc.attention.metadata import AttentionMetadata, DecodeGroup
from executor_svc.attention.torch_backend import TorchPagedAttention


def pool_views(num_pages: int, block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
               g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of layer 1 of a 3-layer pool: page stride spans every layer, as executor_svc.pages lays out."""
    pool = torch.randn(num_pages, 3, 2, block_size, kv_heads, head_dim, generator=g).to(dtype)
    return pool[:, 1, 0], pool[:, 1, 1]


def both(heads: int, kv_heads: int, head_dim: int) -> tuple[TorchPagedAttention, TorchPagedAttention]:
    scale = head_dim ** -0.5
    return (TorchPagedAttention(heads, kv_heads, head_dim, scale, reference=True),
            TorchPagedAttention(heads, kv_heads, head_dim, scale))


def shared_meta(ctx_lens: list[int], shared: int, block_size: int, num_pages: int, g: torch.Generator,
                diverge: dict[int, int] | None = None) -> AttentionMetadata:
    """Decodes whose tables begin with the same ``shared`` pages (a cached prompt prefix), then pages of their own;
    ``diverge`` {row: page}: that row has a page of its own from that page on."""
    perm = torch.randperm(num_pages, generator=g).tolist()
    prefix = [perm.pop() for _ in range(shared)]
    width = max(-(-c // block_size) for c in ctx_lens) + 1
    tables = []
    for row, c in enumerate(ctx_lens):
        own_from = (diverge or {}).get(row, shared)
        t = prefix[:own_from] + [perm.pop() for _ in range(-(-c // block_size) - own_from)]
        tables.append(t + [0] * (width - len(t)))
    group = DecodeGroup(torch.arange(len(ctx_lens)), torch.tensor(tables), torch.tensor(ctx_lens))
    empty = torch.zeros(0, dtype=torch.long)
    return AttentionMetadata(empty, empty, [group], [])
