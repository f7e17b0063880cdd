"""Decodes read in place from 8-bit pages (executor_svc/attention/q8_decode.py, paged_attention_q8_cpu.cpp) against
the gather path (every visible page dequantized into float32, then SDPA: TorchPagedAttention with reference=True),
on fresh random pools written through the pool's own quantizers (FP8 E4M3; INT8 with per-channel K exponents that
grow as tokens arrive), at several head sizes and group sizes, context lengths that end mid-page, shuffled page
tables, a model-wide sliding window and per-request sinks and windows. Tolerance: 2e-5 (float32 sums in another
order)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from executor_svc.attention import cpu_kernel, q8_decode
from executor_svc.attention.metadata import AttentionMetadata, DecodeGroup
from executor_svc.attention.torch_backend import TorchPagedAttention
from executor_svc.kv_quant import parse_kv_dtype
from executor_svc.pages import DevicePagePool

pytestmark = [pytest.mark.unit, pytest.mark.skipif(cpu_kernel.unavailable_reason() is not None,
                                                   reason="no CPU kernel library here")]
BLOCK = 16


def _case(kv_dtype: str, heads: int, kv_heads: int, dim: int, ctx_lens: list[int], seed: int,
          model_dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(seed)
    widths = [-(-c // BLOCK) for c in ctx_lens]
    num_pages = sum(widths) + 2
    cfg = SimpleNamespace(num_layers=1, num_kv_heads=kv_heads, head_dim=dim)
    fmt = parse_kv_dtype(kv_dtype, model_dtype)
    pool = DevicePagePool(cfg, num_pages, BLOCK, model_dtype, torch.device("cpu"), fmt)
    k_cache, v_cache = pool.layer(0)
    order = (torch.randperm(num_pages - 1, generator=g) + 1).tolist()
    tables = torch.zeros(len(ctx_lens), max(widths), dtype=torch.long)
    for i, (c, w) in enumerate(zip(ctx_lens, widths)):
        pages = [order.pop() for _ in range(w)]
        tables[i, :w] = torch.tensor(pages)
        for t in range(c):  # one token at a time, as decodes write (INT8 K's exponents grow and requantize)
            scale = torch.exp(torch.randn(1, kv_heads, 1, generator=g))  # tokens of different sizes
            k = torch.randn(1, kv_heads, dim, generator=g) * scale
            k[..., :2] *= 8  # a few large key channels, as real models' keys have
            v = torch.randn(1, kv_heads, dim, generator=g) * scale
            page, off = torch.tensor([pages[t // BLOCK]]), torch.tensor([t % BLOCK])
            k_cache.write(page, off, k.to(model_dtype))
            v_cache.write(page, off, v.to(model_dtype))
    q = torch.randn(len(ctx_lens), heads, dim, generator=g).to(model_dtype)
    return q, k_cache, v_cache, tables, torch.tensor(ctx_lens)


@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "int8"])
@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 4, 32), (9, 3, 64), (8, 2, 128), (2, 1, 48)])
@pytest.mark.parametrize("window", [0, 20])
def test_in_place_decodes_equal_the_gather_path(kv_dtype, heads, kv_heads, dim, window):
    ctx_lens = [1, 16, 17, 40, 77]
    q, k_cache, v_cache, tables, ctx = _case(kv_dtype, heads, kv_heads, dim, ctx_lens, seed=dim + heads + window)
    fast = TorchPagedAttention(heads, kv_heads, dim, dim ** -0.5)
    ref = TorchPagedAttention(heads, kv_heads, dim, dim ** -0.5, reference=True)
    assert q8_decode.kernel_for(q, k_cache) is not None and q8_decode.kernel_for(q, k_cache, reference=True) is None
    meta = AttentionMetadata(tables[:, 0], torch.zeros(len(ctx_lens), dtype=torch.long),
                             [DecodeGroup(torch.arange(len(ctx_lens)), tables, ctx)], [], sliding_window=window or None)
    got = fast.forward(q, k_cache, v_cache, meta)
    meta.decodes[0].mask = None
    want = ref.forward(q, k_cache, v_cache, meta)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "int8"])
def test_sinks_and_windows_per_request(kv_dtype):
    ctx_lens = [50, 50, 33, 9]
    q, k_cache, v_cache, tables, ctx = _case(kv_dtype, 6, 2, 64, ctx_lens, seed=3)
    sinks, windows = torch.tensor([4, 0, 16, 2]), torch.tensor([8, 0, 10, 20])  # a window of 0: none
    group = DecodeGroup(torch.arange(4), tables, ctx, sinks=sinks, windows=windows)
    kernel = q8_decode.kernel_for(q, k_cache)
    got = q8_decode.decode(kernel, q, k_cache, v_cache, group, None, 0.125)
    ref = TorchPagedAttention(6, 2, 64, 0.125, reference=True)
    want = ref._decode(q, k_cache, v_cache, DecodeGroup(torch.arange(4), tables, ctx, sinks=sinks, windows=windows),
                       None)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)


def test_bad_inputs_are_refused_with_the_field():
    q, k_cache, v_cache, tables, ctx = _case("fp8_e4m3", 4, 2, 32, [20], seed=1)
    kernel = q8_decode.kernel_for(q, k_cache)
    group = DecodeGroup(torch.arange(1), tables, torch.tensor([10_000]))
    with pytest.raises(RuntimeError, match="context length outside its table"):
        q8_decode.decode(kernel, q, k_cache, v_cache, group, None, 1.0)
    with pytest.raises(RuntimeError, match="heads must be a multiple of kv_heads"):
        q8_decode.decode(kernel, q[:, :3].contiguous(), k_cache, v_cache, DecodeGroup(torch.arange(1), tables, ctx),
                         None, 1.0)


@pytest.mark.parametrize("march", ["haswell", "x86-64"])  # AVX2 without AVX-512; no AVX2 (the op is left out)
def test_the_source_compiles_for_other_x86_levels(march):
    import shutil
    import subprocess
    import sysconfig
    from pathlib import Path

    from torch.utils.cpp_extension import include_paths

    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    src = Path(q8_decode.__file__).with_name("paged_attention_q8_cpu.cpp")
    cmd = [cxx, "-std=c++17", "-fsyntax-only", f"-march={march}", "-fopenmp", "-w",
           *(f"-I{p}" for p in include_paths()), f"-I{sysconfig.get_paths()['include']}", f"-I{src.parent}", str(src)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


def test_groups_of_more_than_16_query_heads_fall_back_to_the_gather_path():
    """An MQA-shaped model (32 query heads on one KV head) is beyond the kernel's register blocks: its decodes gather
    (and equal the gather path), never an error mid-step."""
    q, k_cache, v_cache, tables, ctx = _case("fp8_e4m3", 32, 1, 64, [20, 33], seed=5)
    assert q8_decode.kernel_for(q, k_cache, heads=32) is None and q8_decode.kernel_for(q, k_cache, heads=16)
    fast = TorchPagedAttention(32, 1, 64, 0.125)
    ref = TorchPagedAttention(32, 1, 64, 0.125, reference=True)
    group = DecodeGroup(torch.arange(2), tables, ctx)
    meta = AttentionMetadata(tables[:, 0], torch.zeros(2, dtype=torch.long), [group], [])
    got = fast.forward(q, k_cache, v_cache, meta)
    meta.decodes[0].mask = None
    torch.testing.assert_close(got, ref.forward(q, k_cache, v_cache, meta), rtol=2e-5, atol=2e-5)


def test_a_page_id_outside_the_pool_is_refused_before_any_read():
    q, k_cache, v_cache, tables, ctx = _case("int8", 4, 2, 32, [20], seed=2)
    kernel = q8_decode.kernel_for(q, k_cache)
    bad = tables.clone()
    bad[0, 1] = k_cache.data.shape[0]  # one past the last page
    with pytest.raises(RuntimeError, match="outside the pool"):
        q8_decode.decode(kernel, q, k_cache, v_cache, DecodeGroup(torch.arange(1), bad, ctx), None, 1.0)


@pytest.mark.parametrize("dim", [64, 48])  # the vector path and the scalar one
def test_every_fp8_byte_reads_as_torchs_e4m3(dim):
    """256 one-token requests, request i's value row all byte i (scale 1): the output is that byte's E4M3 value
    exactly, as torch reads float8_e4m3fn (subnormals, both zeros, NaN for 0x7f and 0xff)."""
    cfg = SimpleNamespace(num_layers=1, num_kv_heads=1, head_dim=dim)
    fmt = parse_kv_dtype("fp8_e4m3", torch.float32)
    pool = DevicePagePool(cfg, 257, BLOCK, torch.float32, torch.device("cpu"), fmt)
    k_cache, v_cache = pool.layer(0)
    for c in (k_cache, v_cache):
        c.data.view(torch.uint8).zero_()
        c.scale.fill_(1.0)
    v_cache.data.view(torch.uint8)[1:, 0] = torch.arange(256, dtype=torch.uint8)[:, None, None]
    tables = torch.arange(1, 257).unsqueeze(1)
    q = torch.randn(256, 2, dim, generator=torch.Generator().manual_seed(1))
    got = q8_decode.decode(q8_decode.kernel_for(q, k_cache), q, k_cache, v_cache,
                           DecodeGroup(torch.arange(256), tables, torch.ones(256, dtype=torch.long)), None, 0.125)
    want = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()[:, None, None].expand(256, 2, dim)
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "int8"])
@pytest.mark.parametrize("model_dtype", [torch.bfloat16, torch.float16])
def test_a_16_bit_model_reads_in_place_too(kv_dtype, model_dtype):
    """A bfloat16 / float16 model's decodes take the in-place kernel (queries widened to float32, the output rounded
    back) instead of gathering, and equal the gather path run in float32 over the same pages, to the model dtype's
    rounding (the gather path in bfloat16 itself rounds scores of ~100 by ~0.4)."""
    ctx_lens = [3, 16, 40, 77]
    q, k_cache, v_cache, tables, ctx = _case(kv_dtype, 9, 3, 64, ctx_lens, seed=7, model_dtype=model_dtype)
    assert q8_decode.kernel_for(q, k_cache) is not None
    fast = TorchPagedAttention(9, 3, 64, 0.125)
    ref = TorchPagedAttention(9, 3, 64, 0.125, reference=True)
    meta = AttentionMetadata(tables[:, 0], torch.zeros(len(ctx_lens), dtype=torch.long),
                             [DecodeGroup(torch.arange(len(ctx_lens)), tables, ctx)], [])
    got = fast.forward(q, k_cache, v_cache, meta)
    meta.decodes[0].mask = None
    want = ref.forward(q.float(), k_cache, v_cache, meta)
    assert got.dtype == model_dtype and torch.isfinite(got.float()).all()
    eps = torch.finfo(model_dtype).eps  # (float32 math to 2e-5, then one rounding to the model dtype: one ulp)
    torch.testing.assert_close(got.float(), want, rtol=eps, atol=1e-4)
