"""The CUDA kernels against the torch reference, on a GPU. Skipped without CUDA or CuPy.

The checks and their tolerances are in tests/support/cuda_attention_cases.py (shared with the CPU-emulated run in
tests/e2e/test_kernels_emulated.py); here they run on the real kernels at full size: batch 1 / 8 (ragged) / 256,
contexts up to 32K, block sizes 8/16/32, head dims 64/128, fp16 and bf16 (fp32 too), query groups of 1-10,
split-K on, off and with small partitions, sinks/windows with unreadable pages (ids far outside the pool).
"""

from __future__ import annotations

import pytest
import torch

from kernels_cuda import specs
from tests.support import cuda_attention_cases as cases
from tests.support.cuda_attention_cases import SINK_WINDOW, SPLIT, Env, Request


def _skip_reason() -> str | None:
    if not torch.cuda.is_available():
        return "needs CUDA"
    from kernels_cuda.loader import cupy_import_error

    err = cupy_import_error()
    return f"needs CuPy ({err})" if err else None


SKIP = _skip_reason()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(SKIP is not None, reason=SKIP or "")]

GPU = Env("cuda")
DTYPES = [torch.float16, torch.bfloat16]
SHAPES = {"one": lambda: [Request(1)], "ragged": cases.ragged, "batch256": cases.batch256}


@pytest.mark.parametrize("split", ["split", "nosplit"])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("block_size", specs.BLOCK_SIZES)
@pytest.mark.parametrize("head_dim", specs.HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_matches_reference(dtype, head_dim, block_size, shape, split):
    cases.run_decode(GPU, SHAPES[shape](), dtype=dtype, head_dim=head_dim, block_size=block_size, heads=32,
                     kv_heads=8, partition_tokens=SPLIT[split], seed=block_size * 7 + head_dim)


@pytest.mark.parametrize("split", ["split", "nosplit"])
@pytest.mark.parametrize("head_dim", specs.HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_32k_context(dtype, head_dim, split):
    cases.run_decode(GPU, [Request(32768)], dtype=dtype, head_dim=head_dim, block_size=16, heads=32, kv_heads=8,
                     partition_tokens=SPLIT[split], seed=32)


@pytest.mark.parametrize("heads,kv_heads", [(8, 8), (16, 8), (12, 4), (64, 8), (40, 4)])
def test_decode_group_sizes(heads, kv_heads):
    """Query groups of 1, 2, 3 (a 4-tile with an idle head), 8, and 10 (two CTAs per KV head)."""
    cases.run_decode(GPU, cases.ragged(), dtype=torch.float16, head_dim=128, block_size=16, heads=heads,
                     kv_heads=kv_heads, partition_tokens=512, seed=heads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_decode_fp32_and_small_partitions(dtype):
    cases.run_decode(GPU, cases.ragged(), dtype=dtype, head_dim=64, block_size=8, heads=8, kv_heads=2,
                     partition_tokens=64, seed=3)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_peaked_softmax(dtype):
    """q x 25: scores of tens, so the running max jumps between partitions and most exponents underflow
    (flush-to-zero); the split merge must still agree with the reference."""
    cases.run_decode(GPU, cases.ragged(), dtype=dtype, head_dim=128, block_size=16, heads=32, kv_heads=8,
                     partition_tokens=64, seed=5, q_scale=25.0)


@pytest.mark.parametrize("split", list(SPLIT))
@pytest.mark.parametrize("model_window", [0, 1000])
@pytest.mark.parametrize("block_size", specs.BLOCK_SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_sink_and_window(dtype, block_size, model_window, split):
    cases.run_decode(GPU, SINK_WINDOW, dtype=dtype, head_dim=128, block_size=block_size, heads=16, kv_heads=4,
                     partition_tokens=SPLIT[split], model_window=model_window, seed=block_size + model_window)


@pytest.mark.parametrize("head_dim", specs.HEAD_DIMS)
@pytest.mark.parametrize("dtype", [*DTYPES, torch.float32], ids=str)
def test_write_cache_is_exact(dtype, head_dim):
    cases.write_cache_is_exact(GPU, dtype, head_dim)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_copy_pages_is_exact(dtype):
    cases.copy_pages_is_exact(GPU, dtype)


@pytest.mark.parametrize("model_window", [0, 50])
@pytest.mark.parametrize("block_size", specs.BLOCK_SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_prefill_and_mixed_forward(dtype, block_size, model_window):
    cases.prefill_and_mixed_forward(GPU, dtype, block_size, model_window)


def test_debug_mode_checks_each_launch(monkeypatch):
    """PAGEDKV_CUDA_DEBUG=1: a library that synchronises and checks after every launch still gives exact
    results (a deliberate fault is not tried: it would leave the CUDA context unusable for later tests)."""
    monkeypatch.setenv("PAGEDKV_CUDA_DEBUG", "1")
    from kernels_cuda import loader

    lib = loader.KernelLibrary(torch.device("cuda"))
    assert lib.debug
    cases.write_cache_is_exact(Env("cuda", lib), torch.float16, 64, tokens=8)


@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "int8"])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("head_dim", specs.HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_8_bit_pages(dtype, head_dim, shape, kv_dtype):
    """paged_decode_q8 (8-bit K/V dequantized in registers) against the torch reference on the same pages."""
    cases.run_decode_q8(GPU, SHAPES[shape](), kv_dtype=kv_dtype, dtype=dtype, head_dim=head_dim, block_size=16,
                        heads=32, kv_heads=8, partition_tokens=SPLIT["split"], seed=head_dim)


@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "int8"])
def test_decode_8_bit_pages_sink_and_window(kv_dtype):
    cases.run_decode_q8(GPU, SINK_WINDOW, kv_dtype=kv_dtype, dtype=torch.bfloat16, head_dim=128, block_size=8,
                        heads=40, kv_heads=4, partition_tokens=SPLIT["split64"], model_window=1000, seed=9)


@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "int8"])
@pytest.mark.parametrize("head_dim", specs.HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_quantizing_write_matches_the_torch_bytes(dtype, head_dim, kv_dtype):
    """write_kv_q8_token / write_k_i8_channel (PTX cvt.rn.satfinite.e4m3x2 here) give the torch reference's bytes."""
    cases.write_q8_matches_reference(GPU, kv_dtype, dtype, head_dim)


@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "int8"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_prefill_gather_of_8_bit_pages_is_exact(dtype, kv_dtype):
    cases.gather_q8_matches_reference(GPU, kv_dtype, dtype, 128)
