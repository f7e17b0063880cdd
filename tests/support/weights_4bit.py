"""4-bit checkpoints for the weight tests (tests/unit/test_weights_4bit.py, test_weights_4bit_kernels.py): a
checkpoint quantized by pagedkv.tools.quantize beside its dequantized float reference, a model loaded on the CPU, and
the mark for tests of our own 4-bit product."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from executor_svc.model.quant import own_kernel
from executor_svc.model_config import ModelConfig
from pagedkv.tools.quantize import quantize_checkpoint


def quantized(src: Path, tmp: Path, **kw) -> tuple[Path, Path]:
    return quantize_checkpoint(src, tmp / "q", reference_dir=tmp / "ref", **kw), tmp / "ref"


def load(path: Path, dtype: torch.dtype = torch.float32):
    from executor_svc.model import load_model

    return load_model(ModelConfig.from_dir(path), torch.device("cpu"), dtype)


needs_own = pytest.mark.skipif(own_kernel(torch.device("cpu"), torch.float32) is None,
                               reason="no AVX-512 build of our product here")
