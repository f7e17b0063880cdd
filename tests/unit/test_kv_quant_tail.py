"""bench/kv_quant_tail.py's simulation: a TailExactCache reads a request's last ``tail`` pages (and the first, when
asked) from its exact copy and every other page as the FP8 pool holds it, so its figures measure that scheme."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch

from executor_svc.kv_quant import parse_kv_dtype
from executor_svc.pages import DevicePagePool
from tests.conftest import ROOT

pytestmark = pytest.mark.unit

sys.path.insert(0, str(ROOT / "bench"))
from kv_quant_tail import BLOCK, TailExactCache  # noqa: E402


def written(tail: int, first: bool, tokens: int):
    """An FP8 layer view, wrapped, with ``tokens`` random tokens written a page at a time (as the bench's
    page-aligned chunks); the exact values and what gather returns."""
    cfg = SimpleNamespace(num_layers=1, num_kv_heads=2, head_dim=32)
    pool = DevicePagePool(cfg, 8, BLOCK, torch.float32, torch.device("cpu"), parse_kv_dtype("fp8_e4m3", torch.float32))
    cache = TailExactCache(pool.layer(0)[0], tail, first)
    x = torch.randn(tokens, 2, 32, generator=torch.Generator().manual_seed(tail))
    for start in range(0, tokens, BLOCK):
        pos = torch.arange(start, min(start + BLOCK, tokens))
        cache.write(pos // BLOCK, pos % BLOCK, x[pos])
    pages = -(-tokens // BLOCK)
    got = cache.gather(torch.arange(pages), torch.float32).reshape(pages * BLOCK, 2, 32)[:tokens]
    return x, got, cache.plain.gather(torch.arange(pages), torch.float32).reshape(pages * BLOCK, 2, 32)[:tokens]


@pytest.mark.parametrize("tail,first", [(0, False), (1, False), (2, False), (2, True)])
def test_the_named_pages_are_exact_and_the_rest_fp8(tail, first):
    x, got, fp8 = written(tail, first, 5 * BLOCK + 3)  # 6 pages, the last one open
    exact_pages = set(range(6 - tail, 6)) | ({0} if first else set())
    for page in range(6):
        rows = slice(page * BLOCK, min((page + 1) * BLOCK, x.shape[0]))
        if page in exact_pages:
            assert torch.equal(got[rows], x[rows]), page
        else:
            assert torch.equal(got[rows], fp8[rows]), page
            assert not torch.equal(got[rows], x[rows]), page  # (FP8 rounds random values)
