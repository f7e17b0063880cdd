"""Whole 8-bit pages dequantized by the CPU kernel library (``dequantize_pages_q8``, QuantizedCache.gather on the
CPU; ``dequantize_pages_int8_channels``, ChannelScaledCache.gather) equal torch's arithmetic bit for bit: fresh
random pools written through the pool's quantizers (FP8 E4M3, INT8 values, INT8 keys whose channel exponents grow
as tokens arrive), every E4M3 byte including NaN, head sizes with and without a vector path, shuffled and repeated
page ids, 32- and 16-bit outputs; a page id outside the pool is refused before any read."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from executor_svc.attention import cpu_kernel
from executor_svc.kv_quant import ChannelScaledCache, QuantizedCache, dequantize, parse_kv_dtype
from executor_svc.pages import DevicePagePool

pytestmark = [pytest.mark.unit, pytest.mark.skipif(
    cpu_kernel.unavailable_reason() is not None or not hasattr(cpu_kernel.load(), "dequantize_pages_int8_channels"),
    reason="no CPU kernel library with dequantize_pages_q8 here")]


def _torch(cache: QuantizedCache, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return dequantize(cache.data.index_select(0, ids), cache.scale.index_select(0, ids), dtype)


@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "int8"])
@pytest.mark.parametrize("dim", [64, 48, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_equals_torchs_dequantization_bit_for_bit(kv_dtype, dim, dtype):
    g = torch.Generator().manual_seed(dim)
    cfg = SimpleNamespace(num_layers=1, num_kv_heads=3, head_dim=dim)
    pool = DevicePagePool(cfg, 12, 16, torch.float32, torch.device("cpu"), parse_kv_dtype(kv_dtype, torch.float32))
    _, v_cache = pool.layer(0)  # (FP8's K and V and INT8's V are QuantizedCache; INT8 K has channel scales)
    assert isinstance(v_cache, QuantizedCache)
    pages = torch.arange(12).repeat_interleave(16)
    offsets = torch.arange(16).repeat(12)
    x = torch.randn(12 * 16, 3, dim, generator=g) * torch.exp(torch.randn(12 * 16, 3, 1, generator=g))
    v_cache.write(pages, offsets, x)
    ids = torch.tensor([7, 2, 11, 2, 0, 5])
    got = v_cache.gather(ids, dtype)
    want = _torch(v_cache, ids, dtype)
    assert got.dtype == dtype and got.shape == (6, 16, 3, dim)
    assert torch.equal(got, want)
    assert not torch.equal(got[0], got[1])  # (distinct pages: not all zeros)


@pytest.mark.parametrize("dim", [64, 48])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_keys_with_channel_exponents_equal_torchs_bit_for_bit(dim, dtype):
    g = torch.Generator().manual_seed(dim + 1)
    cfg = SimpleNamespace(num_layers=1, num_kv_heads=2, head_dim=dim)
    pool = DevicePagePool(cfg, 9, 16, torch.float32, torch.device("cpu"), parse_kv_dtype("int8", torch.float32))
    k_cache, _ = pool.layer(0)
    assert isinstance(k_cache, ChannelScaledCache)
    for t in range(8 * 16 - 5):  # one token at a time: the exponents grow and rows requantize; page 8 unwritten
        x = torch.randn(1, 2, dim, generator=g) * torch.exp(2 * torch.randn(1, 2, 1, generator=g))
        k_cache.write(torch.tensor([t // 16]), torch.tensor([t % 16]), x)
    ids = torch.tensor([3, 8, 0, 7, 3])
    got = k_cache.gather(ids, dtype)
    data = k_cache.data.index_select(0, ids).float()
    want = (data * torch.pow(2.0, k_cache.exp.index_select(0, ids).float() - 127).unsqueeze(1)).to(dtype)
    assert got.dtype == dtype and torch.equal(got, want) and got[0].abs().sum() > 0


def test_every_e4m3_byte_and_a_bad_page_id():
    data = torch.arange(256, dtype=torch.int16).to(torch.uint8).view(1, 1, 4, 64).repeat(2, 16, 1, 1)
    scale = torch.full((2, 16, 4), 0.75, dtype=torch.bfloat16)
    cache = QuantizedCache(data.view(torch.float8_e4m3fn), scale, parse_kv_dtype("fp8_e4m3", torch.float32))
    got = cache.gather(torch.tensor([1, 0]), torch.float32)
    want = _torch(cache, torch.tensor([1, 0]), torch.float32)
    assert torch.equal(got.isnan(), want.isnan()) and got.isnan().sum() == 2 * 2 * 16  # 0x7f and 0xff
    assert torch.equal(got.nan_to_num(), want.nan_to_num())
    with pytest.raises(RuntimeError, match="page id 2 outside the pool of 2 pages"):
        cpu_kernel.load().dequantize_pages_q8(data, scale, torch.tensor([0, 2]), True)
    exp = torch.full((2, 4, 64), 127, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="page id -1 outside the pool of 2 pages"):
        cpu_kernel.load().dequantize_pages_int8_channels(data, exp, torch.tensor([-1]))
