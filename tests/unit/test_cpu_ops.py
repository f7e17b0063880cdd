"""The fused CPU ops (executor_svc/model/cpu_ops.cpp), float32 and bfloat16, against the torch ops they replace, on
fresh random inputs at several shapes, and a model's fused forward against its torch forward (the reference)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from executor_svc.attention import cpu_kernel

pytestmark = [pytest.mark.unit, pytest.mark.skipif(cpu_kernel.unavailable_reason() is not None,
                                                   reason=f"no CPU kernels here: {cpu_kernel.unavailable_reason()}")]
TOL = dict(rtol=2e-6, atol=2e-6)  # float32 sums in another order
# bfloat16: one unit in the last place (2^-8 relative) where the norm's float32 sum, in another order, or the
# exp's last bits put a value on the other side of a rounding boundary
BF16_TOL = dict(rtol=8e-3, atol=1e-5)


@pytest.fixture(scope="module")
def ops():
    lib = cpu_kernel.load()
    assert lib is not None, cpu_kernel.reason()
    return lib


def torch_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


@pytest.mark.parametrize("rows,d", [(1, 576), (7, 64), (33, 1000)])
def test_rms_norm_and_the_residual_add(ops, rows, d):
    g = torch.Generator().manual_seed(rows * d)
    x, a = (torch.randn(rows, d, generator=g) * 3 for _ in range(2))
    w = torch.randn(d, generator=g)
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-5), torch_norm(x, w, 1e-5), **TOL)
    want_x = x + a
    got = ops.add_rms_norm(x, a, w, 1e-6)
    assert torch.equal(x, want_x), "x += a in place"
    torch.testing.assert_close(got, torch_norm(want_x, w, 1e-6), **TOL)
    strided = torch.randn(rows, 2 * d, generator=g)[:, :d]  # rows not contiguous: still read right
    torch.testing.assert_close(ops.rms_norm(strided, w, 1e-5), torch_norm(strided, w, 1e-5), **TOL)


@pytest.mark.parametrize("rows,d", [(1, 576), (7, 64), (33, 1000)])
def test_bfloat16_norms_round_where_torch_s_do(ops, rows, d):
    """bfloat16: the residual add rounded as torch's bfloat16 add (bit for bit), and the norm as
    executor_svc.model.layers.rms_norm (float32 inside, x * r rounded, then the weight's product rounded)."""
    from executor_svc.model.layers import rms_norm

    g = torch.Generator().manual_seed(rows + d)
    x, a = ((torch.randn(rows, d, generator=g) * 3).bfloat16() for _ in range(2))
    w = torch.randn(d, generator=g).bfloat16()
    got = ops.rms_norm(x, w, 1e-5)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), rms_norm(x, w, 1e-5).float(), **BF16_TOL)
    want_x = x + a
    got = ops.add_rms_norm(x, a, w, 1e-6)
    assert torch.equal(x, want_x), "x += a in place, rounded as torch rounds"
    torch.testing.assert_close(got.float(), rms_norm(want_x, w, 1e-6).float(), **BF16_TOL)
    with pytest.raises(RuntimeError, match="weight must be"):
        ops.rms_norm(x, w.float(), 1e-5)


@pytest.mark.parametrize("rows,d", [(1, 1536), (32, 1536), (5, 37)])  # (37: no whole vector of 16)
def test_silu_mul(ops, rows, d):
    g = torch.Generator().manual_seed(d)
    gate_up = torch.randn(rows, 2 * d, generator=g) * 6  # both signs, large magnitudes
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(ops.silu_mul(gate_up), F.silu(gate) * up, rtol=1e-6, atol=1e-6)
    half = gate_up.bfloat16()
    gate, up = half.chunk(2, dim=-1)
    got = ops.silu_mul(half)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), (F.silu(gate) * up).float(), **BF16_TOL)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("n,heads,kv_heads,dim", [(1, 9, 3, 64), (20, 8, 4, 32), (3, 4, 1, 128)])
def test_rotary_write_is_torch_s_rotary_and_cache_write_bit_for_bit(ops, n, heads, kv_heads, dim, dtype):
    g = torch.Generator().manual_seed(n + dim)
    qkv = torch.randn(n, (heads + 2 * kv_heads) * dim, generator=g).to(dtype)
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k, v = q.view(n, heads, dim), k.view(n, kv_heads, dim), v.view(n, kv_heads, dim)  # strided views
    angles = torch.rand(n, dim // 2, generator=g) * 50
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    pool = torch.randn(12, 3, 2, 16, kv_heads, dim, generator=g).to(dtype)  # [pages, layers, K/V, block, kv, dim]
    k_cache, v_cache = pool[:, 1, 0], pool[:, 1, 1]
    slots = torch.randperm(12 * 16, generator=g)[:n]  # distinct slots
    pages, offsets = slots // 16, slots % 16
    want_k, want_v = k_cache.clone(), v_cache.clone()
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    want_k[pages, offsets] = k * c + rotate_half(k) * s
    want_v[pages, offsets] = v
    got_q = ops.rotary_write(q, k, v, cos, sin, k_cache, v_cache, pages, offsets)
    assert torch.equal(got_q, q * c + rotate_half(q) * s) and got_q.is_contiguous()
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    before = pool.clone()
    with pytest.raises(RuntimeError, match="outside the pool"):
        ops.rotary_write(q, k, v, cos, sin, k_cache, v_cache, torch.full((n,), 12), offsets)
    assert torch.equal(pool, before), "a bad slot must write nothing"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_model_s_fused_forward_equals_its_torch_forward(tiny_llama_dir, dtype):
    """tiny-llama through the runner's kind of step (a prefill chunk, then decodes), fused and not: logits within
    float32 noise (bfloat16: within a few of its units), and the same greedy token wherever the top two are further
    apart than that noise. Both paths decode the same fixed tokens: a random model's top logits can tie in bfloat16
    (two at 3.65625 on a Zen 4), and feeding each path its own argmax would compare two different sequences."""
    from executor_svc.attention.metadata import AttentionMetadata, DecodeGroup, PrefillSegment
    from executor_svc.attention.torch_backend import TorchPagedAttention
    from executor_svc.kv_quant import parse_kv_dtype
    from executor_svc.model import load_model
    from executor_svc.model_config import ModelConfig
    from executor_svc.pages import DevicePagePool

    cfg = ModelConfig.from_dir(tiny_llama_dir)
    model = load_model(cfg, torch.device("cpu"), dtype)
    assert model.fused_ops() is not None
    attention = TorchPagedAttention(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, model.scale)
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(3, 259, (40,), generator=g)
    decoded = torch.randint(3, 259, (4,), generator=g)
    logits = {}
    for fused in (True, False):
        model._fused = None if fused else False
        pool = DevicePagePool(cfg, 8, 16, dtype, torch.device("cpu"), parse_kv_dtype("auto", dtype))
        pages = torch.tensor([3, 5, 1, 6])
        pos = torch.arange(40)
        meta = AttentionMetadata(pages[pos // 16], pos % 16, [], [PrefillSegment(0, 40, 40, pages[:3])])
        out = [model.forward(prompt, pos, meta, pool, attention, torch.tensor([39]))]
        for p in range(40, 44):
            meta = AttentionMetadata(pages[p // 16].view(1), torch.tensor([p % 16]),
                                     [DecodeGroup(torch.arange(1), pages.view(1, -1), torch.tensor([p + 1]),
                                                  in_order=True)], [])
            out.append(model.forward(decoded[p - 40].view(1), torch.tensor([p]), meta, pool, attention,
                                     torch.tensor([0])))
        logits[fused] = torch.cat(out).float()
    if dtype == torch.float32:
        rtol = atol = 1e-4
    else:  # two bfloat16 units relative, three absolute at the largest logit's power of two (a unit is 2^-7 of it)
        rtol, atol = 2.0 ** -6, 3 * 2.0 ** (torch.floor(torch.log2(logits[False].abs().max())).item() - 7)
    torch.testing.assert_close(logits[True], logits[False], rtol=rtol, atol=atol)
    top2 = logits[False].topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * (atol + rtol * top2[:, 0].abs())
    assert clear.any(), "no row has a clear winner: the check below would check nothing"
    assert torch.equal(logits[True].argmax(-1)[clear], logits[False].argmax(-1)[clear])
