"""8-bit KV pages (executor_svc.kv_quant): the FP8 conversion, quantization error bounds, scales inside the
page through every page move, the torch backend against dense attention, the flag's refusals and Describe."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from executor_svc.attention.metadata import AttentionMetadata, DecodeGroup, PrefillSegment
from executor_svc.attention.torch_backend import TorchPagedAttention
from executor_svc.kv_quant import (
    FP8_MAX,
    ChannelScaledCache,
    QuantizedCache,
    dequantize,
    fp8_e4m3_reference,
    parse_kv_dtype,
    quantize,
    to_fp8_e4m3,
)
from executor_svc.pages import DevicePagePool, HostPagePool, PageMover
from executor_svc.runner import ModelRunner
from pagedkv.executor.v1 import executor_pb2 as pb
from tests.support.attention_reference import dense

pytestmark = pytest.mark.unit

QUANTIZED = ["fp8_e4m3", "int8"]


def all_fp8_values() -> torch.Tensor:
    """Every finite float8_e4m3fn value, ascending (from the bit patterns)."""
    bits = torch.arange(256, dtype=torch.int16).to(torch.uint8)
    vals = bits.view(torch.float8_e4m3fn).float()
    return torch.unique(vals[torch.isfinite(vals)])


def test_fp8_conversion_rounds_to_nearest_even_and_saturates():
    vals = all_fp8_values()
    assert vals.numel() == 253 and vals.max() == FP8_MAX  # 254 finite patterns, +0 and -0 merge
    mids = (vals[1:].double() + vals[:-1].double()) / 2  # exact ties between neighbours
    just = torch.cat([mids * (1 + 1e-6), mids * (1 - 1e-6)])  # either side of each tie
    g = torch.Generator().manual_seed(0)
    rand = torch.randn(20000, generator=g, dtype=torch.float64) * torch.pow(2.0, torch.randint(-12, 12, (20000,),
                                                                                                 generator=g))
    big = torch.tensor([448.0, 449.0, 463.9, 464.0, 480.0, 1e4, 3e38, float("inf")], dtype=torch.float64)
    x = torch.cat([vals.double(), mids, just, rand, big, -big]).float()
    ours = to_fp8_e4m3(x).float()
    ref = fp8_e4m3_reference(x.double()).float()
    assert torch.equal(ours, ref), (x[ours != ref][:8], ours[ours != ref][:8], ref[ours != ref][:8])
    assert torch.isfinite(ours).all() and ours.abs().max() == FP8_MAX  # saturates: no NaN from large values
    # ties go to the even mantissa: 1 + 1/16 lies between 1 and 1.125 -> 1; 1 + 3/16 -> 1.25
    assert to_fp8_e4m3(torch.tensor([1.0625, 1.1875, -1.0625])).float().tolist() == [1.0, 1.25, -1.0]


@pytest.mark.parametrize("name", QUANTIZED)
def test_quantization_error_is_bounded_per_vector(name):
    fmt = parse_kv_dtype(name, torch.float32)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 4, 64, generator=g) * torch.rand(64, 4, 1, generator=g) * 10
    x[3, 1] = 0.0  # an all-zero head vector
    x[5, 2, 7] = 1e4  # an outlier
    data, scale = quantize(x, fmt)
    assert data.dtype == fmt.storage and scale.dtype == torch.bfloat16 and scale.shape == x.shape[:-1]
    err = (dequantize(data, scale, torch.float32) - x).abs()
    amax = x.abs().amax(-1, keepdim=True)
    # int8: half a step of amax/127 (the bf16 scale may round up by 2^-9); fp8: half a mantissa step, 2^-4
    bound = amax * (0.5 / 127 * (1 + 2 ** -8)) if name == "int8" else x.abs() * 2 ** -4 + amax * 2 ** -9 / 448
    assert (err <= bound + 1e-7).all()
    assert torch.equal(dequantize(data, scale, torch.float32)[3, 1], torch.zeros(64))


@pytest.mark.parametrize("name", ["int4", "fp4", "nf4", "INT4"])
def test_four_bit_kv_is_refused_with_the_reason(name):
    with pytest.raises(ValueError, match="--kv-cache-dtype .*not supported.*poor kernel support.*quality"):
        parse_kv_dtype(name, torch.float16)


def test_kv_dtype_names():
    assert parse_kv_dtype("auto", torch.bfloat16).name == "bfloat16"
    assert parse_kv_dtype("fp16", torch.float32).storage == torch.float16
    assert parse_kv_dtype("fp8", torch.float32).name == "fp8_e4m3"
    with pytest.raises(ValueError, match="choose one of auto"):
        parse_kv_dtype("float64", torch.float32)


def quant_pools(name: str, num_pages: int = 12, num_host: int = 8, head_dim: int = 64, kv_heads: int = 2,
                block: int = 16, layers: int = 3):
    cfg = SimpleNamespace(num_layers=layers, num_kv_heads=kv_heads, head_dim=head_dim)
    dev = DevicePagePool(cfg, num_pages, block, torch.float16, torch.device("cpu"), parse_kv_dtype(name, torch.float16))
    host = HostPagePool(dev, num_host)
    return cfg, dev, host


@pytest.mark.parametrize("name", QUANTIZED)
def test_page_bytes_hold_data_and_scales_and_half_of_fp16(name):
    cfg, dev, host = quant_pools(name)
    fp16 = DevicePagePool(cfg, 4, 16, torch.float16, torch.device("cpu"))
    # 1 byte per element, a 2-byte scale per token and head (int8 K: a 1-byte exponent per page, head, channel)
    v_bytes = 16 * 2 * 64 + 16 * 2 * 2
    k_bytes = 16 * 2 * 64 + (2 * 64 if name == "int8" else 16 * 2 * 2)
    assert dev.page_bytes == 3 * (k_bytes + v_bytes)
    assert dev.page_bytes <= 0.53 * fp16.page_bytes
    assert dev.pages[0].numel() * dev.pages.element_size() == dev.page_bytes
    assert host.pages.shape == (8, *dev.pages.shape[1:]) and host.page_bytes == dev.page_bytes
    k, v = dev.layer(1)
    assert isinstance(v, QuantizedCache) and v.data.shape == (12, 16, 2, 64) and v.scale.shape == (12, 16, 2)
    if name == "int8":
        assert isinstance(k, ChannelScaledCache) and k.exp.shape == (12, 2, 64) and k.data.dtype == torch.int8
    else:
        assert isinstance(k, QuantizedCache) and k.data.dtype == torch.float8_e4m3fn
    # the views are the pool's bytes: writing through them changes the page, inside its own block
    before = dev.pages.clone()
    k.write(torch.tensor([5]), torch.tensor([3]), torch.full((1, 2, 64), 2.0))
    changed = (dev.pages != before).nonzero()[:, 0].unique().tolist()
    assert changed == [5]


def fill(dev: DevicePagePool, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    n = dev.num_pages * dev.block_size
    for k, v in (dev.layer(i) for i in range(len(dev.k_views))):
        pages = torch.arange(dev.num_pages).repeat_interleave(dev.block_size)
        offs = torch.arange(dev.block_size).repeat(dev.num_pages)
        for cache in (k, v):
            x = torch.randn(n, *cache.shape[2:], generator=g) * torch.rand(n, cache.shape[2], 1, generator=g) * 8
            cache.write(pages, offs, x)


def values(dev: DevicePagePool, page: int) -> list[torch.Tensor]:
    return [c.gather(torch.tensor([page]), torch.float32) for i in range(len(dev.k_views)) for c in dev.layer(i)]


@pytest.mark.parametrize("name", QUANTIZED)
def test_swap_spill_and_copy_on_write_keep_scales(name):
    """Swap out and in (also the prefix spill path: the same page DMA) and copy-on-write through the runner:
    the dequantized K/V of every layer come back identical, so the scales travelled with the data."""
    _, dev, host = quant_pools(name)
    fill(dev, 2)
    want = {p: values(dev, p) for p in (1, 2, 3)}
    runner = ModelRunner(type("M", (), {})(), dev, attention=None, device=torch.device("cpu"), host_pool=host)
    plan = pb.StepPlan(step_id=1)
    plan.page_ops.swap_out.add(src=1, dst=6)
    plan.page_ops.swap_out.add(src=2, dst=7)
    plan.page_ops.copy.add(src=3, dst=9)  # copy-on-write (n > 1 forks, a shared prefix's last page)
    assert not runner.step(plan).error
    fill(dev, 3)  # the freed device pages are reused (and page 9 overwritten ...)
    plan = pb.StepPlan(step_id=2)
    plan.page_ops.copy.add(src=3, dst=9)  # ... copied again from the untouched source
    plan.page_ops.swap_in.add(src=6, dst=10)
    plan.page_ops.swap_in.add(src=7, dst=4)
    assert not runner.step(plan).error
    got = {1: values(dev, 10), 2: values(dev, 4)}
    for p, vals in got.items():
        assert all(torch.equal(a, b) for a, b in zip(vals, want[p])), f"page {p} changed in the swap"
    assert all(torch.equal(a, b) for a, b in zip(values(dev, 9), values(dev, 3)))
    mover = PageMover(dev, host)  # and the mover alone, as the spill of an evicted prefix page uses it
    snap = dev.pages[5].clone()
    mover.run([(5, 0)], [])
    dev.pages[5].zero_()
    mover.run([], [(0, 5)])
    assert torch.equal(dev.pages[5], snap)


@pytest.mark.parametrize("name", QUANTIZED)
@pytest.mark.parametrize("window", [None, 13])
def test_torch_backend_on_quantized_pages_matches_dense(name, window):
    """write_cache quantizes, the gather dequantizes: decodes and prefill chunks (with a sliding window and a
    per-request sink + window, as page budgets set) match dense attention over the dequantized K/V."""
    torch.manual_seed(4)
    heads, kv_heads, head_dim, block = 8, 2, 64, 16
    cfg = SimpleNamespace(num_layers=1, num_kv_heads=kv_heads, head_dim=head_dim)
    pool = DevicePagePool(cfg, 40, block, torch.float32, torch.device("cpu"), parse_kv_dtype(name, torch.float32))
    kc, vc = pool.layer(0)
    attn = TorchPagedAttention(heads, kv_heads, head_dim, head_dim ** -0.5)
    reqs = [(37, 1), (70, 1), (25, 25), (50, 9)]
    perm = torch.randperm(40).tolist()
    tables = [[perm.pop() for _ in range(-(-ctx // block))] for ctx, _ in reqs]
    ks = [torch.randn(ctx, kv_heads, head_dim) * 3 for ctx, _ in reqs]
    vs = [torch.randn(ctx, kv_heads, head_dim) for ctx, _ in reqs]
    for (ctx, n), t, k, v in zip(reqs, tables, ks, vs):  # the context before this step
        pos = torch.arange(ctx - n)
        pages = torch.tensor(t)[pos // block]
        kc.write(pages, pos % block, k[: ctx - n])
        vc.write(pages, pos % block, v[: ctx - n])
    sp, so, new_k, new_v, dec_idx, dec_tables, dec_lens, prefills, start = [], [], [], [], [], [], [], [], 0
    for (ctx, n), t, k, v in zip(reqs, tables, ks, vs):
        for pos in range(ctx - n, ctx):
            sp.append(t[pos // block])
            so.append(pos % block)
        new_k.append(k[ctx - n:])
        new_v.append(v[ctx - n:])
        if n == 1:
            dec_idx.append(start)
            dec_tables.append(t + [0] * (5 - len(t)))
            dec_lens.append(ctx)
        else:
            prefills.append(PrefillSegment(start, n, ctx, torch.tensor(t), sink=4 if window else 0,
                                           window=20 if window else 0))
        start += n
    meta = AttentionMetadata(torch.tensor(sp), torch.tensor(so),
                             [DecodeGroup(torch.tensor(dec_idx), torch.tensor(dec_tables), torch.tensor(dec_lens))],
                             prefills, sliding_window=window)
    q = torch.randn(start, heads, head_dim)
    attn.write_cache(kc, vc, torch.cat(new_k), torch.cat(new_v), meta)
    out = attn.forward(q, kc, vc, meta)
    start = 0
    for (ctx, n), t, k, v in zip(reqs, tables, ks, vs):
        kq, vq = (c.gather(torch.tensor(t), torch.float32).reshape(-1, kv_heads, head_dim)[:ctx] for c in (kc, vc))
        assert (kq - k).abs().max() < 0.5 and (vq - v).abs().max() < 0.5  # what the pool holds is the input
        rows = q[start:start + n]
        if n > 1 and window:  # the sink + window of the segment: dense over the visible positions only
            exp = torch.stack([_dense_visible(rows[i], kq, vq, ctx - n + i, window, 4, 20, head_dim)
                               for i in range(n)])
        else:
            exp = dense(rows, kq, vq, ctx, n, head_dim ** -0.5, window)
        torch.testing.assert_close(out[start:start + n], exp, atol=2e-5, rtol=1e-4)
        exact = dense(rows, k, v, ctx, n, head_dim ** -0.5, window if n == 1 else None)
        if n == 1 or not window:  # and close to full precision K/V (fp8: 3 mantissa bits)
            assert (out[start:start + n] - exact).abs().max() < (0.1 if name == "int8" else 0.3)
        start += n


def _dense_visible(q, k, v, qpos, window, sink, req_window, head_dim):
    kp = torch.arange(qpos + 1)
    vis = (kp > qpos - window) & ((kp < sink) | (kp > qpos - req_window))
    group = q.shape[0] // k.shape[1]
    kk = k[: qpos + 1][vis].repeat_interleave(group, 1).transpose(0, 1)
    vv = v[: qpos + 1][vis].repeat_interleave(group, 1).transpose(0, 1)
    s = (q.unsqueeze(1) @ kk.transpose(1, 2)) * head_dim ** -0.5
    return (torch.softmax(s, -1) @ vv).squeeze(1)


def test_fp8_table_lookup_equals_the_cast():
    from executor_svc.kv_quant import _to_float

    bits = torch.arange(256, dtype=torch.int16).to(torch.uint8).view(torch.float8_e4m3fn).view(4, 64)
    assert torch.allclose(_to_float(bits), bits.float(), rtol=0, atol=0, equal_nan=True)  # all 256, NaNs too


def channel_pool(num_pages: int = 6):
    cfg = SimpleNamespace(num_layers=1, num_kv_heads=2, head_dim=64)
    pool = DevicePagePool(cfg, num_pages, 16, torch.float32, torch.device("cpu"), parse_kv_dtype("int8", torch.float32))
    return pool, pool.layer(0)[0]


def test_int8_k_channel_scales_streamed_writes_rescale_the_page():
    """Tokens written one at a time (decode), then a chunk (prefill): the page's scale per channel grows to
    cover its largest value and earlier tokens are requantized; every token stays within one final step of
    its value; a page reused from offset 0 forgets the previous owner's scales; outlier channels do not
    coarsen the other channels."""
    pool, k = channel_pool()
    g = torch.Generator().manual_seed(5)
    x = torch.randn(16, 2, 64, generator=g) * torch.linspace(0.1, 3, 16).view(16, 1, 1)  # growing magnitudes
    x[:, :, 3] *= 20  # an outlier channel
    for i in range(10):  # decode: one token a step into page 2
        k.write(torch.tensor([2]), torch.tensor([i]), x[i:i + 1])
    k.write(torch.full((6,), 2), torch.arange(10, 16), x[10:])  # a prefill chunk finishes the page
    got = k.gather(torch.tensor([2]), torch.float32)[0]
    step = torch.pow(2.0, k.exp[2].float() - 127)  # [H, D] the final scales
    amax = x.abs().amax(0)
    assert (step <= 2 * amax / 127 + 1e-12).all() and (step >= amax / 127).all()
    assert ((got - x).abs() <= step + 1e-7).all()  # half a step for the last write, at most as much again from
    # the requantizations (each exact power-of-two division rounds once: 1/4 + 1/8 + ... of the final step)
    normal = [c for c in range(64) if c != 3]
    assert step[:, normal].max() * 4 <= step[:, 3].min()  # the outlier channel (20x) has its own, coarser scale
    # the page is freed and reused by another request: small values from offset 0
    small = torch.randn(3, 2, 64, generator=g) * 0.01
    k.write(torch.tensor([2, 2, 2]), torch.arange(3), small)
    again = k.gather(torch.tensor([2]), torch.float32)[0, :3]
    assert (again - small).abs().max() < 0.01 / 127 * 4 + 1e-6


def test_int8_k_pages_written_together_match_one_by_one_writes_up_to_requantization():
    pool, k = channel_pool()
    g = torch.Generator().manual_seed(6)
    x = torch.randn(32, 2, 64, generator=g)
    k.write(torch.tensor([0] * 16 + [4] * 16), torch.arange(32) % 16, x)  # two pages in one step
    both = k.gather(torch.tensor([0, 4]), torch.float32).reshape(32, 2, 64)
    ideal_step = torch.pow(2.0, torch.ceil(torch.log2(x.view(2, 16, 2, 64).abs().amax(1) / 127)))
    assert torch.equal(torch.pow(2.0, k.exp[[0, 4]].float() - 127), ideal_step)  # written at once: no rescale
    assert ((both - x).view(2, 16, 2, 64).abs() <= ideal_step.unsqueeze(1) / 2 + 1e-7).all()


def test_backend_choice_with_8_bit_pages():
    from executor_svc.attention import select_backend

    assert select_backend("torch", torch.device("cpu"), torch.float16, 128, kv_quantized=True)[0] == "torch"
    with pytest.raises(ValueError, match="--attention-backend cuda: it needs a CUDA device"):
        select_backend("cuda", torch.device("cpu"), torch.float16, 128, kv_quantized=True)
