"""4-bit weights: AWQ (GEMM) and GPTQ checkpoints in the tools' format load, stay 4-bit in memory, run on our
4-bit product (float32 models on an AVX-512 CPU) or torch's int4 matmul, and decode greedily exactly as transformers
does on the dequantized fp32 weights.
In-process, tiny models; checkpoints made by pagedkv.tools.quantize.quantize_checkpoint (round-to-nearest).
The packing checked by hand, the bytes held, and our product bit for bit: test_weights_4bit_kernels.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from executor_svc.model import quant
from executor_svc.model_config import ModelConfig
from pagedkv.tools.quantize import quantize_checkpoint
from pagedkv.tools.random_model import build_random_model
from tests.support.hf_reference import hf_greedy, random_prompts
from tests.support.model_helpers import VOCAB, paged_greedy, with_config
from tests.support.weights_4bit import load, needs_own, quantized

pytestmark = pytest.mark.unit

torch.set_num_threads(1)

SMALL = dict(hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4, num_kv_heads=2)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    return build_random_model(tmp_path_factory.mktemp("llama"), seed=11, **SMALL)


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory) -> Path:  # q/k/v biases, tied embeddings
    return build_random_model(tmp_path_factory.mktemp("qwen2"), arch="qwen2", seed=12, **SMALL)


@pytest.fixture(scope="module")
def wide_vocab(tmp_path_factory):
    """The two models above with 264 embedding rows (a multiple of 8, as GPTQ's packed head needs; the byte
    tokenizer uses the first 259)."""
    rows = {"vocab_size": 264}
    return {"llama": build_random_model(tmp_path_factory.mktemp("llama264"), seed=11, config_overrides=rows, **SMALL),
            "qwen2": build_random_model(tmp_path_factory.mktemp("qwen2264"), arch="qwen2", seed=12,
                                        config_overrides=rows, **SMALL)}


@pytest.fixture
def exact(monkeypatch):
    """float32 math over the exactly dequantized weights, so the formats are checked by greedy equality: our 4-bit
    product where it serves (an AVX-512 CPU; the default there), else torch's int4 kernel in the compute dtype (fp32).
    Torch's default (bf16 inside, fast) is checked against a tolerance below."""
    from executor_svc.model import quant

    monkeypatch.setattr(quant, "CPU_KERNEL_DTYPE", None)


# ---- greedy equality with transformers on the dequantized weights ----------------------------------------

CASES = [  # (family, quantize_checkpoint keywords)
    ("llama", dict(method="awq", group_size=128)),
    ("qwen2", dict(method="awq", group_size=32)),
    ("llama", dict(method="gptq", group_size=128, desc_act=False, sym=True)),
    ("llama", dict(method="gptq", group_size=64, desc_act=False, sym=False)),
    ("qwen2", dict(method="gptq", group_size=32, desc_act=True, sym=True)),
    ("llama", dict(method="gptq", group_size=64, desc_act=True, sym=False)),
    ("llama", dict(method="gptq", group_size=128, desc_act=True, sym=False, checkpoint_format="gptq_v2")),
    ("llama", dict(method="gptq", group_size=-1, desc_act=False, sym=True)),
    ("llama", dict(method="gptq", group_size=32, lm_head=True)),  # untied head, 4-bit
    ("qwen2", dict(method="gptq", group_size=64, desc_act=True, lm_head=True)),  # tied: the head's own 4-bit copy
]


@pytest.mark.parametrize("family,kw", CASES, ids=["-".join([c[0]] + [f"{k}={v}" for k, v in c[1].items()])
                                                 for c in CASES])
def test_greedy_equal_to_transformers_on_the_dequantized_weights(family, kw, llama_dir, qwen2_dir, wide_vocab,
                                                                 tmp_path, exact):
    if kw.get("lm_head"):
        src = wide_vocab[family]
    else:
        src = llama_dir if family == "llama" else qwen2_dir
    q, ref = quantized(src, tmp_path, **kw)
    cfg = ModelConfig.from_dir(q)
    assert cfg.quantization.method == kw["method"] and cfg.quantization.group_size == kw["group_size"]
    model = load(q)
    assert set(model.linear_kinds) <= {"int4-cpu", "int4-cpu (unfused: different input orders)"}, model.linear_kinds
    assert isinstance(model.logits, quant.Int4Linear) == kw.get("lm_head", False)
    prompts = random_prompts(5, [4, 19, 40], VOCAB)
    want = hf_greedy(ref, prompts, [10] * len(prompts))
    got = paged_greedy(q, prompts, 10)
    assert got == want
    # the same prompts on the float checkpoint decode differently: the 4-bit weights are what ran
    if kw == CASES[0][1]:
        assert paged_greedy(llama_dir, prompts, 10) != got


def test_exact_kernel_within_1e4_of_the_dequantized_weights(llama_dir, tmp_path, exact):
    """The int4 kernel against the same weights dequantized to fp32: logits within 1e-4 (stated tolerance)."""
    q, ref = quantized(llama_dir, tmp_path, method="gptq", group_size=64, desc_act=True, sym=False)
    x = torch.randn(7, SMALL["hidden_size"])
    m4, mf = load(q), load(ref)
    for key in ("qkv", "o", "gate_up"):
        a, b = getattr(m4.layers[1], key)(x), getattr(mf.layers[1], key)(x)
        assert (a - b).abs().max() <= 1e-4 * max(1.0, b.abs().max().item())
    h = torch.randn(7, SMALL["intermediate_size"])
    assert torch.allclose(m4.layers[0].down(h), mf.layers[0].down(h), atol=1e-4, rtol=1e-4)


# ---- fallback: dequantize at load, and say so --------------------------------------------------------------


def test_a_group_size_the_kernel_lacks_is_dequantized_at_load_and_logged(llama_dir, tmp_path, exact, monkeypatch):
    """torch's kernel lacks group 16 (our product takes any group size: without it, the layer is dequantized)."""
    from structlog.testing import capture_logs

    q, ref = quantized(llama_dir, tmp_path, method="gptq", group_size=16)
    if quant.own_kernel(torch.device("cpu"), torch.float32) is not None:
        assert list(load(q).linear_kinds) == ["int4-cpu"]
    monkeypatch.setattr(quant, "OWN_CPU_KERNEL", False)
    with capture_logs() as logs:
        model = load(q)
    assert list(model.linear_kinds) == ["dequantized (group size 16 or g_idx the kernel cannot take)"]
    event = [e for e in logs if e["event"] == "weights_4bit"]
    assert event and event[0]["log_level"] == "warning" and "dequantized" in event[0]["note"]
    prompts = random_prompts(6, [9, 23], VOCAB)
    assert paged_greedy(q, prompts, 8) == hf_greedy(ref, prompts, [8, 8])


def test_a_kernel_that_fails_its_load_time_check_is_not_used(llama_dir, tmp_path, monkeypatch, exact):
    from executor_svc.model import quant

    monkeypatch.setattr(quant, "_PASSED_SELF_CHECK", set())
    monkeypatch.setattr(quant, "_FAILED_SELF_CHECK", {})
    monkeypatch.setattr(quant.Int4Linear, "__call__", lambda self, x: torch.zeros(x.shape[0], self.out_features))
    q, _ = quantized(llama_dir, tmp_path, method="awq", group_size=128)
    model = load(q)
    assert list(model.linear_kinds) == ["dequantized (the int4-cpu kernel failed its load-time check: relative "
                                        "error 1 > 0.0001)"], model.linear_kinds


# ---- refusals and broken checkpoints -----------------------------------------------------------------------

REFUSALS = [
    ({"quant_method": "gptq", "bits": 8, "group_size": 128}, "quantization_config.bits = 8"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"}, "'marlin'"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "lm_head": True}, "quantization_config.lm_head"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "lm_head": "yes"}, "quantization_config.lm_head"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "dynamic": {"-:.*down": {}}}, "dynamic"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "version = 'gemv'"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": False}, "zero_point = False"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method = 'bitsandbytes'"),
    ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "quant_method = 'fp8'"),
]


@pytest.mark.parametrize("qc,shown", REFUSALS, ids=[r[1] for r in REFUSALS])
def test_other_quantization_configs_are_refused_naming_field_and_value(qc, shown, llama_dir, tmp_path):
    path = with_config(llama_dir, tmp_path / "m", {"quantization_config": qc})
    with pytest.raises(ValueError) as err:
        ModelConfig.from_dir(path)
    assert "quantization_config" in str(err.value) and shown in str(err.value), str(err.value)


def test_a_quantized_config_over_float_weights_names_the_missing_tensors(llama_dir, tmp_path):
    from executor_svc.model import load_model

    path = with_config(llama_dir, tmp_path / "m", {"quantization_config": {"quant_method": "awq", "bits": 4,
                                                                           "group_size": 128, "version": "gemm"}})
    with pytest.raises(ValueError, match=r"missing tensors .*q_proj\.qweight"):
        load_model(ModelConfig.from_dir(path), torch.device("cpu"), torch.float32)


def test_awq_modules_to_not_convert_stay_float(llama_dir, tmp_path, exact):
    """AutoAWQ leaves modules_to_not_convert in float: a checkpoint whose down_proj kept its weight loads."""
    from safetensors.torch import load_file, save_file

    q, ref = quantized(llama_dir, tmp_path, method="awq", group_size=64)
    tensors = load_file(str(q / "model.safetensors"))
    floats = load_file(str(llama_dir / "model.safetensors"))
    reference = load_file(str(ref / "model.safetensors"))
    for i in range(SMALL["num_layers"]):
        m = f"model.layers.{i}.mlp.down_proj"
        for t in ("qweight", "qzeros", "scales"):
            del tensors[f"{m}.{t}"]
        tensors[m + ".weight"] = reference[m + ".weight"] = floats[m + ".weight"]
    save_file(tensors, str(q / "model.safetensors"))
    save_file(reference, str(ref / "model.safetensors"))
    cfg = json.loads((q / "config.json").read_text())
    cfg["quantization_config"]["modules_to_not_convert"] = ["down_proj"]
    (q / "config.json").write_text(json.dumps(cfg))
    model = load(q)
    assert model.linear_kinds == {"int4-cpu": 6, "dense": 2}
    prompts = random_prompts(8, [12, 30], VOCAB)
    assert paged_greedy(q, prompts, 8) == hf_greedy(ref, prompts, [8, 8])


# ---- weight and KV quantization together -------------------------------------------------------------------


def test_awq_weights_with_an_fp8_kv_cache(llama_dir, tmp_path, exact):
    """--kv-cache-dtype fp8_e4m3 over AWQ weights: the same tokens as the dequantized float checkpoint with
    the same fp8 KV cache (the two switches are independent)."""
    q, ref = quantized(llama_dir, tmp_path, method="awq", group_size=128)
    prompts = random_prompts(9, [7, 33], VOCAB)
    got = paged_greedy(q, prompts, 10, kv_dtype="fp8_e4m3")
    assert got == paged_greedy(ref, prompts, 10, kv_dtype="fp8_e4m3")
    assert len(got[0]) == len(got[1]) == 10


# ---- the default CPU kernel: bf16 inside the 4-bit linears ------------------------------------------------


def test_default_cpu_kernel_runs_bf16_within_the_stated_tolerance(llama_dir, tmp_path, monkeypatch):
    """Without our product (a CPU without AVX-512), the CPU int4 matmul takes bf16 activations and scales by default
    (its only vectorized path): each linear within 2% (relative to its largest output) of the dequantized fp32
    weights, and greedy decoding equal to transformers on the dequantized fp32 weights for at least 4 of 6 prompts
    (random tiny models have near-ties: about one prompt in five flips a token within 10 steps)."""
    from executor_svc.model import quant

    monkeypatch.setattr(quant, "OWN_CPU_KERNEL", False)
    assert quant.CPU_KERNEL_DTYPE == torch.bfloat16
    q, ref = quantized(llama_dir, tmp_path, method="gptq", group_size=128, desc_act=True, sym=False)
    m4, mf = load(q), load(ref)
    assert m4.layers[0].o.kernel_dtype == torch.bfloat16
    x = torch.randn(7, SMALL["hidden_size"])
    for key in ("qkv", "o", "gate_up"):
        a, b = getattr(m4.layers[1], key)(x), getattr(mf.layers[1], key)(x)
        assert a.dtype == torch.float32
        assert 1e-5 < (a - b).abs().max() <= 2e-2 * b.abs().max()  # not exact (bf16), but close
    prompts = random_prompts(5, [4, 19, 40, 25, 60, 11], VOCAB)
    want = hf_greedy(ref, prompts, [10] * len(prompts))
    got = paged_greedy(q, prompts, 10)
    assert sum(g == w for g, w in zip(got, want)) >= 4, (got, want)


# ---- our 4-bit product (executor_svc/model/cpu_gemm.cpp, linear_int4) ---------------------------------------


@needs_own
def test_a_float32_model_runs_our_product_and_decodes_as_transformers(llama_dir, tmp_path):
    """By default a float32 model's 4-bit linears take our product (float32 activations, the exact dequantized
    weights): greedy decoding equal to transformers on the dequantized weights for every prompt."""
    q, ref = quantized(llama_dir, tmp_path, method="gptq", group_size=64, desc_act=False, sym=False)
    model = load(q)
    assert all(getattr(lw, key).ours is not None for lw in model.layers for key in ("qkv", "o", "gate_up", "down"))
    prompts = random_prompts(5, [4, 19, 40, 25, 60, 11], VOCAB)
    assert paged_greedy(q, prompts, 10) == hf_greedy(ref, prompts, [10] * len(prompts))


def test_the_tool_quantizes_a_head_only_where_gptq_can_hold_it(llama_dir, wide_vocab, tmp_path):
    """A 4-bit head: GPTQ only, a vocabulary in whole words of packed zeros; the float embedding stays for lookups,
    and the head's bytes are ~4.5 bits a weight."""
    with pytest.raises(ValueError, match="multiple of 8"):
        quantize_checkpoint(llama_dir, tmp_path / "a", method="gptq", lm_head=True)
    with pytest.raises(ValueError, match="only GPTQ"):
        quantize_checkpoint(wide_vocab["llama"], tmp_path / "b", method="awq", lm_head=True)
    plain = load(quantize_checkpoint(wide_vocab["qwen2"], tmp_path / "c", method="gptq", group_size=32))
    head = load(quantize_checkpoint(wide_vocab["qwen2"], tmp_path / "d", method="gptq", group_size=32, lm_head=True))
    assert torch.equal(head.embed, plain.embed)  # the lookup table is the float one either way
    float_head = 264 * SMALL["hidden_size"] * 4
    assert head.weight_bytes()["other"] - (plain.weight_bytes()["other"] - float_head) < 0.2 * float_head
