"""Model families beyond Llama: Qwen3 (an RMSNorm over each q/k head before rope, explicit head_dim) and Phi-3
(fused qkv_proj and gate_up_proj, a window on every layer), next to Llama, Qwen2 and Mistral. Each is greedy
token-exact against transformers (eager, fp32) on a small random checkpoint at block size 16, served by the
real Scheduler and ModelRunner in one process (tests/inprocess.py) through a prefix-cache hit and a
preemption, both counted so the test cannot pass without them. What is not implemented is refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from executor_svc.model_config import ModelConfig
from pagedkv.models import build_random_model
from tests.hf_reference import hf_greedy, random_prompts
from tests.inprocess import InProcessServer
from tests.test_model_config import SMALL, VOCAB, with_config

torch.set_num_threads(1)

MAX_NEW = 24
FAMILIES = {  # arch -> (build_random_model keywords, what ModelConfig must read from config.json)
    "llama": ({}, {"family": "llama", "head_dim": 16}),
    "qwen2": ({}, {"family": "qwen2", "attention_bias": True, "o_proj_bias": False}),
    "mistral": ({"sliding_window": 24}, {"family": "mistral", "sliding_window": 24}),
    # head_dim 32 while hidden_size / heads is 16; q/k/v/o biases
    "qwen3": ({"config_overrides": {"head_dim": 32, "attention_bias": True}},
              {"family": "qwen3", "qk_norm": True, "head_dim": 32, "attention_bias": True, "o_proj_bias": True}),
    "phi3": ({"sliding_window": 24, "config_overrides": {"hidden_act": "gelu_pytorch_tanh"}},
             {"family": "phi3", "fused_projections": True, "sliding_window": 24, "head_dim": 16,
              "hidden_act": "gelu_pytorch_tanh"}),
}


@pytest.mark.parametrize("arch", list(FAMILIES))
def test_greedy_equal_to_transformers_through_a_prefix_hit_and_a_preemption(arch, tmp_path):
    """Wave 1 computes a 40-token prompt; wave 2 brings a prompt sharing its first 36 tokens (two full pages
    come from the prefix cache) and two others into a 9-page pool, too small for all three to finish without
    a recompute preemption. Every output equals transformers' one-prompt-at-a-time greedy decoding."""
    kw, reads = FAMILIES[arch]
    path = build_random_model(tmp_path / arch, arch=arch, seed=41, **SMALL, **kw)
    cfg = ModelConfig.from_dir(path)
    assert {k: getattr(cfg, k) for k in reads} == reads
    assert cfg.unknown_fields == ()
    base = random_prompts(5, [40], VOCAB)[0]
    second = [base[:36] + random_prompts(6, [9], VOCAB)[0][1:]] + random_prompts(7, [23, 30], VOCAB)
    want = hf_greedy(path, [base] + second, [MAX_NEW] * 4)

    server = InProcessServer(path, num_pages=9)
    first = server.generate([base], [MAX_NEW])
    rest = server.generate(second, [MAX_NEW] * 3)
    assert [r.output_ids for r in first + rest] == want
    assert rest[0].num_cached_tokens == 32  # the prefix hit: two full pages of wave 1
    assert server.scheduler.counters.recompute_preemptions >= 1  # the preemption
    assert any(r.num_preemptions for r in rest)


def test_qwen3_needs_its_head_norms_and_phi3_its_fused_tensors(tmp_path):
    """A Llama checkpoint relabelled Qwen3 lacks q_norm/k_norm; relabelled Phi-3 it lacks qkv_proj and
    gate_up_proj: both are refused by tensor name, never run without them."""
    from executor_svc.model import load_model

    src = build_random_model(tmp_path / "src", seed=5, **SMALL)
    cases = {"qwen3": "model.layers.0.self_attn.q_norm.weight", "phi3": "model.layers.0.self_attn.qkv_proj.weight"}
    for family, tensor in cases.items():
        arch = {"qwen3": "Qwen3ForCausalLM", "phi3": "Phi3ForCausalLM"}[family]
        path = with_config(src, tmp_path / family, {"model_type": family, "architectures": [arch], "head_dim": 16})
        with pytest.raises(ValueError, match=r"missing tensors \[.*" + tensor.replace(".", r"\.")):
            load_model(ModelConfig.from_dir(path), torch.device("cpu"), torch.float32)


@pytest.fixture(scope="module")
def phi3_dir(tmp_path_factory) -> Path:
    return build_random_model(tmp_path_factory.mktemp("phi3"), arch="phi3", seed=4, **SMALL)


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory) -> Path:
    return build_random_model(tmp_path_factory.mktemp("qwen3"), arch="qwen3", seed=4, **SMALL)


LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}

# (base, config changes, dropped fields, text the error must show: the field and its value)
REFUSALS = [
    # Phi-3-mini-128k style: longrope tables change with the sequence length
    ("phi3", {"rope_scaling": LONGROPE, "original_max_position_embeddings": 512}, ("rope_parameters",),
     ["rope_type", "'longrope'"]),
    # Phi-4-mini style: rotary embedding over part of each head
    ("phi3", {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75}},
     (), ["partial_rotary_factor", "0.75"]),
    ("phi3", {"architectures": ["Phi3ForSequenceClassification"]}, (), ["architectures", "Phi3ForSequence"]),
    # Qwen3 with windows on its upper layers (as transformers derives layer_types from max_window_layers)
    ("qwen3", {"use_sliding_window": True, "sliding_window": 32, "max_window_layers": 1, "layer_types": None}, (),
     ["layer_types", "use_sliding_window = True"]),
    ("qwen3", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e6}}, (),
     ["rope_type", "'dynamic'"]),
]


@pytest.mark.parametrize("base,changes,drop,shown", REFUSALS, ids=[f"{c[0]}-{i}" for i, c in enumerate(REFUSALS)])
def test_unimplemented_fields_stop_start_up(base, changes, drop, shown, phi3_dir, qwen3_dir, tmp_path):
    path = with_config(phi3_dir if base == "phi3" else qwen3_dir, tmp_path / "m", changes, drop=drop)
    with pytest.raises(ValueError) as err:
        ModelConfig.from_dir(path)
    assert all(text in str(err.value) for text in shown), str(err.value)


def test_qwen3_window_on_no_layer_and_phi3_defaults_are_served(phi3_dir, qwen3_dir, tmp_path):
    """use_sliding_window whose window reaches no layer, and Phi-3's own config.json fields (dropouts,
    original_max_position_embeddings, default rope with partial_rotary_factor 1) are accepted."""
    q = ModelConfig.from_dir(with_config(qwen3_dir, tmp_path / "q", {
        "use_sliding_window": True, "sliding_window": 32, "max_window_layers": 2, "layer_types": None}))
    assert q.sliding_window is None and q.qk_norm
    raw = json.loads((phi3_dir / "config.json").read_text())
    assert {"resid_pdrop", "embd_pdrop", "original_max_position_embeddings"} <= set(raw)
    p = ModelConfig.from_dir(with_config(phi3_dir, tmp_path / "p", {"resid_pdrop": 0.1, "embd_pdrop": 0.1}))
    assert p.fused_projections and p.unknown_fields == ()


@pytest.mark.parametrize("arch,kw", [
    ("phi3", dict(method="awq", group_size=32)),
    ("phi3", dict(method="gptq", group_size=64, desc_act=True, sym=False)),
    ("qwen3", dict(method="gptq", group_size=32, desc_act=False, sym=True)),
], ids=["phi3-awq", "phi3-gptq-desc_act", "qwen3-gptq"])
def test_four_bit_weights_equal_to_transformers_on_the_dequantized_weights(arch, kw, tmp_path, monkeypatch):
    """Phi-3's fused qkv_proj and gate_up_proj quantized whole (as AutoAWQ/AutoGPTQ store them) and Qwen3's
    linears load 4-bit; the int4 kernel in fp32 equals transformers on the dequantized float weights."""
    from executor_svc.model import load_model, quant
    from pagedkv.models import quantize_checkpoint
    from tests.test_model_config import paged_greedy

    monkeypatch.setattr(quant, "CPU_KERNEL_DTYPE", None)  # bit-for-bit the dequantized weights' math
    src = build_random_model(tmp_path / "src", arch=arch, seed=12, hidden_size=128, intermediate_size=256,
                             num_layers=2, num_heads=4, num_kv_heads=2)
    q = quantize_checkpoint(src, tmp_path / "q", reference_dir=tmp_path / "ref", **kw)
    model = load_model(ModelConfig.from_dir(q), torch.device("cpu"), torch.float32)
    assert set(model.linear_kinds) <= {"int4-cpu", "int4-cpu (unfused: different input orders)"}, model.linear_kinds
    assert sum(model.linear_kinds.values()) == 4 * 2  # qkv, o, gate_up, down in each layer: all 4-bit
    prompts = random_prompts(5, [4, 19, 40], VOCAB)
    want = hf_greedy(tmp_path / "ref", prompts, [10] * len(prompts))
    assert paged_greedy(q, prompts, 10) == want


@pytest.mark.parametrize("arch,kw", [
    ("qwen3", dict(tie_word_embeddings=True, num_kv_heads=1)),  # as Qwen3-0.6B/1.7B/4B: tied head
    ("phi3", dict(tie_word_embeddings=False, config_overrides={"rms_norm_eps": 0.05})),  # no window
], ids=["qwen3-tied-mqa", "phi3-no-window-eps"])
def test_more_family_fields_greedy_equal_to_transformers(arch, kw, tmp_path):
    from tests.test_model_config import assert_greedy_equal

    path = build_random_model(tmp_path / "m", arch=arch, seed=21, **dict(SMALL, **kw))
    cfg = ModelConfig.from_dir(path)
    assert cfg.tie_word_embeddings == kw["tie_word_embeddings"] and cfg.sliding_window is None
    assert_greedy_equal(path)
