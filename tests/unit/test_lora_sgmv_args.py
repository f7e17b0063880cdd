"""executor_svc/lora/cuda_sgmv.py without a kernel launch: its tile constants are lora_sgmv.cu's, the split of k
covers k with non-empty splits, the layouts the kernels cannot address are refused before a launch, and on a CPU
the torch path is kept. (The kernels themselves: tests/unit/test_lora_sgmv_emulated.py, tests/gpu/test_lora_sgmv.py.)"""

from __future__ import annotations

import re

import pytest
import torch

from executor_svc.lora import cuda_sgmv
from executor_svc.lora.stack import LinearLora
from kernels_cuda import specs

pytestmark = pytest.mark.unit


def test_tile_constants_are_the_kernels():
    text = (specs.KERNEL_DIR / cuda_sgmv.SOURCE).read_text()
    found = dict(re.findall(r"constexpr int (k\w+) = (\d+);", text))
    assert found["kLoraThreads"] == str(cuda_sgmv.THREADS) == str(cuda_sgmv.EXPAND_COLS)
    assert "constexpr int kExpandCols = kLoraThreads;" in text
    assert found["kTileRows"] == str(cuda_sgmv.TILE_ROWS)
    assert found["kShrinkCols"] == str(cuda_sgmv.SHRINK_COLS)
    assert found["kShrinkChunk"] == str(cuda_sgmv.SHRINK_CHUNK)
    assert cuda_sgmv.SOURCE in specs.SOURCES and len(specs.name_expressions(cuda_sgmv.SOURCE)) == 2 * len(specs.DTYPES)


@pytest.mark.parametrize("rows", [1, 7, 33, 300, 5000])
@pytest.mark.parametrize("in_features", [64, 200, 576, 4096, 14336])
def test_split_k_covers_k_with_non_empty_splits(rows, in_features):
    splits, per = cuda_sgmv.split_k(rows, in_features, 192)
    assert per % cuda_sgmv.SHRINK_CHUNK == 0 and 1 <= splits <= cuda_sgmv.MAX_SPLITS
    assert (splits - 1) * per < in_features <= splits * per  # the last split starts inside k
    if rows >= 5000:
        assert splits == 1  # enough row tiles already


def _lin(n=2, in_features=16, widths=(8, 4), rank=4, dtype=torch.float32) -> LinearLora:
    shrink = torch.randn(n, in_features, len(widths) * rank, dtype=dtype)
    at, slices = 0, []
    for w in widths:
        slices.append((at, w))
        at += w
    return LinearLora(shrink, tuple(torch.randn(n, rank, w, dtype=dtype) for w in widths), tuple(slices))


def test_cpu_tensors_keep_the_torch_path():
    lin = _lin()
    assert "not a CUDA device" in cuda_sgmv.unusable_reason(torch.randn(3, 16), lin)
    assert not cuda_sgmv.usable(torch.randn(3, 16), lin)


@pytest.mark.parametrize("what, match", [
    ("rank", "shrink"), ("row_adapter_int32", "row_adapter"), ("scales_f16", "scales"), ("y_dtype", "dtype"),
    ("expand_transposed", "row-major"), ("y_columns", "expand"),
])
def test_layouts_the_kernels_cannot_address_are_refused(what, match):
    lin, x, y = _lin(), torch.randn(3, 16), torch.randn(3, 12)
    row_adapter, scales, rank = torch.tensor([0, -1, 1]), torch.ones(2), 4
    if what == "rank":
        rank = 8
    elif what == "row_adapter_int32":
        row_adapter = row_adapter.int()
    elif what == "scales_f16":
        scales = scales.half()
    elif what == "y_dtype":
        y = y.double()
    elif what == "expand_transposed":
        lin = LinearLora(lin.shrink, (lin.expand[0].transpose(1, 2).contiguous().transpose(1, 2), lin.expand[1]),
                         lin.slices)
    elif what == "y_columns":
        y = torch.randn(3, 10)
    with pytest.raises((ValueError, TypeError), match=match):
        cuda_sgmv.lora_delta_cuda(lin, x, y, row_adapter, scales, rank, library=object())
