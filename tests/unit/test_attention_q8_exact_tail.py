"""The exact tail in the CPU kernels over 8-bit pages (paged_attention_q8_cpu.cpp): pages with a slot in a bfloat16
slab (``k_exact``, ``v_exact``, ``exact_slots``) are read from the slab, unscaled, instead of their FP8 / INT8
bytes, by ``paged_attention_q8``, ``paged_attention_q8_after`` and the dequantizers. Checked against attention in
float64 over the pool dequantized in torch (kv_quant.dequantize; INT8 keys by their channel exponents) with the slab
pages' rows replaced by the slab's: fresh random pools written through the pool's own quantizers, random bfloat16
slabs as strided views of a larger buffer, a random subset of pages with shuffled slots (some slots unused), head
sizes with and without a vector path, GQA groups of 1 and 3, partial last pages, per-row sinks and windows, a
model-wide window, a cascade's ``start`` (its log-sum-exp too). Without a slab, or with every slot -1, the outputs
are the same bits as without the arguments; bad slab arguments are refused before any read. Tolerance: 2e-5 of the
largest output (float32 sums in another order)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from executor_svc.attention import cpu_kernel
from executor_svc.kv_quant import ChannelScaledCache, dequantize, parse_kv_dtype
from executor_svc.pages import DevicePagePool

pytestmark = [pytest.mark.unit, pytest.mark.skipif(cpu_kernel.unavailable_reason() is not None,
                                                   reason="no CPU kernel library here")]
BLOCK = 16
CTX = [1, 16, 17, 40, 77]  # a one-token row, a full page, pages ending mid-page


def _kernel():
    kernel = cpu_kernel.load()
    if kernel is None or not hasattr(kernel, "paged_attention_q8"):
        pytest.skip("no paged_attention_q8 in the CPU kernel library here")
    return kernel


def _case(kv_dtype: str, heads: int, kv_heads: int, dim: int, ctx_lens: list[int], seed: int):
    """A pool written one token at a time through its quantizers (INT8 K's exponents grow), shuffled page tables
    (page 0 left out: the tables' padding), random queries."""
    g = torch.Generator().manual_seed(seed)
    widths = [-(-c // BLOCK) for c in ctx_lens]
    num_pages = sum(widths) + 3
    cfg = SimpleNamespace(num_layers=1, num_kv_heads=kv_heads, head_dim=dim)
    pool = DevicePagePool(cfg, num_pages, BLOCK, torch.float32, torch.device("cpu"),
                          parse_kv_dtype(kv_dtype, torch.float32))
    k_cache, v_cache = pool.layer(0)
    order = (torch.randperm(num_pages - 1, generator=g) + 1).tolist()
    tables = torch.zeros(len(ctx_lens), max(widths), dtype=torch.long)
    for i, (c, w) in enumerate(zip(ctx_lens, widths)):
        pages = [order.pop() for _ in range(w)]
        tables[i, :w] = torch.tensor(pages)
        for t in range(c):
            size = torch.exp(torch.randn(1, kv_heads, 1, generator=g))  # tokens of different sizes
            k = torch.randn(1, kv_heads, dim, generator=g) * size
            k[..., :2] *= 8  # a few large key channels
            v = torch.randn(1, kv_heads, dim, generator=g) * size
            page, off = torch.tensor([pages[t // BLOCK]]), torch.tensor([t % BLOCK])
            k_cache.write(page, off, k)
            v_cache.write(page, off, v)
    q = torch.randn(len(ctx_lens), heads, dim, generator=g)
    return q, k_cache, v_cache, tables, torch.tensor(ctx_lens)


def _slab(k_cache, tables: torch.Tensor, seed: int, spare: int = 3, v_magnitude: float = 1.0):
    """A random bfloat16 slab as views of a larger buffer ([slots, layers, K/V, block, kv_heads, D], layer 1's K and
    V), and exact_slots giving a random subset of the pages (about half of those in the tables, at least one in and
    one out, and a page no table reads) shuffled slots, ``spare`` slots left unused; values times
    ``v_magnitude``."""
    g = torch.Generator().manual_seed(seed)
    num_pages, block, kv_heads, dim = k_cache.data.shape
    used = sorted(set(tables.flatten().tolist()) - {0})
    chosen = [p for p in used if torch.rand(1, generator=g).item() < 0.5]
    if not chosen:
        chosen = used[:1]
    if len(chosen) == len(used):
        chosen = chosen[1:]
    chosen.append(0)  # (a page outside every table: never read)
    count = len(chosen) + spare
    slots = torch.full((num_pages,), -1, dtype=torch.int32)
    slots[torch.tensor(chosen)] = torch.randperm(count, generator=g)[:len(chosen)].int()
    size = torch.exp(torch.randn(count, 1, 1, block, kv_heads, 1, generator=g))
    buf = torch.randn(count, 2, 2, block, kv_heads, dim, generator=g) * size
    buf[:, :, 0, ..., :2] *= 8  # (keys: a few large channels)
    buf[:, :, 1] *= v_magnitude
    buf = buf.to(torch.bfloat16)
    k_exact, v_exact = buf[:, 1, 0], buf[:, 1, 1]
    assert not k_exact.is_contiguous() and k_exact.stride(-1) == 1
    return k_exact, v_exact, slots


def _pool_args(k_cache, v_cache) -> tuple:
    k_scale = k_cache.exp if isinstance(k_cache, ChannelScaledCache) else k_cache.scale
    return k_cache.data.view(torch.uint8), k_scale, v_cache.data.view(torch.uint8), v_cache.scale


def _fp8(k_cache) -> bool:
    return k_cache.data.dtype == torch.float8_e4m3fn


def _rows64(k_cache, v_cache, k_exact=None, v_exact=None, slots=None):
    """Every page of the pool in float64, dequantized in torch (the pool's own arithmetic), then the slab pages'
    rows replaced by the slab's."""
    if isinstance(k_cache, ChannelScaledCache):
        k = k_cache.data.double() * torch.pow(2.0, k_cache.exp.double() - 127).unsqueeze(1)
    else:
        k = dequantize(k_cache.data, k_cache.scale, torch.float64)
    v = dequantize(v_cache.data, v_cache.scale, torch.float64)
    if slots is not None:
        for page, s in enumerate(slots.tolist()):
            if s >= 0:
                k[page], v[page] = k_exact[s].double(), v_exact[s].double()
    return k, v


def _reference(q, k, v, tables, ctx, scale: float, sinks=None, windows=None, model_window: int = 0, start: int = 0):
    """Plain softmax attention in float64 over each row's visible positions: t in [start, c), t >= c - model_window
    (with one), and with a row window w > 0: t >= c - w or t < the row's sink. Outputs [B, heads, D] and
    log-sum-exps [B, heads]; a row with no visible key: None."""
    heads, dim, kv_heads = q.shape[1], q.shape[2], k.shape[2]
    outs, lses = [], []
    for b, c in enumerate(ctx.tolist()):
        w = int(windows[b]) if windows is not None else 0
        seen = [t for t in range(start, c) if (model_window <= 0 or t >= c - model_window)
                and (w <= 0 or t >= c - w or t < int(sinks[b]))]
        if not seen:
            outs.append(None)
            lses.append(None)
            continue
        t = torch.tensor(seen)
        pages = tables[b, t // BLOCK]
        kb, vb = k[pages, t % BLOCK], v[pages, t % BLOCK]  # [n, kv_heads, D]
        s = torch.einsum("hgd,nhd->hgn", q[b].double().view(kv_heads, heads // kv_heads, dim), kb) * scale
        outs.append(torch.einsum("hgn,nhd->hgd", s.softmax(-1), vb).reshape(heads, dim))
        lses.append(torch.logsumexp(s, -1).reshape(heads))
    return outs, lses


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got.double(), want, rtol=2e-5, atol=2e-5 * float(want.abs().max()))


GROUPS = [(4, 4, 32), (6, 2, 48), (3, 3, 48), (9, 3, 64), (6, 2, 128), (2, 2, 128)]  # (heads, kv_heads, D)


@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "int8"])
@pytest.mark.parametrize("heads,kv_heads,dim", GROUPS)
@pytest.mark.parametrize("windows", ["none", "rows", "model"])
def test_slab_pages_are_read_from_the_slab(kv_dtype, heads, kv_heads, dim, windows):
    seed = dim + 7 * heads + kv_heads + len(windows)
    q, k_cache, v_cache, tables, ctx = _case(kv_dtype, heads, kv_heads, dim, CTX, seed)
    k_exact, v_exact, slots = _slab(k_cache, tables, seed + 1)
    kernel, scale = _kernel(), dim ** -0.5
    empty = torch.empty(0, dtype=torch.long)
    sinks, wins, model_window = empty, empty, 0
    if windows == "rows":
        sinks, wins = torch.tensor([0, 4, 2, 16, 3]), torch.tensor([0, 8, 10, 20, 30])  # (a window of 0: none)
    elif windows == "model":
        model_window = 24
    got = kernel.paged_attention_q8(q, *_pool_args(k_cache, v_cache), tables, ctx, sinks, wins, model_window,
                                    _fp8(k_cache), scale, k_exact, v_exact, slots)
    k, v = _rows64(k_cache, v_cache, k_exact, v_exact, slots)
    outs, _ = _reference(q, k, v, tables, ctx, scale, sinks if wins.numel() else None,
                         wins if wins.numel() else None, model_window)
    assert torch.isfinite(got).all()
    _close(got, torch.stack(outs))
    plain = kernel.paged_attention_q8(q, *_pool_args(k_cache, v_cache), tables, ctx, sinks, wins, model_window,
                                      _fp8(k_cache), scale)
    assert not torch.allclose(got, plain, rtol=1e-3, atol=1e-3)  # (the slab pages did count)


@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "int8"])
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 4, 32), (6, 2, 48), (2, 2, 128)])
def test_the_second_half_reads_slab_pages_with_its_log_sum_exp(kv_dtype, heads, kv_heads, dim):
    q, k_cache, v_cache, tables, ctx = _case(kv_dtype, heads, kv_heads, dim, CTX, seed=dim + heads)
    k_exact, v_exact, slots = _slab(k_cache, tables, seed=dim + heads + 1)
    kernel, scale = _kernel(), 0.125
    k, v = _rows64(k_cache, v_cache, k_exact, v_exact, slots)
    for start in (0, 5, 16, 33, 80):
        out, lse = kernel.paged_attention_q8_after(q, *_pool_args(k_cache, v_cache), tables, ctx, start,
                                                   _fp8(k_cache), scale, k_exact, v_exact, slots)
        outs, lses = _reference(q, k, v, tables, ctx, scale, start=start)
        for b in range(len(CTX)):
            if outs[b] is None:  # no key from start on: nothing, and a log-sum-exp of -inf
                assert (out[b] == 0).all() and torch.isinf(lse[b]).all() and (lse[b] < 0).all()
                continue
            _close(out[b], outs[b])
            torch.testing.assert_close(lse[b].double(), lses[b], rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "int8"])
@pytest.mark.parametrize("dim", [64, 48])
def test_without_slab_pages_the_outputs_are_the_same_bits(kv_dtype, dim):
    """No exact arguments, or a slab with every slot -1: the bits of the call without them (both attention ops)."""
    q, k_cache, v_cache, tables, ctx = _case(kv_dtype, 6, 2, dim, CTX, seed=dim)
    k_exact, v_exact, _ = _slab(k_cache, tables, seed=dim + 1)
    none = torch.full((k_cache.data.shape[0],), -1, dtype=torch.int32)
    kernel, pool, fp8 = _kernel(), _pool_args(k_cache, v_cache), _fp8(k_cache)
    sinks, wins = torch.tensor([0, 4, 2, 16, 3]), torch.tensor([0, 8, 10, 20, 30])
    plain = kernel.paged_attention_q8(q, *pool, tables, ctx, sinks, wins, 0, fp8, 0.125)
    assert torch.equal(kernel.paged_attention_q8(q, *pool, tables, ctx, sinks, wins, 0, fp8, 0.125, None, None, None),
                       plain)
    assert torch.equal(kernel.paged_attention_q8(q, *pool, tables, ctx, sinks, wins, 0, fp8, 0.125, k_exact, v_exact,
                                                 none), plain)
    out, lse = kernel.paged_attention_q8_after(q, *pool, tables, ctx, 16, fp8, 0.125)
    out2, lse2 = kernel.paged_attention_q8_after(q, *pool, tables, ctx, 16, fp8, 0.125, k_exact, v_exact, none)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)


@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "int8"])
@pytest.mark.parametrize("dim", [64, 48])
def test_the_slab_replaces_the_8_bit_pages(kv_dtype, dim):
    """Slab values ~1,000 times the pages': the outputs follow the slab (the attention in float64 over it); and
    whatever the 8-bit bytes and scales of slab pages hold (NaN bytes, huge exponents), they are not read."""
    q, k_cache, v_cache, tables, ctx = _case(kv_dtype, 6, 2, dim, CTX, seed=dim + 3)
    k_exact, v_exact, slots = _slab(k_cache, tables, seed=dim + 4, v_magnitude=1000.0)
    kernel, fp8, scale = _kernel(), _fp8(k_cache), dim ** -0.5
    empty = torch.empty(0, dtype=torch.long)
    got = kernel.paged_attention_q8(q, *_pool_args(k_cache, v_cache), tables, ctx, empty, empty, 0, fp8, scale,
                                    k_exact, v_exact, slots)
    k, v = _rows64(k_cache, v_cache, k_exact, v_exact, slots)
    want = torch.stack(_reference(q, k, v, tables, ctx, scale)[0])
    _close(got, want)
    k0, v0 = _rows64(k_cache, v_cache)
    ignored = torch.stack(_reference(q, k0, v0, tables, ctx, scale)[0])
    assert (got.double() - ignored).abs().max() > 100 * ignored.abs().max()
    exact_pages = (slots >= 0).nonzero().flatten()
    k_cache.data.view(torch.uint8)[exact_pages] = 0x7F  # FP8: NaN; INT8: 127
    v_cache.data.view(torch.uint8)[exact_pages] = 0x7F
    if isinstance(k_cache, ChannelScaledCache):
        k_cache.exp[exact_pages] = 254
    else:
        k_cache.scale[exact_pages] = float("nan")
    v_cache.scale[exact_pages] = float("nan")
    again = kernel.paged_attention_q8(q, *_pool_args(k_cache, v_cache), tables, ctx, empty, empty, 0, fp8, scale,
                                      k_exact, v_exact, slots)
    assert torch.equal(again, got)
    out, _ = kernel.paged_attention_q8_after(q, *_pool_args(k_cache, v_cache), tables, ctx, 0, fp8, scale, k_exact,
                                             v_exact, slots)
    assert torch.isfinite(out).all()
    _close(out, want)


@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "int8"])
@pytest.mark.parametrize("dim", [64, 48, 128])
def test_the_dequantizers_give_slab_pages_as_the_slab_holds_them(kv_dtype, dim):
    """Slab pages: the slab's values exactly; the others: the bits of the call without a slab (and torch's)."""
    q, k_cache, v_cache, tables, ctx = _case(kv_dtype, 3, 3, dim, CTX, seed=dim + 5)
    k_exact, v_exact, slots = _slab(k_cache, tables, seed=dim + 6)
    kernel = _kernel()
    ids = torch.cat([tables.flatten()[tables.flatten() > 0], torch.tensor([0, 0])])
    ids = ids[torch.randperm(ids.numel(), generator=torch.Generator().manual_seed(dim))]
    exact = slots[ids] >= 0
    assert exact.any() and (~exact).any()
    fp8 = _fp8(k_cache)
    v_plain = kernel.dequantize_pages_q8(v_cache.data.view(torch.uint8), v_cache.scale, ids, fp8)
    v_got = kernel.dequantize_pages_q8(v_cache.data.view(torch.uint8), v_cache.scale, ids, fp8, v_exact, slots)
    assert torch.equal(v_got[exact], v_exact[slots[ids[exact]].long()].float())
    assert torch.equal(v_got[~exact], v_plain[~exact])
    assert torch.equal(v_plain, dequantize(v_cache.data.index_select(0, ids), v_cache.scale.index_select(0, ids),
                                           torch.float32))
    none = torch.full_like(slots, -1)
    assert torch.equal(kernel.dequantize_pages_q8(v_cache.data.view(torch.uint8), v_cache.scale, ids, fp8, v_exact,
                                                  none), v_plain)
    if isinstance(k_cache, ChannelScaledCache):
        k_plain = kernel.dequantize_pages_int8_channels(k_cache.data.view(torch.uint8), k_cache.exp, ids)
        k_got = kernel.dequantize_pages_int8_channels(k_cache.data.view(torch.uint8), k_cache.exp, ids, k_exact,
                                                      slots)
        want = k_cache.data.index_select(0, ids).float() * torch.pow(
            2.0, k_cache.exp.index_select(0, ids).float() - 127).unsqueeze(1)
        assert torch.equal(k_plain, want)
        assert torch.equal(kernel.dequantize_pages_int8_channels(k_cache.data.view(torch.uint8), k_cache.exp, ids,
                                                                 k_exact, none), k_plain)
    else:
        k_plain = kernel.dequantize_pages_q8(k_cache.data.view(torch.uint8), k_cache.scale, ids, fp8)
        k_got = kernel.dequantize_pages_q8(k_cache.data.view(torch.uint8), k_cache.scale, ids, fp8, k_exact, slots)
    assert torch.equal(k_got[exact], k_exact[slots[ids[exact]].long()].float())
    assert torch.equal(k_got[~exact], k_plain[~exact])


@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "int8"])
def test_bad_slab_arguments_are_refused(kv_dtype):
    q, k_cache, v_cache, tables, ctx = _case(kv_dtype, 4, 2, 32, [20, 9], seed=9)
    k_exact, v_exact, slots = _slab(k_cache, tables, seed=10, spare=0)
    kernel, pool, fp8 = _kernel(), _pool_args(k_cache, v_cache), _fp8(k_cache)
    empty = torch.empty(0, dtype=torch.long)

    def both(k_ex, v_ex, sl, match):
        with pytest.raises(RuntimeError, match=match):
            kernel.paged_attention_q8(q, *pool, tables, ctx, empty, empty, 0, fp8, 1.0, k_ex, v_ex, sl)
        with pytest.raises(RuntimeError, match=match):
            kernel.paged_attention_q8_after(q, *pool, tables, ctx, 0, fp8, 1.0, k_ex, v_ex, sl)

    count = k_exact.shape[0]
    bad = slots.clone()
    bad[tables[0, 1]] = count  # one past the slab's last slot, on a page the first row reads
    both(k_exact, v_exact, bad, f"page {int(tables[0, 1])} has exact slot {count} outside the slab of {count} slots")
    both(k_exact, v_exact, slots[:-1], "exact_slots must be a contiguous int32 vector of one slot per page")
    both(k_exact, v_exact, slots.long(), "exact_slots must be a contiguous int32 vector of one slot per page")
    both(k_exact, None, slots, "k_exact, v_exact and exact_slots must be given together")
    both(None, None, slots, "k_exact, v_exact and exact_slots must be given together")
    both(k_exact, v_exact, None, "k_exact, v_exact and exact_slots must be given together")
    wide = torch.zeros(count, BLOCK, 2, 64, dtype=torch.bfloat16)  # head_dim 64 against the pool's 32
    both(wide, v_exact, slots, r"k_exact must be bfloat16 \[slots, block, kv_heads, D\]")
    both(k_exact, wide, slots, r"v_exact must be bfloat16 \[slots, block, kv_heads, D\]")
    both(k_exact, v_exact.float(), slots, r"v_exact must be bfloat16")
    both(k_exact, v_exact[:-1], slots, "k_exact and v_exact must have the same slots")
    ids = tables[0, :2].contiguous()
    data, scale = v_cache.data.view(torch.uint8), v_cache.scale
    with pytest.raises(RuntimeError, match=f"dequantize_pages_q8: page {int(tables[0, 1])} has exact slot {count} "
                                           f"outside the slab of {count} slots"):
        kernel.dequantize_pages_q8(data, scale, ids, fp8, v_exact, bad)
    with pytest.raises(RuntimeError, match="exact and exact_slots must be given together"):
        kernel.dequantize_pages_q8(data, scale, ids, fp8, v_exact, None)
    with pytest.raises(RuntimeError, match="dequantize_pages_q8: exact_slots must be a contiguous int32 vector"):
        kernel.dequantize_pages_q8(data, scale, ids, fp8, v_exact, slots[1:])
    with pytest.raises(RuntimeError, match=r"dequantize_pages_q8: exact must be bfloat16 \[slots, block"):
        kernel.dequantize_pages_q8(data, scale, ids, fp8, wide, slots)
    exp = torch.full((k_cache.data.shape[0], 2, 32), 127, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match=f"dequantize_pages_int8_channels: page {int(tables[0, 1])} has exact slot"):
        kernel.dequantize_pages_int8_channels(k_cache.data.view(torch.uint8), exp, ids, k_exact, bad)
    with pytest.raises(RuntimeError, match="dequantize_pages_int8_channels: exact_slots must be a contiguous int32"):
        kernel.dequantize_pages_int8_channels(k_cache.data.view(torch.uint8), exp, ids, k_exact, slots.long())
    with pytest.raises(RuntimeError, match="dequantize_pages_int8_channels: page id 99 outside the pool"):
        kernel.dequantize_pages_int8_channels(k_cache.data.view(torch.uint8), exp, torch.tensor([99]))
