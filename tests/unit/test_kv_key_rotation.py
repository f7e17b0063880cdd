"""FP8 pages hold keys in a rotated basis (executor_svc/kv_quant.py ``key_rotation``): the two matrices are exact
inverses of each other in every model dtype; the model writes ``k @ S / b`` into FP8 pages and plain keys into every
other format; and a model over FP8 pages computes the attention of the unrotated keys up to FP8's rounding."""

from __future__ import annotations

import pytest
import torch

from executor_svc.kv_quant import dequantize, key_rotation, parse_kv_dtype, rotation_block

pytestmark = pytest.mark.unit
CPU = torch.device("cpu")


@pytest.mark.parametrize("head_dim", [1, 6, 16, 32, 64, 80, 96, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_query_and_key_rotations_are_exact_inverses(head_dim, dtype):
    for_q, for_k = key_rotation(head_dim, dtype, CPU)
    b = rotation_block(head_dim)
    assert head_dim % b == 0 and (head_dim // b) % 2 == 1 and b & (b - 1) == 0  # the largest power of two
    assert for_q.dtype == for_k.dtype == dtype
    assert set(for_q.float().unique().tolist()) <= {-1.0, 0.0, 1.0}
    assert torch.equal(for_q.double() @ for_k.double().T, torch.eye(head_dim, dtype=torch.float64))
    if b > 1:
        assert int((for_q != 0).sum()) == head_dim * b  # (block-diagonal, every block dense: keys' channels mix)
    g = torch.Generator().manual_seed(head_dim)
    q, k = torch.randn(5, head_dim, generator=g), torch.randn(7, head_dim, generator=g)
    rq, rk = key_rotation(head_dim, torch.float32, CPU)
    torch.testing.assert_close((q @ rq) @ (k @ rk).T, q @ k.T, rtol=1e-5, atol=1e-5)


def test_only_fp8_rotates_keys():
    assert parse_kv_dtype("fp8_e4m3", torch.float32).rotates_keys
    for name in ("int8", "float32", "bfloat16", "float16", "auto"):
        assert not parse_kv_dtype(name, torch.float32).rotates_keys


def _fp8_scheme_attention(cfg, scale):
    """The torch backend over float32 pages that writes what the FP8 scheme keeps, in the model's own basis:
    ``quant(k S / b)`` rotated back (``@ S.T``) and ``quant(v)``, both dequantized (an independent reference of
    the scheme: attending with plain queries over these is attending with ``q S`` over the FP8 pages)."""
    from executor_svc.attention.torch_backend import TorchPagedAttention
    from executor_svc.kv_quant import quantize

    fmt = parse_kv_dtype("fp8_e4m3", torch.float32)
    for_q, for_k = key_rotation(cfg.head_dim, torch.float32, CPU)

    class Fp8Scheme(TorchPagedAttention):
        plain_cache_writes = False

        def write_cache(self, k_cache, v_cache, k, v, meta):
            k = dequantize(*quantize(k @ for_k, fmt), torch.float32) @ for_q.T
            super().write_cache(k_cache, v_cache, k, dequantize(*quantize(v, fmt), torch.float32), meta)

    return Fp8Scheme(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, scale)


def _prefill(model_dir, kv_dtype: str, tokens: list[int], scheme: bool = False):
    """One prefill of ``tokens`` over a fresh pool of ``kv_dtype`` (``scheme``: float32 pages through
    _fp8_scheme_attention): (the config, the pool, its pages, the logits)."""
    from executor_svc.attention.metadata import AttentionMetadata, PrefillSegment
    from executor_svc.attention.torch_backend import TorchPagedAttention
    from executor_svc.model import load_model
    from executor_svc.model_config import ModelConfig
    from executor_svc.pages import DevicePagePool

    cfg = ModelConfig.from_dir(model_dir)
    model = load_model(cfg, CPU, torch.float32)
    n, block = len(tokens), 16
    pages = list(range(1, -(-n // block) + 1))
    pool = DevicePagePool(cfg, len(pages) + 1, block, torch.float32, CPU, parse_kv_dtype(kv_dtype, torch.float32))
    pos = torch.arange(n)
    meta = AttentionMetadata(torch.tensor(pages)[pos // block], pos % block, [],
                             [PrefillSegment(0, n, n, torch.tensor(pages))])
    attention = (_fp8_scheme_attention(cfg, model.scale) if scheme
                 else TorchPagedAttention(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, model.scale))
    logits = model.forward(torch.tensor(tokens), pos, meta, pool, attention, torch.arange(n))
    return cfg, pool, pages, logits


def test_fp8_pages_hold_rotated_keys_and_attend_as_the_plain_ones(tiny_llama_dir):
    g = torch.Generator().manual_seed(7)
    tokens = [1] + torch.randint(3, 256, (39,), generator=g).tolist()
    cfg, plain, pages, ref_logits = _prefill(tiny_llama_dir, "float32", tokens)
    _, fp8, _, fp8_logits = _prefill(tiny_llama_dir, "fp8_e4m3", tokens)
    _, int8, _, _ = _prefill(tiny_llama_dir, "int8", tokens)
    n, dim = len(tokens), cfg.head_dim
    _, for_k = key_rotation(dim, torch.float32, CPU)
    k = plain.k_views[0][pages].reshape(-1, cfg.num_kv_heads, dim)[:n]  # layer 0's keys (its input is the prompt's)
    view = fp8.k_views[0]
    stored = dequantize(view.data[pages], view.scale[pages], torch.float32).reshape(-1, cfg.num_kv_heads, dim)[:n]
    rotated = k @ for_k
    bound = rotated.abs().amax(-1, keepdim=True) / 16 + 1e-6  # E4M3: 3 mantissa bits, half a step of the largest
    assert ((stored - rotated).abs() <= bound).all()
    assert ((stored - k).abs() > bound).any()  # (not the plain keys)
    v8 = int8.k_views[0]
    int8_k = v8.data[pages].float() * torch.exp2(v8.exp[pages].float() - 127).unsqueeze(1)
    int8_k = int8_k.reshape(-1, cfg.num_kv_heads, dim)[:n]
    torch.testing.assert_close(int8_k, k, rtol=0, atol=float(k.abs().max()) / 64)  # int8 keys stay unrotated
    # every layer: the logits are those of the scheme's reference, and not those of unrotated FP8 keys
    _, _, _, scheme_logits = _prefill(tiny_llama_dir, "float32", tokens, scheme=True)
    # (float rounding differs between the two, so a scale may round the other way: measured 7e-4 at most, 2e-5 on
    # average, against 1.4 / 0.17 between the reference and unrotated FP8 keys)
    torch.testing.assert_close(fp8_logits, scheme_logits, rtol=0, atol=5e-3)
    assert (fp8_logits - scheme_logits).abs().mean() < (fp8_logits - ref_logits).abs().mean() / 100
