"""Paged attention with the CUDA kernels of ``kernels_cuda/`` (CuPy RawKernels, NVRTC-compiled).

The same interface and page layout as ``TorchPagedAttention`` (the reference it is tested against):

* ``write_cache``: one kernel writes the step's new K/V into their slots.
* decodes: ``paged_decode`` reads each request's K/V through its page table, once per query group (GQA), and
  only the positions its sink/window leaves visible; long contexts are split into partitions of
  ``partition_tokens`` and merged by ``paged_decode_reduce``. Queries are read and outputs written in place
  at the group's token rows (no gather/scatter copies).
* prefill segments (tokens with cached context before them): ``gather_kv`` copies the segment's context
  into contiguous [kv_heads, ctx, head_dim] K/V, then torch's SDPA with the reference's causal/sink/window
  mask (a first version: a gather + SDPA, not a fused paged prefill kernel).
* ``copy_pages``: copy-on-write of whole pages inside the pool (used by ``DevicePagePool.copy_pages``).
* 8-bit pages (``--kv-cache-dtype fp8_e4m3|int8``, executor_svc.kv_quant): ``write_kv_q8_token`` and
  ``write_k_i8_channel`` quantize the step's K/V into the pages (the torch reference's arithmetic, the same
  bytes); decodes run ``paged_decode_q8``, which reads the 8-bit K/V and their scales and dequantizes in
  registers (no dequantized copy of the pool); prefill segments gather their context with ``gather_kv_q8``,
  which dequantizes into the model dtype for SDPA (the torch reference's exact values).

The checks that the kernels can address a layer's pages, and their arguments as they read them: cuda_args.py.
Importing this module needs neither CUDA nor CuPy; the kernels compile (or load from CuPy's cache) on
first use. ``unavailable_reason`` says why the backend cannot run somewhere.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from executor_svc.attention.cuda_args import (
    DTYPE_NAMES,
    Launches,
    block_shift,
    i32,
    i64,
    index,
    pool_args,
    q8_args,
    rows_ready,
)
from executor_svc.attention.metadata import AttentionMetadata, DecodeGroup, PrefillSegment
from executor_svc.attention.torch_backend import QUANTIZED, TorchPagedAttention
from kernels_cuda import specs

DEFAULT_PARTITION_TOKENS = 512
DECODE_THREADS = 128  # kThreads in decode.cu
LOG2E = 1.4426950408889634


def unavailable_reason(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """None when the CUDA backend can serve this model here; otherwise the reason, for the user."""
    if device.type != "cuda":
        return f"it needs a CUDA device (the executor runs on {device}; see --device)"
    if not torch.cuda.is_available():
        return "CUDA is not available to torch on this machine"
    if dtype not in DTYPE_NAMES:
        return f"dtype {dtype} is not supported (supported: {', '.join(DTYPE_NAMES.values())})"
    if head_dim not in specs.HEAD_DIMS:
        return f"head_dim {head_dim} is not supported (supported: {', '.join(map(str, specs.HEAD_DIMS))})"
    from kernels_cuda.loader import cupy_import_error

    err = cupy_import_error()
    if err is not None:
        return f"CuPy is not importable ({err}); install it with pip install 'pagedkv[cuda]' (cupy-cuda13x)"
    return None


class CudaPagedAttention:
    """The CUDA kernels' backend (an ``executor_svc.attention.PagedAttention``)."""

    name = "cuda"
    plain_cache_writes = False  # (its own kernels write the pages: PagedAttention.plain_cache_writes)

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 partition_tokens: int = DEFAULT_PARTITION_TOKENS, library: object | None = None) -> None:
        """``library``: where kernels come from (default: ``kernels_cuda.loader.library`` of the tensors'
        device; the tests pass a CPU emulator of the same kernel source)."""
        if head_dim not in specs.HEAD_DIMS:
            raise ValueError(f"the cuda attention backend supports head_dim {specs.HEAD_DIMS}, got {head_dim}")
        if partition_tokens < 1:
            raise ValueError(f"partition_tokens must be >= 1, got {partition_tokens}")
        self.reference = TorchPagedAttention(num_heads, num_kv_heads, head_dim, scale)  # prefill after gather
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.group = num_heads // num_kv_heads
        self.tile = specs.group_tile(self.group)
        self.chunks = -(-self.group // self.tile)
        self.partition_tokens = partition_tokens
        self.library = library
        self.emulated = bool(getattr(library, "emulated", False))  # kernels run on the host: so may the pool

    def _library(self, device: torch.device):
        if self.library is not None:
            return self.library
        from kernels_cuda.loader import library

        return library(device)

    # ---- the interface ---------------------------------------------------------------------------
    def write_cache(
        self, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        meta: AttentionMetadata,
    ) -> None:
        """Stores the step's new K/V ([T, kv_heads, head_dim]) into their slots (8-bit pages: quantized, with the
        same arithmetic and bytes as the torch reference)."""
        n = k.shape[0]
        if n == 0:
            return
        if isinstance(k_cache, QUANTIZED):
            self._write_q8(k_cache, v_cache, k, v, meta)
            return
        dtype, strides = pool_args(k_cache, v_cache, self.num_kv_heads, self.head_dim, self.emulated)
        if k.dtype != k_cache.dtype or v.dtype != k_cache.dtype:
            raise TypeError(f"cuda attention: new K/V dtype {k.dtype}/{v.dtype} differs from the cache's "
                            f"{k_cache.dtype}")
        k, v = rows_ready(k), rows_ready(v)
        self._library(k_cache.device).launch(
            "cache.cu", specs.write_name(dtype), (n, 1, 1), (128, 1, 1),
            [k_cache, v_cache, *strides, k, i64(k.stride(0)), i64(k.stride(1)),
             v, i64(v.stride(0)), i64(v.stride(1)),
             index(meta.slot_pages, k_cache.device), index(meta.slot_offsets, k_cache.device),
             i32(self.num_kv_heads), i32(self.head_dim)])

    def _write_q8(self, k_cache, v_cache, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
        kind, args = q8_args(k_cache, v_cache, self.num_kv_heads, self.head_dim, self.emulated)
        kd, ks, vd, vs, page_stride, slot_stride, _ = args
        dtype = DTYPE_NAMES.get(k.dtype)
        if dtype is None or v.dtype != k.dtype:
            raise TypeError(f"cuda attention: new K/V dtype {k.dtype}/{v.dtype} is not supported")
        if k.stride(-1) != 1 or v.stride(-1) != 1:
            k, v = k.contiguous(), v.contiguous()
        device = kd.device
        pages, offsets = index(meta.slot_pages, device), index(meta.slot_offsets, device)
        lib = self._library(device)
        n = k.shape[0]
        common = [i32(self.num_kv_heads), i32(self.head_dim)]
        if kind == "int8":  # K: per-channel exponents, one CTA per (page run, head)
            lib.launch("cache.cu", specs.write_k_i8_channel_name(dtype), (n, self.num_kv_heads, 1),
                       (self.head_dim, 1, 1),
                       [kd, ks, page_stride, slot_stride, k, i64(k.stride(0)), i64(k.stride(1)), pages, offsets,
                        i32(n), *common])
        else:
            lib.launch("cache.cu", specs.write_q8_token_name(dtype, kind), (n, 1, 1), (128, 1, 1),
                       [kd, ks, page_stride, slot_stride, k, i64(k.stride(0)), i64(k.stride(1)), pages, offsets,
                        *common])
        lib.launch("cache.cu", specs.write_q8_token_name(dtype, kind), (n, 1, 1), (128, 1, 1),
                   [vd, vs, page_stride, slot_stride, v, i64(v.stride(0)), i64(v.stride(1)), pages, offsets,
                    *common])

    def forward(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """q: [T, heads, head_dim] -> [T, heads, head_dim]; the step's K/V must already be written."""
        q = rows_ready(q)
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
        for group in meta.decodes:
            self.decode(q, out, k_cache, v_cache, group, meta.sliding_window)
        for seg in meta.prefills:
            rows = slice(seg.q_start, seg.q_start + seg.q_len)
            out[rows] = self.prefill(q[rows], k_cache, v_cache, seg, meta.sliding_window)
        return out

    def num_partitions(self, group: DecodeGroup, block_size: int, window: int | None) -> int:
        """Partitions of the longest possible visible context of the group (known from shapes alone: no
        device synchronisation); 1 means no split."""
        longest = group.page_tables.shape[1] * block_size
        if window:
            longest = min(longest, window)
        parts = max(1, -(-longest // self.partition_tokens))
        if parts > 65535:
            raise ValueError(f"cuda attention: {parts} partitions of {self.partition_tokens} tokens; the grid holds "
                             "at most 65535 (raise partition_tokens)")
        return parts

    def decode(self, q: torch.Tensor, out: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               group: DecodeGroup, window: int | None) -> None:
        """Writes out[token_idx] for the group's decodes, reading q[token_idx]."""
        if group.page_tables.shape[0]:
            self.prepare_decode(q, out, k_cache, v_cache, group, window)()

    def prepare_decode(self, q: torch.Tensor, out: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       group: DecodeGroup, window: int | None) -> Callable[[], None]:
        """The decode's kernel launches with every argument computed: calling the result launches them (again).
        (The benchmarks time this, so that Python's per-call checks do not count as kernel time.)"""
        batch = group.page_tables.shape[0]
        if isinstance(k_cache, QUANTIZED):  # 8-bit pages: read and dequantized in registers by paged_decode_q8
            kv8, pool = q8_args(k_cache, v_cache, self.num_kv_heads, self.head_dim, self.emulated)
            dtype = DTYPE_NAMES.get(q.dtype)
            if dtype is None:
                raise TypeError(f"cuda attention: q dtype {q.dtype} is not supported")
            name = specs.decode_q8_name(dtype, kv8, self.head_dim, self.tile)
            k_cache = k_cache.data  # for the shapes below
        else:
            dtype, strides = pool_args(k_cache, v_cache, self.num_kv_heads, self.head_dim, self.emulated)
            if q.dtype != k_cache.dtype:
                raise TypeError(f"cuda attention: q dtype {q.dtype} differs from the cache's {k_cache.dtype}")
            name = specs.decode_name(dtype, self.head_dim, self.tile)
            pool = [k_cache, v_cache, *strides]
        q = rows_ready(q)  # 16-byte vector loads: a copy only when q's rows are not aligned
        if rows_ready(out) is not out:
            raise ValueError("cuda attention: out needs unit stride along head_dim and 16-byte aligned rows")
        for t, heads in ((q, self.num_heads), (out, self.num_heads)):
            if tuple(t.shape[1:]) != (heads, self.head_dim):
                raise ValueError(f"cuda attention: q/out {tuple(t.shape)} is not [tokens, {heads}, {self.head_dim}]")
        if batch > 65535:
            raise ValueError(f"cuda attention: {batch} decodes in one group; the grid holds at most 65535")
        device = k_cache.device
        shift = block_shift(k_cache)
        parts = self.num_partitions(group, k_cache.shape[1], window)
        # no partition is longer than the table: keeps the kernels' int32 position arithmetic in range
        part_tokens = min(self.partition_tokens, group.page_tables.shape[1] * k_cache.shape[1])
        part_acc = part_ml = None
        if parts > 1:
            part_acc = torch.empty((batch, self.num_heads, parts, self.head_dim), dtype=torch.float32, device=device)
            part_ml = torch.empty((batch, self.num_heads, parts, 2), dtype=torch.float32, device=device)
        token_idx = index(group.token_idx, device)
        tables = index(group.page_tables, device)
        ctx_lens = index(group.ctx_lens, device)
        windows = index(group.windows, device) if group.windows is not None else None
        sinks = index(group.sinks, device) if windows is not None and group.sinks is not None else None
        from kernels_cuda.loader import Pointer

        lib = self._library(device)
        launches = [lib.prepare(
            "decode.cu", name, (self.num_kv_heads * self.chunks, batch, parts), (DECODE_THREADS, 1, 1),
            [out, i64(out.stride(0)), i64(out.stride(1)), q, i64(q.stride(0)), i64(q.stride(1)), token_idx,
             *pool, tables, i64(tables.stride(0)), ctx_lens, Pointer(sinks), Pointer(windows),
             i32(window or 0), i32(self.group), i32(self.chunks), i32(shift), np.float32(self.scale * LOG2E),
             i32(part_tokens), i32(parts), Pointer(part_acc), Pointer(part_ml)])]
        if parts > 1:
            launches.append(lib.prepare(
                "decode.cu", specs.reduce_name(dtype, self.head_dim), (self.num_heads, batch, 1),
                (self.head_dim, 1, 1),
                [out, i64(out.stride(0)), i64(out.stride(1)), token_idx, ctx_lens, Pointer(sinks),
                 Pointer(windows), i32(window or 0), i32(part_tokens), i32(parts), part_acc, part_ml]))
        return Launches(launches, (tables, token_idx, ctx_lens, sinks, windows, part_acc, part_ml))

    def gather(self, k_cache: torch.Tensor, v_cache: torch.Tensor, page_ids: torch.Tensor,
               ctx_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions [0, ctx_len) through page_ids as contiguous K, V [1, kv_heads, ctx_len, head_dim]."""
        dtype, strides = pool_args(k_cache, v_cache, self.num_kv_heads, self.head_dim, self.emulated)
        shape = (1, self.num_kv_heads, ctx_len, self.head_dim)
        k = torch.empty(shape, dtype=k_cache.dtype, device=k_cache.device)
        v = torch.empty(shape, dtype=k_cache.dtype, device=k_cache.device)
        vectors = self.num_kv_heads * ctx_len * self.head_dim * k.element_size() // 16
        self._library(k_cache.device).launch(
            "cache.cu", specs.gather_name(dtype), (-(-vectors // 256), 1, 1), (256, 1, 1),
            [k, v, k_cache, v_cache, *strides, index(page_ids, k_cache.device), i32(ctx_len),
             i32(self.num_kv_heads), i32(self.head_dim), i32(block_shift(k_cache))])
        return k, v

    def gather_q8(self, k_cache, v_cache, page_ids: torch.Tensor, ctx_len: int,
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """8-bit pages: positions [0, ctx_len) dequantized into contiguous K, V [1, kv_heads, ctx_len, head_dim]."""
        kind, args = q8_args(k_cache, v_cache, self.num_kv_heads, self.head_dim, self.emulated)
        kd, ks, vd, vs, page_stride, slot_stride, _ = args
        name = DTYPE_NAMES.get(dtype)
        if name is None:
            raise TypeError(f"cuda attention: dtype {dtype} is not supported")
        shape = (1, self.num_kv_heads, ctx_len, self.head_dim)
        k = torch.empty(shape, dtype=dtype, device=kd.device)
        v = torch.empty(shape, dtype=dtype, device=kd.device)
        threads = self.num_kv_heads * ctx_len * self.head_dim // 8
        self._library(kd.device).launch(
            "cache.cu", specs.gather_q8_name(name, kind), (-(-threads // 256), 1, 1), (256, 1, 1),
            [k, v, kd, ks, vd, vs, page_stride, slot_stride, index(page_ids, kd.device), i32(ctx_len),
             i32(self.num_kv_heads), i32(self.head_dim), i32(block_shift(kd))])
        return k, v

    def prefill(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seg: PrefillSegment,
                window: int | None) -> torch.Tensor:
        if isinstance(k_cache, QUANTIZED):
            k, v = self.gather_q8(k_cache, v_cache, seg.page_ids, seg.ctx_len, q.dtype)
        else:
            k, v = self.gather(k_cache, v_cache, seg.page_ids, seg.ctx_len)
        return self.reference.prefill_attend(q, k, v, seg, window)

    def copy_pages(self, pages: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        """pages[dst[i]] = pages[src[i]] for whole pages of the pool; the pairs must be independent (no page
        both a source and a destination, no repeated destination: DevicePagePool checks)."""
        page_bytes = pages[0].numel() * pages.element_size()
        if page_bytes % 16 or pages.data_ptr() % 16 or not pages.is_contiguous():
            raise ValueError(f"copy_pages: pages of {page_bytes} bytes in a contiguous, 16-byte aligned pool needed")
        vectors = page_bytes // 16
        chunks = min(-(-vectors // (256 * 4)), 4096)
        src, dst = index(src, pages.device), index(dst, pages.device)
        lib = self._library(pages.device)
        for start in range(0, src.numel(), 65535):  # grid.y limit
            n = min(65535, src.numel() - start)
            lib.launch("cache.cu", specs.COPY_NAME, (chunks, n, 1), (256, 1, 1),
                       [pages, src[start:start + n], dst[start:start + n], i64(vectors)])
