"""What every paged attention backend offers the model and the runner.

A backend reads and writes the page layout of ``executor_svc.pages``: one layer's K (or V) cache is a view
``[num_pages, block_size, num_kv_heads, head_dim]`` of the pool, or on an 8-bit pool a ``QuantizedCache`` /
``ChannelScaledCache`` over the same bytes (executor_svc.kv_quant). Each layer calls ``write_cache`` with the
step's new K/V, then ``forward``; both read their token layout from the step's ``AttentionMetadata``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

import torch

from executor_svc.attention.metadata import AttentionMetadata
from executor_svc.kv_quant import ChannelScaledCache, QuantizedCache

KVCache = torch.Tensor | QuantizedCache | ChannelScaledCache  # one layer's K or V pages
PageCopier = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]  # (pool pages, src ids, dst ids)


@runtime_checkable
class PagedAttention(Protocol):
    """Built as ``Backend(num_heads, num_kv_heads, head_dim, scale)`` (``executor_svc.attention.BACKENDS``)."""

    name: str  # what --attention-backend calls it
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    # A faster copy of whole pages inside the device pool (copy-on-write), or None: the pool copies with torch.
    copy_pages: PageCopier | None
    # Whether write_cache stores K/V as they are into plain tensor pages, so that a model may store them itself the
    # same way (the fused CPU path's rotary_write: executor_svc/model/step_path.py); False: a model always calls it.
    plain_cache_writes: bool

    def write_cache(self, k_cache: KVCache, v_cache: KVCache, k: torch.Tensor, v: torch.Tensor,
                    meta: AttentionMetadata) -> None:
        """Stores the step's new K/V ([T, kv_heads, head_dim]) into their slots (``meta.slot_pages``,
        ``meta.slot_offsets``); an 8-bit cache quantizes them."""
        ...

    def forward(self, q: torch.Tensor, k_cache: KVCache, v_cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        """q: [T, heads, head_dim] -> [T, heads, head_dim], each token attending over its request's visible
        context (causal, sink + window, the model's sliding window). The step's K/V must already be written."""
        ...
