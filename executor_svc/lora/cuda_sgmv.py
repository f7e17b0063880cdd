"""A fused linear's LoRA deltas on a GPU: kernels_cuda/lora_sgmv.cu (punica / S-LoRA SGMV style), the same delta
as ``LoraBatch.delta`` (batch.py) without its gather, padding and index_add_.

Each flat row names its adapter's stack row (``row_adapter``: slot - 1, -1 for the base model), and the kernels read
that adapter's weights from the stacked tensors in place (stack.py's strided views; nothing is copied):

    part  = x @ A_stack[row_adapter]                   lora_shrink: [splits, T, M * R] fp32, split-K over ``in``
    y[:, slice_m] += (sum(part)[:, m] @ B_m[row_adapter]) * scale[row_adapter]     lora_expand, one launch per m

in fp32, y rounded once (the torch path rounds the shrink, the expand and the scaled delta to the model dtype too).
Rows of the base model are neither read nor written. Launches go on torch's current stream (kernels_cuda/loader.py).
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from executor_svc.lora.stack import LinearLora
from kernels_cuda import specs

SOURCE = "lora_sgmv.cu"
THREADS = 256  # kLoraThreads in lora_sgmv.cu
TILE_ROWS = 8  # kTileRows
SHRINK_COLS = 32  # kShrinkCols
SHRINK_CHUNK = 128  # kShrinkChunk: a split of k is a multiple of it
EXPAND_COLS = 256  # kExpandCols
TARGET_CTAS = 256  # shrink CTAs worth splitting k for (about two waves on an H100's 132 multiprocessors)
MAX_SPLITS = 16
DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}


@functools.cache
def _cupy_error() -> str | None:
    from kernels_cuda.loader import cupy_import_error

    return cupy_import_error()


def unusable_reason(x: torch.Tensor, lin: LinearLora) -> str | None:
    """None when ``lora_delta_cuda`` can take this linear's input here; otherwise why not (then the torch path)."""
    if x.device.type != "cuda":
        return f"the input is on {x.device}, not a CUDA device"
    if x.dtype not in DTYPE_NAMES:
        return f"dtype {x.dtype} is not supported (supported: {', '.join(DTYPE_NAMES.values())})"
    if lin.shrink.dtype != x.dtype:
        return f"the adapters' weights are {lin.shrink.dtype}, the input {x.dtype}"
    if not _inner_contiguous(lin.shrink) or not all(_inner_contiguous(b) for b in lin.expand):
        return "the stacked weights are not contiguous inside each adapter's row"
    err = _cupy_error()
    return None if err is None else f"CuPy is not importable ({err})"


def usable(x: torch.Tensor, lin: LinearLora) -> bool:
    return unusable_reason(x, lin) is None


def split_k(rows: int, in_features: int, cols: int) -> tuple[int, int]:
    """(splits, elements of k per split) for the shrink: k is split while the row and column tiles alone make fewer
    than TARGET_CTAS CTAs (a decode step), each split a whole number of chunks and none empty."""
    tiles = -(-rows // TILE_ROWS) * -(-cols // SHRINK_COLS)
    chunks = -(-in_features // SHRINK_CHUNK)
    wanted = max(1, min(chunks, MAX_SPLITS, -(-TARGET_CTAS // tiles)))
    per = -(-chunks // wanted) * SHRINK_CHUNK
    return -(-in_features // per), per


def lora_delta_cuda(lin: LinearLora, x: torch.Tensor, y: torch.Tensor, row_adapter: torch.Tensor,
                    scales: torch.Tensor, rank: int, library: object | None = None) -> torch.Tensor:
    """``y`` (the fused linear's output [T, out] for ``x`` [T, in]) with each row's LoRA delta added in place: row t
    uses stack row ``row_adapter[t]`` (int64 [T] on x's device; -1: the base model, untouched), scaled by
    ``scales[row_adapter[t]]`` (fp32 [N]); ``rank``: the stack's R. ``library``: where the kernels come from
    (default: kernels_cuda.loader's for x's device; the tests' CPU emulator runs them on CPU tensors)."""
    rows, in_features = x.shape
    cols = lin.shrink.shape[2]
    _check(lin, x, y, row_adapter, scales, rank)
    if rows == 0:
        return y
    if library is None:
        from kernels_cuda.loader import library as device_library

        library = device_library(x.device)
    dtype = DTYPE_NAMES[x.dtype]
    i32, i64 = np.int32, np.int64
    splits, per = split_k(rows, in_features, cols)
    part = torch.empty(splits, rows, cols, dtype=torch.float32, device=x.device)
    row_tiles = -(-rows // TILE_ROWS)
    library.launch(SOURCE, specs.lora_shrink_name(dtype), (row_tiles, -(-cols // SHRINK_COLS), splits),
                   (THREADS, 1, 1),
                   [part, x, i64(x.stride(0)), lin.shrink, i64(lin.shrink.stride(0)), row_adapter,
                    i32(rows), i32(in_features), i32(cols), i32(per)])
    for m, ((offset, width), b) in enumerate(zip(lin.slices, lin.expand)):
        out = y.narrow(1, offset, width)
        library.launch(SOURCE, specs.lora_expand_name(dtype), (row_tiles, -(-width // EXPAND_COLS), 1),
                       (THREADS, 1, 1),
                       [out, i64(y.stride(0)), part, i32(splits), i32(cols), i32(m * rank), b, i64(b.stride(0)),
                        row_adapter, scales, i32(rows), i32(rank), i32(width)])
    return y


def _inner_contiguous(t: torch.Tensor) -> bool:
    """[N, rows, cols] with each adapter's [rows, cols] block row-major (the stack's rows may lie anywhere)."""
    return t.dim() == 3 and t.stride(2) == 1 and (t.shape[1] == 1 or t.stride(1) == t.shape[2])


def _check(lin: LinearLora, x: torch.Tensor, y: torch.Tensor, row_adapter: torch.Tensor, scales: torch.Tensor,
           rank: int) -> None:
    """What the kernels assume and cannot check themselves (a mismatch would read or write out of bounds)."""
    m = len(lin.slices)
    if x.dim() != 2 or y.dim() != 2 or x.shape[0] != y.shape[0] or x.stride(1) != 1 or y.stride(1) != 1:
        raise ValueError(f"lora_delta_cuda: x {list(x.shape)} and y {list(y.shape)} must be [T, in] and [T, out] "
                         "with unit stride along their last dimension")
    if y.dtype != x.dtype or lin.shrink.dtype != x.dtype or any(b.dtype != x.dtype for b in lin.expand):
        raise TypeError(f"lora_delta_cuda: x {x.dtype}, y {y.dtype} and the stacked weights "
                        f"{lin.shrink.dtype} must share one dtype")
    if lin.shrink.shape[1] != x.shape[1] or lin.shrink.shape[2] != m * rank or len(lin.expand) != m:
        raise ValueError(f"lora_delta_cuda: shrink {list(lin.shrink.shape)} is not [N, {x.shape[1]}, {m} * {rank}]")
    for (offset, width), b in zip(lin.slices, lin.expand):
        if b.shape[1:] != (rank, width) or offset + width > y.shape[1] or b.shape[0] != lin.shrink.shape[0]:
            raise ValueError(f"lora_delta_cuda: expand {list(b.shape)} at columns {offset}:{offset + width} does "
                             f"not fit rank {rank} and y {list(y.shape)}")
    if not (_inner_contiguous(lin.shrink) and all(_inner_contiguous(b) for b in lin.expand)):
        raise ValueError("lora_delta_cuda: each adapter's block of the stacked weights must be row-major")
    if row_adapter.dtype != torch.int64 or row_adapter.shape != (x.shape[0],) or not row_adapter.is_contiguous():
        raise ValueError(f"lora_delta_cuda: row_adapter must be int64 [{x.shape[0]}], contiguous "
                         f"(got {row_adapter.dtype} {list(row_adapter.shape)})")
    if scales.dtype != torch.float32 or scales.shape != (lin.shrink.shape[0],) or not scales.is_contiguous():
        raise ValueError(f"lora_delta_cuda: scales must be fp32 [{lin.shrink.shape[0]}] (got {scales.dtype} "
                         f"{list(scales.shape)})")
    devices = {t.device for t in (x, y, row_adapter, scales, lin.shrink, *lin.expand)}
    if len(devices) != 1:
        raise ValueError(f"lora_delta_cuda: tensors on several devices {sorted(map(str, devices))}")
