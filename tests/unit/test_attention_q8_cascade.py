"""Decodes over 8-bit pages that share a prompt prefix, attended as a cascade (executor_svc/attention/q8_decode.py):
the prefix's pages dequantized once and scored for every row by the products kernel, each row's own keys read in
place (``paged_attention_q8_after``, with its log-sum-exp), merged. Checked, with the same kernel without the
cascade and the gather path (every visible page dequantized, then SDPA), against the same attention over the
dequantized pages in float64, on fresh random pools written through the pool's quantizers (FP8 E4M3, INT8 with
per-channel K exponents), at two head sizes, 32-bit and 16-bit models; the second half's log-sum-exp too.
Tolerance: 1e-5 of the largest output (float32 sums over ~300 products of up to ~50 in other orders), plus
bfloat16's rounding for a 16-bit model."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from executor_svc.attention import cascade, cpu_kernel, q8_decode
from executor_svc.attention.metadata import DecodeGroup
from executor_svc.attention.torch_backend import TorchPagedAttention
from executor_svc.kv_quant import parse_kv_dtype
from executor_svc.pages import DevicePagePool

pytestmark = [pytest.mark.unit, pytest.mark.skipif(cpu_kernel.unavailable_reason() is not None,
                                                   reason="no CPU kernel library here")]
BLOCK = 16


def _shared_case(kv_dtype: str, heads: int, kv_heads: int, dim: int, prefix_pages: int, own: list[int], seed: int,
                 model_dtype: torch.dtype = torch.float32):
    """Rows whose tables begin with the same ``prefix_pages`` pages, then ``own[i]`` tokens of row i's own."""
    g = torch.Generator().manual_seed(seed)
    widths = [prefix_pages + -(-n // BLOCK) for n in own]
    num_pages = prefix_pages + sum(w - prefix_pages for w in widths) + 2
    cfg = SimpleNamespace(num_layers=1, num_kv_heads=kv_heads, head_dim=dim)
    pool = DevicePagePool(cfg, num_pages, BLOCK, model_dtype, torch.device("cpu"), parse_kv_dtype(kv_dtype,
                                                                                                  model_dtype))
    k_cache, v_cache = pool.layer(0)
    order = (torch.randperm(num_pages - 1, generator=g) + 1).tolist()
    shared = [order.pop() for _ in range(prefix_pages)]

    def write(pages: list[int], first: int, count: int) -> None:
        for t in range(first, first + count):  # one token at a time, as decodes write
            scale = torch.exp(torch.randn(1, kv_heads, 1, generator=g))
            k = torch.randn(1, kv_heads, dim, generator=g) * scale
            k[..., :2] *= 8  # a few large key channels
            v = torch.randn(1, kv_heads, dim, generator=g) * scale
            page, off = torch.tensor([pages[t // BLOCK]]), torch.tensor([t % BLOCK])
            k_cache.write(page, off, k.to(model_dtype))
            v_cache.write(page, off, v.to(model_dtype))
    write(shared, 0, prefix_pages * BLOCK)
    tables = torch.zeros(len(own), max(widths), dtype=torch.long)
    for i, (n, w) in enumerate(zip(own, widths)):
        pages = shared + [order.pop() for _ in range(w - prefix_pages)]
        tables[i, :w] = torch.tensor(pages)
        write(pages, prefix_pages * BLOCK, n)
    q = torch.randn(len(own), heads, dim, generator=g).to(model_dtype)
    ctx = torch.tensor([prefix_pages * BLOCK + n for n in own])
    return q, k_cache, v_cache, tables, ctx


def _reference(q, k_cache, v_cache, tables, ctx, kv_heads: int, scale: float, start: int = 0):
    """Every row over its keys [start, ctx) of the dequantized pages, in float64: outputs [B, heads, D] and
    log-sum-exps [B, heads] (a row with no key there: None)."""
    heads, dim = q.shape[1], q.shape[2]
    outs, lses = [], []
    for b, c in enumerate(ctx.tolist()):
        k = k_cache.gather(tables[b], torch.float64).reshape(-1, kv_heads, dim)[start:c]
        v = v_cache.gather(tables[b], torch.float64).reshape(-1, kv_heads, dim)[start:c]
        s = torch.einsum("hgd,nhd->hgn", q[b].double().view(kv_heads, heads // kv_heads, dim), k) * scale
        outs.append(torch.einsum("hgn,nhd->hgd", s.softmax(-1), v).reshape(heads, dim) if len(k) else None)
        lses.append(torch.logsumexp(s, -1).reshape(heads) if len(k) else None)
    return outs, lses


def _close(got: torch.Tensor, want: torch.Tensor, rtol: float = 0.0) -> None:
    """Within 1e-5 of the largest output (float32 sums over hundreds of products in other orders), plus ``rtol``."""
    torch.testing.assert_close(got.double(), want, rtol=rtol, atol=1e-5 * float(want.abs().max()))


@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "int8"])
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (8, 2, 128)])
@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16])
def test_a_shared_prefix_as_a_cascade_equals_the_same_attention_in_float64(kv_dtype, heads, kv_heads, dim,
                                                                           model_dtype):
    own = [1, 5, 16, 17, 30, 2, 40, 9, 23, 11, 3, 8, 33, 12, 19, 6] * 2  # 32 rows over 17 shared pages: it pays
    q, k_cache, v_cache, tables, ctx = _shared_case(kv_dtype, heads, kv_heads, dim, 17, own, seed=dim + heads,
                                                    model_dtype=model_dtype)
    group = DecodeGroup(torch.arange(len(own)), tables, ctx)
    assert cascade.shared_prefix(group, BLOCK, None).tolist() == tables[0, :17].tolist()  # the cascade applies
    kernel = q8_decode.kernel_for(q, k_cache)
    got = q8_decode.decode(kernel, q, k_cache, v_cache, group, None, dim ** -0.5)
    assert group.shared_pages is not None and group.shared_pages.numel() == 17
    assert got.dtype == model_dtype and torch.isfinite(got).all()
    want = torch.stack(_reference(q, k_cache, v_cache, tables, ctx, kv_heads, dim ** -0.5)[0])
    _close(got, want, rtol=0.0 if model_dtype == torch.float32 else 2 ** -8)  # (bfloat16: its rounding)
    plain = DecodeGroup(torch.arange(len(own)), tables, ctx)
    plain.shared_pages = torch.empty(0, dtype=torch.long)  # the same kernel, every row reading the prefix itself
    _close(q8_decode.decode(kernel, q, k_cache, v_cache, plain, None, dim ** -0.5), want,
           rtol=0.0 if model_dtype == torch.float32 else 2 ** -8)
    gathered = TorchPagedAttention(heads, kv_heads, dim, dim ** -0.5, reference=True)._decode(
        q.float(), k_cache, v_cache, DecodeGroup(torch.arange(len(own)), tables, ctx), None)
    _close(gathered, want)  # (and the gather path: the tolerance is float32's, not the kernels')


@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "int8"])
def test_the_second_half_gives_its_keys_softmax_and_log_sum_exp(kv_dtype):
    heads, kv_heads, dim, scale = 6, 2, 64, 0.125
    own = [3, 20, 33]
    q, k_cache, v_cache, tables, ctx = _shared_case(kv_dtype, heads, kv_heads, dim, 2, own, seed=7)
    kernel = q8_decode.kernel_for(q, k_cache)
    k_scale = k_cache.exp if kv_dtype == "int8" else k_cache.scale
    for start in (0, 20, 32, 40):
        out, lse = kernel.paged_attention_q8_after(q, k_cache.data.view(torch.uint8), k_scale,
                                                   v_cache.data.view(torch.uint8), v_cache.scale, tables, ctx,
                                                   start, kv_dtype == "fp8_e4m3", scale)
        outs, lses = _reference(q, k_cache, v_cache, tables, ctx, kv_heads, scale, start)
        for b in range(len(own)):
            if outs[b] is None:  # no key from start on: nothing, and a log-sum-exp of -inf
                assert (out[b] == 0).all() and torch.isinf(lse[b]).all() and (lse[b] < 0).all()
                continue
            _close(out[b], outs[b])
            torch.testing.assert_close(lse[b].double(), lses[b], rtol=1e-6, atol=1e-5)
    with pytest.raises(RuntimeError, match="start must be >= 0"):
        kernel.paged_attention_q8_after(q, k_cache.data.view(torch.uint8), k_scale, v_cache.data.view(torch.uint8),
                                        v_cache.scale, tables, ctx, -1, kv_dtype == "fp8_e4m3", scale)


def test_rows_with_windows_or_too_few_rows_keep_the_plain_kernel(monkeypatch):
    own = [4, 8, 12, 16, 20, 24, 28, 32] * 4
    q, k_cache, v_cache, tables, ctx = _shared_case("fp8_e4m3", 6, 2, 64, 17, own, seed=11)
    kernel = q8_decode.kernel_for(q, k_cache)
    assert cascade.shared_prefix(DecodeGroup(torch.arange(32), tables, ctx), BLOCK, None).numel() == 17
    sinks, windows = torch.full((32,), 4), torch.full((32,), 40)
    group = DecodeGroup(torch.arange(32), tables, ctx, sinks=sinks, windows=windows)
    calls = []
    monkeypatch.setattr(kernel, "paged_attention_q8_after", lambda *a: calls.append(a), raising=False)
    got = q8_decode.decode(kernel, q, k_cache, v_cache, group, None, 0.125)
    assert group.shared_pages is not None and not group.shared_pages.numel() and not calls
    want = torch.stack(_reference(q, k_cache, v_cache, tables, ctx, 2, 0.125)[0])  # (no window reaches back here)
    windowed = TorchPagedAttention(6, 2, 64, 0.125, reference=True)._decode(
        q, k_cache, v_cache, DecodeGroup(torch.arange(32), tables, ctx, sinks=sinks, windows=windows), None)
    torch.testing.assert_close(got, windowed, rtol=2e-5, atol=2e-5)
    assert not torch.allclose(got.double(), want, atol=1e-3)  # (the windows did change it)
    q, k_cache, v_cache, tables, ctx = _shared_case("int8", 6, 2, 64, 24, own[:12], seed=12)
    few = DecodeGroup(torch.arange(12), tables, ctx)  # 12 rows over INT8 keys: below CASCADE_MIN_ROWS_INT8
    assert 12 < q8_decode.CASCADE_MIN_ROWS_INT8
    q8_decode.decode(kernel, q, k_cache, v_cache, few, None, 0.125)
    assert few.shared_pages.numel() == 24 and not calls

