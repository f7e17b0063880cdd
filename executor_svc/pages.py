"""Physical page pools. The executor allocates nothing: page ids come from the scheduler's plan.

A page is contiguous across layers (DESIGN.md, decision 3)::

    pool[num_pages, num_layers, 2 (K, V), block_size, num_kv_heads, head_dim]

so swapping or copying a page is a single copy of ``page_bytes``. Attention reads per-layer views
``pool[:, layer, 0]`` (K) and ``pool[:, layer, 1]`` (V) of shape [num_pages, block_size, kv_heads, head_dim]
(the "NHD" order of vLLM's and FlashInfer's paged kernels: gathering a request's pages gives its
tokens in order, and a token's heads are adjacent).
"""

from __future__ import annotations

import torch

from executor_svc.model_config import ModelConfig

GiB = 1 << 30


def page_bytes(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return cfg.num_layers * 2 * cfg.num_kv_heads * block_size * cfg.head_dim * elem


def pages_for_budget(budget_bytes: int, bytes_per_page: int) -> int:
    return max(0, budget_bytes // bytes_per_page)


class DevicePagePool:
    def __init__(self, cfg: ModelConfig, num_pages: int, block_size: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        if num_pages < 1:
            raise ValueError(f"the page pool needs at least 1 page, got {num_pages}")
        self.num_pages = num_pages
        self.block_size = block_size
        self.dtype = dtype
        self.page_bytes = page_bytes(cfg, block_size, dtype)
        shape = (num_pages, cfg.num_layers, 2, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.pages = torch.zeros(shape, dtype=dtype, device=device)
        self.k_views = [self.pages[:, layer, 0] for layer in range(cfg.num_layers)]
        self.v_views = [self.pages[:, layer, 1] for layer in range(cfg.num_layers)]

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_views[index], self.v_views[index]

    def copy_pages(self, src: list[int], dst: list[int]) -> None:
        """Copy-on-write: whole pages, all layers at once."""
        if src:
            self.pages[torch.tensor(dst, device=self.pages.device)] = self.pages[
                torch.tensor(src, device=self.pages.device)
            ]
