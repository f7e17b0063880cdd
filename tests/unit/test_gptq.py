"""GPTQ in pagedkv.tools.gptq: with no correlation between inputs it is round-to-nearest bit for bit; with
correlated inputs its layer output error on them is below round-to-nearest's; a calibrated checkpoint loads and
decodes greedily exactly as transformers does on its dequantized weights; bad calibration is refused."""

from __future__ import annotations

import pytest
import torch

from pagedkv.tools import gptq
from pagedkv.tools.quantize import _round_to_nearest, quantize_checkpoint
from pagedkv.tools.random_model import build_random_model
from tests.support.hf_reference import hf_greedy, random_prompts
from tests.support.model_helpers import VOCAB, paged_greedy

pytestmark = pytest.mark.unit

torch.set_num_threads(1)


def dequantized(q, zeros, scales, g_idx) -> torch.Tensor:
    return (q - zeros[g_idx].T).double() * scales.double()[g_idx].T


@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("group", [32, 64, -1])
def test_uncorrelated_inputs_give_round_to_nearest(sym, group) -> None:
    w = torch.randn(48, 256, generator=torch.Generator().manual_seed(3)) * 0.05
    got = gptq.quantize(w, torch.eye(256) * 4.0, group, sym)
    want = _round_to_nearest(w, "gptq", group, False, sym, torch.Generator())
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("k", [96, 256])
def test_correlated_inputs_lower_the_output_error(sym, k) -> None:
    g = torch.Generator().manual_seed(k + sym)
    x = torch.randn(2048, k, generator=g, dtype=torch.float64) @ torch.randn(k, k, generator=g, dtype=torch.float64)
    x[:, 5] *= 8.0  # one large channel, as real activations have
    w = torch.randn(64, k, generator=g) * 0.02
    h = 2 * x.T @ x / x.shape[0]
    exact = x @ w.double().T
    err_gptq = (x @ dequantized(*gptq.quantize(w, h, 32, sym)).T - exact).square().mean()
    err_rtn = (x @ dequantized(*_round_to_nearest(w, "gptq", 32, False, sym, g)).T - exact).square().mean()
    assert err_gptq < 0.7 * err_rtn, (float(err_gptq), float(err_rtn))
    q, zeros, _, g_idx = gptq.quantize(w, h, 32, sym)
    assert q.min() >= 0 and q.max() <= 15 and zeros.min() >= 1 and zeros.max() <= 15
    assert torch.equal(g_idx, torch.arange(k) // 32)


def test_a_calibrated_checkpoint_decodes_as_transformers_on_its_weights(tmp_path, monkeypatch) -> None:
    from executor_svc.model import quant

    monkeypatch.setattr(quant, "CPU_KERNEL_DTYPE", None)  # float32 math over the exact weights (greedy equality)
    src = build_random_model(tmp_path / "src", seed=5, hidden_size=128, intermediate_size=256, num_layers=2,
                             num_heads=4, num_kv_heads=2, config_overrides={"vocab_size": 264})
    calib = random_prompts(8, [64], VOCAB)
    rtn = quantize_checkpoint(src, tmp_path / "rtn", group_size=32, sym=False, reference_dir=tmp_path / "rtn_ref")
    q = quantize_checkpoint(src, tmp_path / "q", group_size=32, sym=False, lm_head=True, calibration=calib,
                            reference_dir=tmp_path / "ref")
    prompts = random_prompts(4, [6, 30], VOCAB)
    assert paged_greedy(q, prompts, 8) == hf_greedy(tmp_path / "ref", prompts, [8] * len(prompts))
    # what ran is GPTQ's choice, not round-to-nearest's
    from safetensors.torch import load_file

    name = "model.layers.0.mlp.down_proj.weight"
    a, b = (load_file(str(tmp_path / d / "model.safetensors"))[name] for d in ("ref", "rtn_ref"))
    assert not torch.equal(a, b) and rtn.is_dir()


@pytest.mark.parametrize(("kw", "names"), [
    (dict(method="awq"), "GPTQ without desc_act only"),
    (dict(desc_act=True), "GPTQ without desc_act only"),
    (dict(calibration=[[]]), "none of them empty"),
    (dict(calibration=[]), "at least one sequence"),
])
def test_bad_calibration_is_refused(tmp_path, kw, names) -> None:
    src = build_random_model(tmp_path / "src", seed=5, hidden_size=64, intermediate_size=128, num_layers=1,
                             num_heads=2, num_kv_heads=1)
    kw = {"calibration": [[1, 2, 3]], **kw}
    with pytest.raises(ValueError, match=names):
        quantize_checkpoint(src, tmp_path / "q", **kw)
