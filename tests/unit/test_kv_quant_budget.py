"""8-bit KV pages fit about twice as many pages in the same KV budget. (Split from tests/e2e/test_kv_quant_e2e.py,
which runs 8-bit pages through real processes.)"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from executor_svc.kv_quant import parse_kv_dtype
from executor_svc.model_config import ModelConfig
from executor_svc.startup import _num_pages

pytestmark = pytest.mark.unit


def test_same_kv_budget_holds_about_twice_the_pages_in_8_bit(tiny_llama_dir):
    cfg = ModelConfig.from_dir(tiny_llama_dir)
    args = SimpleNamespace(block_size=16, num_pages=None, kv_cache_gb=0.25)
    pages = {name: _num_pages(args, cfg, torch.float16, torch.device("cpu"), parse_kv_dtype(name, torch.float16))
             for name in ("auto", "float32", "fp8_e4m3", "int8")}
    assert pages["float32"] * 2 == pages["auto"]  # a float32 KV cache under a float16 model: half the pages
    assert pages["fp8_e4m3"] == pages["int8"] >= 1.88 * pages["auto"]  # head_dim 32: 2048 / 1088 bytes a token
