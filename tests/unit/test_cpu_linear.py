"""Float32 and bfloat16 linears on the CPU (executor_svc/model/cpu_linear.py): our float32 product (cpu_gemm.cpp,
where AVX-512 builds it) and oneDNN's, each torch's results within float32 rounding and each float32 row the same
bits whatever the batch; bfloat16 within its rounding; the reference switch back to torch's F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from executor_svc.model import cpu_linear

pytestmark = [pytest.mark.unit, pytest.mark.skipif(not cpu_linear.available(torch.device("cpu"), torch.float32),
                                reason="torch built without oneDNN")]

# SmolLM2's shapes (in -> out): qkv, o, gate_up, down, and a tied head; tiny-llama's qkv
SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576), (576, 4096), (64, 192)]


@pytest.fixture(params=["ours", "onednn"])
def float32_kind(request, monkeypatch):
    """Each float32 product: ours (skipped where it cannot be built) and oneDNN's (ours turned off)."""
    if request.param == "ours":
        from executor_svc.attention import cpu_kernel

        avx512 = "avx512f" in cpu_kernel.cpu_signature().split()
        if not avx512 or cpu_kernel.unavailable_reason() is not None:
            pytest.skip("no AVX-512 or no kernel library here: oneDNN's product is used")
        assert cpu_linear.float32_kernel() is not None  # an AVX-512 CPU that can build it uses it
    else:
        monkeypatch.setattr(cpu_linear, "_ours", [None])
    return request.param


@pytest.mark.parametrize("k,n", SHAPES + [(256, 259), (96, 40)])  # (tiny-llama's head: a partial last panel)
def test_rows_equal_torch_and_do_not_depend_on_the_batch(k, n, float32_kind):
    g = torch.Generator().manual_seed(k * n)
    w, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    x = torch.randn(300, k, generator=g)
    lin = cpu_linear.PackedLinear(w, b)
    assert (lin.ops is not None) == (float32_kind == "ours")
    whole = lin(x)
    assert torch.allclose(whole, F.linear(x, w, b), rtol=1e-4, atol=1e-4 * k ** 0.5)
    for m in (1, 2, 3, 7, 11, 16, 17, 33, 64, 129, 300):  # every batch size gives each row the same bits
        assert torch.equal(lin(x[:m]), whole[:m]), m
    assert torch.equal(lin(x[5:6]), whole[5:6])
    assert torch.equal(lin(x[:6].view(2, 3, k)), whole[:6].view(2, 3, n))  # leading dimensions kept
    if float32_kind == "ours":  # the bias is added to each finished chain
        assert torch.equal(cpu_linear.PackedLinear(w, None)(x[:9]) + b, whole[:9])


@pytest.mark.skipif(not cpu_linear.available(torch.device("cpu"), torch.bfloat16),
                    reason="oneDNN has no bfloat16 kernel on this CPU")
@pytest.mark.parametrize("k,n", SHAPES)
def test_bfloat16_rows_match_torch_within_its_rounding(k, n):
    """bfloat16: torch's F.linear within bfloat16 rounding (fp32 accumulation in both), at every batch size,
    a lone row included; the output stays bfloat16."""
    g = torch.Generator().manual_seed(k + n)
    w, b = torch.randn(n, k, generator=g).bfloat16(), torch.randn(n, generator=g).bfloat16()
    x = torch.randn(300, k, generator=g).bfloat16()
    lin = cpu_linear.PackedLinear(w, b)
    exact = F.linear(x.float(), w.float(), b.float())
    for m in (1, 2, 17, 300):
        got = lin(x[:m])
        assert got.dtype == torch.bfloat16 and got.shape == (m, n)
        torch.testing.assert_close(got.float(), exact[:m], rtol=1.6e-2, atol=1e-2 * k ** 0.5)


def test_the_model_packs_its_linears_unless_the_reference_is_asked_for(tiny_llama_dir, monkeypatch):
    from executor_svc.model import load_model
    from executor_svc.model.quant import DenseLinear
    from executor_svc.model_config import ModelConfig

    cfg = ModelConfig.from_dir(tiny_llama_dir)
    packed = load_model(cfg, torch.device("cpu"), torch.float32)
    assert isinstance(packed.layers[0].qkv, cpu_linear.PackedLinear)
    assert isinstance(packed.logits, cpu_linear.PackedLinear)
    monkeypatch.setenv("PAGEDKV_CPU_ATTENTION", "reference")
    plain = load_model(cfg, torch.device("cpu"), torch.float32)
    assert isinstance(plain.layers[0].qkv, DenseLinear) and isinstance(plain.logits, DenseLinear)
    # (a tied head, packed, is a copy held besides the embedding, and counted in what the model holds; our float32
    # panels hold the head's last one padded to 32 rows: tiny-llama's 259-token vocabulary takes 288)
    assert (plain.logits.weight is plain.embed) == cfg.tie_word_embeddings
    extra = plain.embed.numel() * 4 if cfg.tie_word_embeddings else 0
    padding = packed.logits.nbytes() - cfg.vocab_size * cfg.hidden_size * 4
    assert 0 <= padding < 32 * cfg.hidden_size * 4
    assert packed.weight_bytes()["other"] - plain.weight_bytes()["other"] == extra + padding
    assert packed.weight_bytes()["linears"] == plain.weight_bytes()["linears"]
    bf16 = load_model(cfg, torch.device("cpu"), torch.bfloat16)
    bf16_packed = cpu_linear.available(torch.device("cpu"), torch.bfloat16)  # (where oneDNN has bfloat16 here)
    assert isinstance(bf16.layers[0].qkv, cpu_linear.PackedLinear if bf16_packed else DenseLinear)
    half = load_model(cfg, torch.device("cpu"), torch.float16)
    assert isinstance(half.layers[0].qkv, DenseLinear)  # other dtypes keep torch's
