"""Physical page pools. The executor allocates nothing: page ids come from the scheduler's plan.

A page is contiguous across layers (docs/design.md, decision 3)::

    pool[num_pages, num_layers, 2 (K, V), block_size, num_kv_heads, head_dim]

so swapping or copying a page is a single copy of ``page_bytes``. Attention reads per-layer views
``pool[:, layer, 0]`` (K) and ``pool[:, layer, 1]`` (V) of shape [num_pages, block_size, kv_heads, head_dim]
(the "NHD" order of vLLM's and FlashInfer's paged kernels: gathering a request's pages gives its
tokens in order, and a token's heads are adjacent).

With an 8-bit KV cache dtype (executor_svc.kv_quant) the pool is bytes, ``pool[num_pages, num_layers,
K region ++ V region]``: each region holds the 8-bit data then its scales, so a page with its scales is still
one contiguous block of ``page_bytes`` and every page move (swap, spill, copy-on-write, DMA) is unchanged.
``layer()`` then returns ``QuantizedCache`` / ``ChannelScaledCache`` views instead of tensors.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from executor_svc.kv_quant import SCALE_DTYPE, ChannelScaledCache, KvFormat, QuantizedCache, key_rotation
from executor_svc.model_config import ModelConfig

if TYPE_CHECKING:
    from executor_svc.kv_tail import ExactTail

GiB = 1 << 30


def page_bytes(cfg: ModelConfig, block_size: int, dtype: torch.dtype, kv: KvFormat | None = None) -> int:
    """Bytes of one page (all layers, K and V, scales included); ``kv`` None: unquantized ``dtype``."""
    if kv is None:
        elem = torch.empty((), dtype=dtype).element_size()
        return cfg.num_layers * 2 * cfg.num_kv_heads * block_size * cfg.head_dim * elem
    return kv.page_bytes(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, block_size)


def pages_for_budget(budget_bytes: int, bytes_per_page: int) -> int:
    return max(0, budget_bytes // bytes_per_page)


class DevicePagePool:
    def __init__(self, cfg: ModelConfig, num_pages: int, block_size: int, dtype: torch.dtype,
                 device: torch.device, kv: KvFormat | None = None) -> None:
        """``dtype``: the model's; ``kv``: the KV cache format (None or unquantized: pages of its dtype)."""
        if num_pages < 1:
            raise ValueError(f"the page pool needs at least 1 page, got {num_pages}")
        if kv is not None and not kv.quantized:
            dtype, kv = kv.storage, None
        self.num_pages = num_pages
        self.block_size = block_size
        self.kv = kv
        self.kv_dtype = kv.name if kv is not None else str(dtype).removeprefix("torch.")
        self.compute_dtype = dtype  # what attention gets back from a quantized page
        # (queries', keys') rotation when the pages hold rotated keys (kv_quant.key_rotation: FP8), else None
        self.key_rotation = (key_rotation(cfg.head_dim, dtype, device) if kv is not None and kv.rotates_keys
                             else None)
        self.page_bytes = page_bytes(cfg, block_size, dtype, kv)
        if kv is None:
            self.dtype = dtype  # the element type of ``pages`` (host pool, copies)
            shape = (num_pages, cfg.num_layers, 2, block_size, cfg.num_kv_heads, cfg.head_dim)
            self.pages = torch.zeros(shape, dtype=dtype, device=device)
            self.k_views = [self.pages[:, layer, 0] for layer in range(cfg.num_layers)]
            self.v_views = [self.pages[:, layer, 1] for layer in range(cfg.num_layers)]
        else:
            self.dtype = torch.uint8
            heads, dim = cfg.num_kv_heads, cfg.head_dim
            n_data = block_size * heads * dim
            k_bytes, v_bytes = kv.region_bytes(block_size, heads, dim)
            self.pages = torch.zeros((num_pages, cfg.num_layers, k_bytes + v_bytes), dtype=torch.uint8,
                                     device=device)
            assert self.pages[0].numel() == self.page_bytes

            def view(layer: int, start: int, end: int, channel_scales: bool) -> QuantizedCache | ChannelScaledCache:
                region = self.pages[:, layer, start:end]
                data = region[:, :n_data].view(kv.storage).view(num_pages, block_size, heads, dim)
                if channel_scales:
                    return ChannelScaledCache(data, region[:, n_data:].view(num_pages, heads, dim), kv)
                scale = region[:, n_data:].view(SCALE_DTYPE).view(num_pages, block_size, heads)
                return QuantizedCache(data, scale, kv)

            self.k_views = [view(layer, 0, k_bytes, kv.k_channel_scales) for layer in range(cfg.num_layers)]
            self.v_views = [view(layer, k_bytes, k_bytes + v_bytes, False) for layer in range(cfg.num_layers)]
        # Pages that hold LoRA adapters' weights (executor_svc/lora/pages.py), never KV: wipe() keeps them.
        self.held = range(num_pages, num_pages)
        # A kernel for copy-on-write (the cuda attention backend's), or None for plain tensor indexing.
        self.copier: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None] | None = None
        # An 8-bit pool's exact tail (executor_svc/kv_tail.py: a request's last pages also in bfloat16), or None.
        self.tail: ExactTail | None = None

    def attach_tail(self, tail: ExactTail) -> None:
        """Gives this 8-bit pool an exact tail: each layer's views then write their rows to its slab too, and
        attention reads the pages that have a slot from there."""
        if self.kv is None:
            raise ValueError("an exact tail is for 8-bit KV pools only")
        self.tail = tail
        for views, exact in ((self.k_views, tail.k_views), (self.v_views, tail.v_views)):
            for view, slab in zip(views, exact, strict=True):
                view.exact_tail = slab

    def layer(self, index: int) -> tuple[object, object]:
        """(K, V) of one layer: tensors [num_pages, block_size, kv_heads, head_dim], or quantized views."""
        return self.k_views[index], self.v_views[index]

    def hold(self, first: int, count: int) -> torch.Tensor:
        """Pages [first, first + count) for adapters' weights: their bytes, a flat uint8 view of ``pages`` (the
        same memory); from then on they are ``held`` (wipe() keeps them)."""
        if count < 1 or first < 0 or first + count > self.num_pages:
            raise ValueError(f"pages [{first}, {first + count}) are not in the pool of {self.num_pages}")
        self.held = range(first, first + count)
        return self.pages[first:first + count].view(-1).view(torch.uint8)

    def wipe(self) -> None:
        """Zeroes every page (with its scales when quantized) but the held ones: a new Run-stream session reads
        none of an earlier session's KV."""
        if self.tail is not None:
            self.tail.wipe()
        if not self.held:
            self.pages.zero_()
            return
        self.pages[:self.held.start].zero_()
        self.pages[self.held.stop:].zero_()

    def zero_pages(self, page_ids: list[int]) -> None:
        """Zeroes these pages (all layers, scales included): a retained conversation's KV whose retention ended."""
        if page_ids:
            self.pages[torch.tensor(page_ids, dtype=torch.long, device=self.pages.device)] = 0

    def copy_pages(self, src: list[int], dst: list[int]) -> None:
        """Copy-on-write: whole pages, all layers at once. The copier kernel runs the copies in parallel, so
        it gets only independent pairs (no page both read and written, no page written twice); anything
        else takes the indexing path (all reads, then all writes)."""
        if not src:
            return
        src_t = torch.tensor(src, device=self.pages.device)
        dst_t = torch.tensor(dst, device=self.pages.device)
        if self.copier is not None and len(set(dst)) == len(dst) and not set(src) & set(dst):
            self.copier(self.pages, src_t, dst_t)
        else:
            self.pages[dst_t] = self.pages[src_t]


def _runs(pairs: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(src, dst) pairs in plan order as runs (src0, dst0, length) where both ids count up by one.

    The order is kept: a later copy to the same page must still land last."""
    runs: list[list[int]] = []
    for src, dst in pairs:
        if runs and src == runs[-1][0] + runs[-1][2] and dst == runs[-1][1] + runs[-1][2]:
            runs[-1][2] += 1
        else:
            runs.append([src, dst, 1])
    return [tuple(r) for r in runs]


class HostPagePool:
    """The host tier (swap space): the same page shape as the device pool, pinned when the device is
    a GPU so page DMA runs asynchronously. Contents are garbage until a swap-out writes a page."""

    def __init__(self, device_pool: DevicePagePool, num_pages: int) -> None:
        if num_pages < 0:
            raise ValueError(f"the host page pool cannot have {num_pages} pages")
        self.num_pages = num_pages
        self.page_bytes = device_pool.page_bytes
        shape = (num_pages, *device_pool.pages.shape[1:])
        self.pages = torch.empty(shape, dtype=device_pool.dtype, device="cpu")
        self.registered = False
        if device_pool.pages.is_cuda and num_pages:
            self._pin()

    def wipe(self, page_ids: list[int] | None = None) -> None:
        """Zeroes the given pages (every page when None)."""
        if page_ids is None:
            self.pages.zero_()
        elif page_ids:
            self.pages[torch.tensor(page_ids, dtype=torch.long)] = 0

    def _pin(self) -> None:
        """Page-locks exactly the pool's bytes. (``torch.empty(pin_memory=True)`` goes through torch's caching
        host allocator, which rounds a request up to a power of two: 40 GiB of swap space would pin 64.)"""
        nbytes = self.pages.numel() * self.pages.element_size()
        err = int(torch.cuda.cudart().cudaHostRegister(self.pages.data_ptr(), nbytes, 0))
        if err == 0:
            self.registered = True
            return
        # Could not register (e.g. a limit on locked memory): pinned memory from torch's allocator instead.
        clear = getattr(torch.cuda.cudart(), "cudaGetLastError", None)
        if clear is not None:
            clear()  # or a later launch check would report this error
        self.pages = torch.empty(self.pages.shape, dtype=self.pages.dtype, device="cpu", pin_memory=True)

    def __del__(self) -> None:
        if getattr(self, "registered", False):
            try:
                torch.cuda.cudart().cudaHostUnregister(self.pages.data_ptr())
            except Exception:  # noqa: BLE001 - interpreter shutdown
                pass


class PageMover:
    """Page DMA between the device pool and the host pool: whole pages (one copy per page, or per run of
    consecutive pages), in plan order.

    On a GPU the copies run on a stream of their own. It first waits for the work already queued on the
    compute stream (earlier forwards wrote the pages being swapped out), and the compute stream then waits
    for the copies before anything else of the step runs: a device page is never overwritten before its
    copy-out finished, and a request never runs before its copy-in finished. The CPU never waits.
    On the CPU the same operations are plain tensor copies.
    """

    def __init__(self, device_pool: DevicePagePool, host_pool: HostPagePool) -> None:
        self.device = device_pool
        self.host = host_pool
        self.stream = torch.cuda.Stream(device_pool.pages.device) if device_pool.pages.is_cuda else None

    def _copy(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]) -> None:
        dev, host = self.device.pages, self.host.pages
        async_copy = self.stream is not None
        for src, dst, n in _runs(swap_out):
            host[dst:dst + n].copy_(dev[src:src + n], non_blocking=async_copy)
        for src, dst, n in _runs(swap_in):
            dev[dst:dst + n].copy_(host[src:src + n], non_blocking=async_copy)

    def run(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]) -> None:
        """All swap-outs of a step, then all its swap-ins (a page freed by a swap-out may be the target of a
        swap-in in the same step)."""
        if not swap_out and not swap_in:
            return
        if self.stream is None:
            self._copy(swap_out, swap_in)
            return
        compute = torch.cuda.current_stream(self.device.pages.device)
        self.stream.wait_stream(compute)
        with torch.cuda.stream(self.stream):
            self._copy(swap_out, swap_in)
        compute.wait_stream(self.stream)

    def synchronize(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()
