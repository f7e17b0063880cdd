"""The CUDA kernels against the torch reference backend, on a GPU. Skipped without CUDA or CuPy.

Every check draws fresh random K/V/q (never zeros) into a real page-pool layout (layer 1 of a 2-layer pool:
the K/V views are not contiguous across pages) with scattered pages. The reference is TorchPagedAttention
in float32 on the same values upcast. Tolerances (stated once, here):

* fp16 / bf16 kernels: max |out - ref| / max |ref| <= 1e-2 and mean |out - ref| / mean |ref| <= 2e-3 (fp16)
  or 4e-3 (bf16: its 8-bit mantissa alone rounds the output by up to 2^-9 relative);
* fp32 kernels: 2e-5 and 2e-6 (exp2 on the special-function unit, other summation order);
* cache write and page copy: bit-exact.

Positions a kernel must not read (table padding past a request's context, pages wholly outside its sink +
window, pages before the model's window) hold out-of-range page ids in the kernels' tables: a read would
fault. The reference gets page 0 there (masked, so never used).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

from executor_svc.attention.cuda_backend import CudaPagedAttention
from executor_svc.attention.metadata import AttentionMetadata, DecodeGroup, PrefillSegment
from executor_svc.attention.torch_backend import TorchPagedAttention
from executor_svc.pages import DevicePagePool
from kernels_cuda import specs


def _skip_reason() -> str | None:
    if not torch.cuda.is_available():
        return "needs CUDA"
    from kernels_cuda.loader import cupy_import_error

    err = cupy_import_error()
    return f"needs CuPy ({err})" if err else None


SKIP = _skip_reason()
pytestmark = pytest.mark.skipif(SKIP is not None, reason=SKIP or "")

BAD_PAGE = 1 << 40  # a page id far outside any pool: reading it faults
TOL = {torch.float16: (1e-2, 2e-3), torch.bfloat16: (1e-2, 4e-3), torch.float32: (2e-5, 2e-6)}
DTYPES = [torch.float16, torch.bfloat16]
SPLIT = {"split": 512, "split64": 64, "nosplit": 1 << 30}  # partition_tokens


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    out, ref = out.float(), ref.float()
    assert torch.isfinite(out).all(), f"{what}: non-finite output"
    err = (out - ref).abs()
    max_rel = (err.max() / ref.abs().max()).item()
    mean_rel = (err.mean() / ref.abs().mean()).item()
    tol_max, tol_mean = TOL[dtype]
    assert max_rel <= tol_max and mean_rel <= tol_mean, (
        f"{what}: max rel err {max_rel:.2e} (tol {tol_max:.0e}), mean rel err {mean_rel:.2e} (tol {tol_mean:.0e})")


def make_pool(num_pages: int, block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
              g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    pages = torch.randn((num_pages, 2, 2, block_size, kv_heads, head_dim), generator=g, device="cuda").to(dtype)
    return pages, pages[:, 1, 0], pages[:, 1, 1]


@dataclass(slots=True)
class Request:
    ctx: int
    sink: int = 0
    window: int = 0


def visible(r: Request, pos: int, model_window: int) -> bool:
    ok = pos < r.ctx
    if model_window:
        ok &= pos > r.ctx - 1 - model_window
    if r.window:
        ok &= pos < r.sink or pos > r.ctx - 1 - r.window
    return ok


def decode_tables(reqs: list[Request], block_size: int, num_pages: int, model_window: int,
                  seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(reference table, kernel table) [B, width]: scattered distinct pages; where no position of a page is
    visible (and in the padding) the reference has page 0 and the kernel table BAD_PAGE."""
    width = max(-(-r.ctx // block_size) for r in reqs)
    perm = torch.randperm(num_pages - 1, generator=torch.Generator().manual_seed(seed)).add(1).tolist()
    ref, ker = [], []
    for r in reqs:
        rrow, krow = [], []
        for i in range(width):
            seen = any(visible(r, p, model_window) for p in range(i * block_size, (i + 1) * block_size))
            page = perm.pop() if seen else 0
            rrow.append(page)
            krow.append(page if seen else BAD_PAGE)
        ref.append(rrow)
        ker.append(krow)
    return torch.tensor(ref, device="cuda"), torch.tensor(ker, device="cuda")


def run_decode(reqs: list[Request], *, dtype: torch.dtype, head_dim: int, block_size: int, heads: int,
               kv_heads: int, partition_tokens: int, model_window: int = 0, seed: int = 0) -> None:
    g = torch.Generator(device="cuda").manual_seed(seed)
    need = sum(-(-r.ctx // block_size) for r in reqs)
    num_pages = need + 8
    _, k_cache, v_cache = make_pool(num_pages, block_size, kv_heads, head_dim, dtype, g)
    ref_table, ker_table = decode_tables(reqs, block_size, num_pages, model_window, seed)
    batch = len(reqs)
    rows = 2 * batch + 3  # the decode tokens sit at scattered rows of a larger flat batch
    token_idx = torch.randperm(rows, generator=g, device="cuda")[:batch]
    q = torch.randn((rows, heads, head_dim), generator=g, device="cuda").to(dtype)
    ctx = torch.tensor([r.ctx for r in reqs], device="cuda")
    windowed = any(r.window for r in reqs)
    sinks = torch.tensor([r.sink for r in reqs], device="cuda") if windowed else None
    windows = torch.tensor([r.window for r in reqs], device="cuda") if windowed else None
    scale = head_dim ** -0.5

    attn = CudaPagedAttention(heads, kv_heads, head_dim, scale, partition_tokens=partition_tokens)
    out = torch.full_like(q, float("nan"))
    attn.decode(q, out, k_cache, v_cache, DecodeGroup(token_idx, ker_table, ctx, sinks, windows), model_window)
    torch.cuda.synchronize()

    ref_group = DecodeGroup(torch.arange(batch, device="cuda"), ref_table, ctx, sinks, windows)
    ref_meta = AttentionMetadata(torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long), [ref_group], [],
                                 sliding_window=model_window or None)
    ref = TorchPagedAttention(heads, kv_heads, head_dim, scale).forward(
        q[token_idx].float(), k_cache.float(), v_cache.float(), ref_meta)
    untouched = torch.ones(rows, dtype=torch.bool, device="cuda")
    untouched[token_idx] = False
    assert torch.isnan(out[untouched]).all(), "rows outside the group's token_idx were written"
    assert_close(out[token_idx], ref, dtype, f"decode B={batch} ctx<= {max(r.ctx for r in reqs)}")


def _ragged() -> list[Request]:
    return [Request(c) for c in (1, 5, 16, 17, 100, 513, 1024, 2049)]


def _batch256() -> list[Request]:
    g = torch.Generator().manual_seed(256)
    return [Request(int(c)) for c in torch.randint(1, 1100, (256,), generator=g)]


SHAPES = {"one": lambda: [Request(1)], "ragged": _ragged, "batch256": _batch256}


@pytest.mark.parametrize("split", ["split", "nosplit"])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("block_size", specs.BLOCK_SIZES)
@pytest.mark.parametrize("head_dim", specs.HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_matches_reference(dtype, head_dim, block_size, shape, split):
    run_decode(SHAPES[shape](), dtype=dtype, head_dim=head_dim, block_size=block_size, heads=32, kv_heads=8,
               partition_tokens=SPLIT[split], seed=block_size * 7 + head_dim)


@pytest.mark.parametrize("split", ["split", "nosplit"])
@pytest.mark.parametrize("head_dim", specs.HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_32k_context(dtype, head_dim, split):
    run_decode([Request(32768)], dtype=dtype, head_dim=head_dim, block_size=16, heads=32, kv_heads=8,
               partition_tokens=SPLIT[split], seed=32)


@pytest.mark.parametrize("heads,kv_heads", [(8, 8), (16, 8), (12, 4), (64, 8), (40, 4)])
def test_decode_group_sizes(heads, kv_heads):
    """Query groups of 1, 2, 3 (a 4-tile with an idle head), 8, and 10 (two CTAs per KV head)."""
    run_decode(_ragged(), dtype=torch.float16, head_dim=128, block_size=16, heads=heads, kv_heads=kv_heads,
               partition_tokens=512, seed=heads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_decode_fp32_and_small_partitions(dtype):
    run_decode(_ragged(), dtype=dtype, head_dim=64, block_size=8, heads=8, kv_heads=2, partition_tokens=64, seed=3)


SINK_WINDOW = [Request(90, 4, 20), Request(75, 0, 33), Request(60), Request(3000, 16, 700), Request(1500, 5, 1),
               Request(40, 8, 100), Request(2100, 600, 1000)]


@pytest.mark.parametrize("split", list(SPLIT))
@pytest.mark.parametrize("model_window", [0, 1000])
@pytest.mark.parametrize("block_size", specs.BLOCK_SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_sink_and_window(dtype, block_size, model_window, split):
    """Per-request sinks/windows (incl. a request without one, a window of 1, a sink overlapping the window)
    and a model-wide window; pages wholly outside are never read (they are BAD_PAGE in the kernel table)."""
    run_decode(SINK_WINDOW, dtype=dtype, head_dim=128, block_size=block_size, heads=16, kv_heads=4,
               partition_tokens=SPLIT[split], model_window=model_window, seed=block_size + model_window)


@pytest.mark.parametrize("head_dim", specs.HEAD_DIMS)
@pytest.mark.parametrize("dtype", [*DTYPES, torch.float32], ids=str)
def test_write_cache_is_exact(dtype, head_dim):
    g = torch.Generator(device="cuda").manual_seed(head_dim)
    block_size, kv_heads, heads, tokens = 16, 4, 8, 300
    pages, k_cache, v_cache = make_pool(64, block_size, kv_heads, head_dim, dtype, g)
    expected = pages.clone()
    slots = torch.randperm(64 * block_size, generator=g, device="cuda")[:tokens]
    meta = AttentionMetadata(slots // block_size, slots % block_size, [], [])
    # K/V as the model makes them: slices of one fused qkv projection (token stride > heads * head_dim)
    qkv = torch.randn((tokens, (heads + 2 * kv_heads) * head_dim), generator=g, device="cuda").to(dtype)
    _, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    k, v = k.view(tokens, kv_heads, head_dim), v.view(tokens, kv_heads, head_dim)
    CudaPagedAttention(heads, kv_heads, head_dim, 1.0).write_cache(k_cache, v_cache, k, v, meta)
    TorchPagedAttention(heads, kv_heads, head_dim, 1.0).write_cache(expected[:, 1, 0], expected[:, 1, 1], k, v, meta)
    torch.cuda.synchronize()
    assert torch.equal(pages, expected)
    assert not torch.equal(pages, pages.clone().normal_()), "the pool is not all one value"


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_copy_pages_is_exact(dtype):
    cfg = SimpleNamespace(num_layers=3, num_kv_heads=4, head_dim=128)
    pools = [DevicePagePool(cfg, 40, 16, dtype, torch.device("cuda")) for _ in range(2)]
    pools[0].pages.normal_()
    pools[1].pages.copy_(pools[0].pages)
    pools[0].copier = CudaPagedAttention.copy_pages
    src, dst = [3, 4, 5, 20, 0], [30, 31, 32, 7, 39]  # independent pairs: the kernel
    for pool in pools:
        pool.copy_pages(src, dst)
    torch.cuda.synchronize()
    assert torch.equal(pools[0].pages, pools[1].pages)
    assert torch.equal(pools[0].pages[30], pools[0].pages[3])
    src, dst = [1, 2], [2, 9]  # page 2 read and written: the indexing path (reads first) in both pools
    for pool in pools:
        pool.copy_pages(src, dst)
    assert torch.equal(pools[0].pages, pools[1].pages)


def _prefill_segments(reqs: list[tuple[int, int, int, int]], block_size: int, num_pages: int, seed: int):
    """Prefill segments (ctx, new tokens, sink, window) over scattered pages; also the token count."""
    perm = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed)).tolist()
    segs, start = [], 0
    for ctx, n, sink, window in reqs:
        table = torch.tensor([perm.pop() for _ in range(-(-ctx // block_size))], device="cuda")
        segs.append(PrefillSegment(start, n, ctx, table, sink, window))
        start += n
    return segs, start


@pytest.mark.parametrize("model_window", [0, 50])
@pytest.mark.parametrize("block_size", specs.BLOCK_SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_prefill_and_mixed_forward(dtype, block_size, model_window):
    """forward() with prefill chunks (with and without cached context, sink + window) and a decode group."""
    g = torch.Generator(device="cuda").manual_seed(block_size)
    heads, kv_heads, head_dim, num_pages = 16, 4, 128, 200
    _, k_cache, v_cache = make_pool(num_pages, block_size, kv_heads, head_dim, dtype, g)
    segs, n_prefill = _prefill_segments([(77, 77, 0, 0), (300, 40, 0, 0), (250, 9, 4, 60)], block_size,
                                        num_pages, block_size)
    empty = torch.zeros(0, dtype=torch.long, device="cuda")
    reqs = [Request(33), Request(400), Request(129, 3, 50)]
    table, _ = decode_tables(reqs, block_size, num_pages, model_window, block_size)  # dropped pages: page 0
    ctx = torch.tensor([r.ctx for r in reqs], device="cuda")
    group = DecodeGroup(torch.arange(n_prefill, n_prefill + 3, device="cuda"), table, ctx,
                        torch.tensor([r.sink for r in reqs], device="cuda"),
                        torch.tensor([r.window for r in reqs], device="cuda"))
    q = torch.randn((n_prefill + 3, heads, head_dim), generator=g, device="cuda").to(dtype)
    meta = AttentionMetadata(empty, empty, [group], segs, sliding_window=model_window or None)
    out = CudaPagedAttention(heads, kv_heads, head_dim, head_dim ** -0.5).forward(q, k_cache, v_cache, meta)
    group.mask = None
    ref = TorchPagedAttention(heads, kv_heads, head_dim, head_dim ** -0.5).forward(
        q.float(), k_cache.float(), v_cache.float(), meta)
    assert_close(out[:n_prefill], ref[:n_prefill], dtype, "prefill rows")
    assert_close(out[n_prefill:], ref[n_prefill:], dtype, "decode rows")
