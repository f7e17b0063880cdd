"""What the CUDA kernels of ``kernels_cuda/`` are handed (cuda_backend.py): the checks that they can address a
layer's K/V views (dtype, device, shape, unit stride along head_dim, 16-byte or, for 8-bit pages, 8-byte alignment),
their arguments as the kernels read them (int64 / int32 scalars, int64 index tensors, aligned rows), and prepared
launches kept with the tensors they point into.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from executor_svc.kv_quant import ChannelScaledCache, QuantizedCache

DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}


def i64(x: int) -> np.int64:
    return np.int64(x)


def i32(x: int) -> np.int32:
    return np.int32(x)


def index(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """An index tensor as the kernels read it: int64, contiguous, on the device (no copy when it already is)."""
    return t.to(device=device, dtype=torch.int64).contiguous()


def rows_ready(t: torch.Tensor) -> torch.Tensor:
    """[N, heads, D] with unit stride along D and 16-byte aligned rows (16-byte vector access); a copy only
    when it is not."""
    elem = t.element_size()
    if (t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and (t.stride(0) * elem) % 16 == 0
            and (t.stride(1) * elem) % 16 == 0):
        return t
    return t.contiguous()


class Launches:
    """Prepared kernel launches, with the tensors their arguments point into (kept alive with them)."""

    __slots__ = ("launches", "tensors")

    def __init__(self, launches: list[Callable[[], None]], tensors: tuple[torch.Tensor | None, ...]) -> None:
        self.launches = launches
        self.tensors = tensors

    def __call__(self) -> None:
        for launch in self.launches:
            launch()


def pool_args(k_cache: torch.Tensor, v_cache: torch.Tensor, kv_heads: int, head_dim: int,
              emulated: bool) -> tuple[str, list[object]]:
    """The dtype name and (page, slot, head) strides of a layer's K/V views, after checking that the
    kernels can address them (``emulated``: the kernels run on the host, so the pool may too)."""
    dtype = DTYPE_NAMES.get(k_cache.dtype)
    if dtype is None or v_cache.dtype != k_cache.dtype:
        raise TypeError(f"cuda attention: K/V cache dtype {k_cache.dtype}/{v_cache.dtype} is not supported "
                        f"(supported: {', '.join(DTYPE_NAMES.values())})")
    if not k_cache.is_cuda and not emulated:
        raise ValueError(f"cuda attention: the page pool is on {k_cache.device}, not a CUDA device")
    if tuple(k_cache.shape[2:]) != (kv_heads, head_dim) or v_cache.shape != k_cache.shape:
        raise ValueError(f"cuda attention: K/V views {tuple(k_cache.shape)} / {tuple(v_cache.shape)} do not "
                         f"hold [pages, block, {kv_heads} kv heads, {head_dim}]")
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError(f"cuda attention: K/V views need equal strides and unit stride along head_dim, got "
                         f"{k_cache.stride()} / {v_cache.stride()}")
    elem = k_cache.element_size()
    if any(p % 16 for p in (k_cache.data_ptr(), v_cache.data_ptr())) or any(
            (s * elem) % 16 for s in k_cache.stride()[:3]):
        raise ValueError("cuda attention: K/V pages must be 16-byte aligned (pointers and strides)")
    return dtype, [i64(k_cache.stride(0)), i64(k_cache.stride(1)), i64(k_cache.stride(2))]


def block_shift(k_cache: torch.Tensor) -> int:
    block_size = k_cache.shape[1]
    if block_size < 1 or block_size & (block_size - 1):
        raise ValueError(f"cuda attention: block_size must be a power of two, got {block_size}")
    return block_size.bit_length() - 1


def q8_args(k_cache, v_cache, kv_heads: int, head_dim: int, emulated: bool) -> tuple[str, list[object]]:
    """8-bit pages (executor_svc.kv_quant): the format and the decode kernel's pool arguments (the four
    region pointers, then page / slot / head strides in bytes), after checking the layout it reads."""
    kind = "int8" if isinstance(k_cache, ChannelScaledCache) else "fp8_e4m3"
    want_k = ChannelScaledCache if kind == "int8" else QuantizedCache
    if not isinstance(k_cache, want_k) or not isinstance(v_cache, QuantizedCache):
        raise TypeError(f"cuda attention: 8-bit K/V views {type(k_cache).__name__}/{type(v_cache).__name__} do "
                        "not match one format")
    k, v = k_cache.data, v_cache.data
    if not k.is_cuda and not emulated:
        raise ValueError(f"cuda attention: the page pool is on {k.device}, not a CUDA device")
    if tuple(k.shape[2:]) != (kv_heads, head_dim) or v.shape != k.shape:
        raise ValueError(f"cuda attention: K/V views {tuple(k.shape)} / {tuple(v.shape)} do not hold "
                         f"[pages, block, {kv_heads} kv heads, {head_dim}]")
    if k.stride() != v.stride() or k.stride()[1:] != (kv_heads * head_dim, head_dim, 1):
        raise ValueError(f"cuda attention: 8-bit K/V views need packed slots, got {k.stride()} / {v.stride()}")
    ks = k_cache.exp if kind == "int8" else k_cache.scale
    if any(t.data_ptr() % 8 for t in (k, v, ks)) or k.stride(0) % 8:
        raise ValueError("cuda attention: 8-bit K/V pages must be 8-byte aligned")
    return kind, [k, ks, v, v_cache.scale, i64(k.stride(0)), i64(k.stride(1)), i64(k.stride(2))]
