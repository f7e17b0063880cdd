"""Where the served adapters' weights live (#52): page-sized slots of the KV pool, so that the scheduler's page
accounting covers both. The pool is sized as without adapters (--num-pages, --kv-cache-gb, the memory there is);
the adapters take its last pages before the scratch page, [kv_pages, num_pages), and Describe's num_device_pages
is ``kv_pages``: the scheduler never plans KV into them, and they come out of the pool before any tenant's quota
(start-up adapters are public: a shared allowance).

Each adapter holds one contiguous run of ``each`` pages: its region of the stack (stack.py lays the stacks out by
adapter), its A/B weights padded to the largest rank served and to every module any adapter targets, in the model's
dtype. A region is ``ceil(region bytes / page_bytes)`` pages, rounded up when page_bytes is not a multiple of
ALIGN_BYTES so that every region starts aligned; the reported pages are what each adapter really holds (padding
included), and the few pages kept after the last region to align the first one (``spare``: none for any real
model's page, a multiple of 16 bytes) are counted to the last adapter. The stack's tensors are views of these pages'
bytes, reinterpreted as the model's dtype: no other allocation.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import gcd

import torch

from executor_svc.lora.adapter import LoraAdapter
from executor_svc.lora.stack import ALIGN_BYTES, SlotShape, region_bytes
from executor_svc.model_config import ModelConfig
from executor_svc.pages import DevicePagePool

MIN_KV_PAGES = 16  # the KV pages the adapters must leave (or a request of the model's full context, when fewer)


def pages_for(num_bytes: int, page_bytes: int) -> int:
    """Pages of ``page_bytes`` that ``num_bytes`` take (ceil)."""
    return -(-num_bytes // page_bytes)


@dataclass(frozen=True, slots=True)
class AdapterPages:
    """The pool's pages the adapters hold: adapter k's region is pages [first + k * each, first + (k + 1) * each);
    ``spare`` pages after the last region keep the first aligned."""

    first: int  # the first held page: the KV pages left are [0, first)
    count: int  # adapters
    each: int  # pages of one adapter's region
    spare: int
    page_bytes: int

    @property
    def total(self) -> int:
        return self.count * self.each + self.spare

    def per_adapter(self) -> list[int]:
        """The pages each adapter holds, in load order (Adapter.num_pages): ``each``, the spare ones to the last."""
        return [self.each] * (self.count - 1) + [self.each + self.spare]

    def carve(self, pool: DevicePagePool, dtype: torch.dtype) -> torch.Tensor:
        """[count, each * page_bytes / element size] of ``dtype`` over the held pages of ``pool`` (LoraStack's
        ``memory``): row k is adapter k's region, the same memory as the pool's pages."""
        if pool.page_bytes != self.page_bytes:
            raise ValueError(f"the pool's pages are {pool.page_bytes} bytes, not {self.page_bytes}")
        held = pool.hold(self.first, self.total)
        return held[:self.count * self.each * self.page_bytes].view(self.count, self.each * self.page_bytes).view(dtype)


def plan_pages(adapters: list[LoraAdapter] | SlotShape, cfg: ModelConfig, dtype: torch.dtype, num_pages: int,
               page_bytes: int, count: int | None = None) -> AdapterPages:
    """Where ``count`` slots (default: one per adapter of ``adapters``, shaped for them; or of the SlotShape
    given) go in a pool of ``num_pages`` KV-usable pages (the scratch page apart) of ``page_bytes``."""
    count = len(adapters) if count is None else count
    step = ALIGN_BYTES // gcd(page_bytes, ALIGN_BYTES)  # pages whose bytes are a multiple of ALIGN_BYTES
    each = -(-pages_for(region_bytes(adapters, cfg, dtype), page_bytes) // step) * step
    first, spare = num_pages - count * each, 0
    while first > 0 and first * page_bytes % ALIGN_BYTES:
        first, spare = first - 1, spare + 1
    return AdapterPages(first, count, each, spare, page_bytes)


def check_kv_left(held: AdapterPages, num_pages: int, rank: int, cfg: ModelConfig, block_size: int,
                  asked: str) -> None:
    """Refuses adapters that leave the KV fewer than MIN_KV_PAGES pages (or a request of the model's full context,
    when that is fewer): as ValueError naming --lora-modules, the pages they need and the pool's size (``asked``:
    the flag that sized it)."""
    need = min(pages_for(cfg.max_position_embeddings, block_size), MIN_KV_PAGES)
    if held.first >= need:
        return
    raise ValueError(
        f"--lora-modules / --max-loras: the {held.count} adapter slots need {held.total} pages of the KV pool "
        f"({held.each} each of {held.page_bytes} bytes, padded to rank {rank}), but the pool has {num_pages} pages "
        f"({asked}): "
        f"{max(held.first, 0)} would be left for KV, fewer than the {need} it needs at least; give the pool at "
        f"least {need + held.total} pages (--num-pages, --kv-cache-gb), or serve fewer adapters or lower "
        "ranks")
