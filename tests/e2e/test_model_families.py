"""Model families beyond Llama: Qwen3 (an RMSNorm over each q/k head before rope, explicit head_dim), Phi-3
(fused qkv_proj and gate_up_proj, a window on every layer), Gemma 2 and Gemma 3 text (alternating local and
global layers, (1 + w) sandwich norms, scaled embeddings, query_pre_attn_scalar, soft-capping), Mixtral,
Qwen2-MoE and Qwen3-MoE (top-k routed experts, Qwen2-MoE's gated shared expert), Qwen2 with per-layer
windows, next to Llama, Qwen2 and Mistral. Each is greedy
token-exact against transformers (eager, fp32) on a small random checkpoint at block size 16, served by the
real Scheduler and ModelRunner in one process (tests/support/inprocess.py) through a prefix-cache hit and a
preemption, both counted so the test cannot pass without them. What is not implemented is refused by name.
The 4-bit weights, 8-bit KV pages, soft-capped log-probabilities, per-layer windows under a page budget and the
executor's own start-up of these families: test_model_families_runner.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from executor_svc.model_config import ModelConfig
from pagedkv.tools.random_model import build_random_model
from tests.support.hf_reference import hf_greedy, random_prompts
from tests.support.inprocess import InProcessServer
from tests.support.model_helpers import SMALL, VOCAB, with_config

pytestmark = pytest.mark.e2e  # in-process (InProcessServer), but about 11 s here: over the unit budget

torch.set_num_threads(1)

MAX_NEW = 24
GEMMA3_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
               "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0}}
# id -> (arch, build_random_model keywords, what ModelConfig must read from config.json)
FAMILIES = {
    "llama": ("llama", {}, {"family": "llama", "head_dim": 16}),
    "qwen2": ("qwen2", {}, {"family": "qwen2", "attention_bias": True, "o_proj_bias": False}),
    # Qwen2.5 with its window on the layers from max_window_layers up (layer 1 of 2)
    "qwen2-windows": ("qwen2", {"config_overrides": {"use_sliding_window": True, "sliding_window": 12,
                                                    "max_window_layers": 1}},
                      {"family": "qwen2", "layer_windows": (0, 12), "sliding_window": None}),
    "mistral": ("mistral", {"sliding_window": 24}, {"family": "mistral", "sliding_window": 24}),
    # head_dim 32 while hidden_size / heads is 16; q/k/v/o biases
    "qwen3": ("qwen3", {"config_overrides": {"head_dim": 32, "attention_bias": True}},
              {"family": "qwen3", "qk_norm": True, "head_dim": 32, "attention_bias": True, "o_proj_bias": True}),
    "phi3": ("phi3", {"sliding_window": 24, "config_overrides": {"hidden_act": "gelu_pytorch_tanh"}},
             {"family": "phi3", "fused_projections": True, "sliding_window": 24, "head_dim": 16,
              "hidden_act": "gelu_pytorch_tanh"}),
    # (1 + w) norms, embeddings x sqrt(hidden), q/k/v/o biases, head_dim 32 != hidden / heads
    "gemma": ("gemma", {"tie_word_embeddings": False, "config_overrides": {"attention_bias": True, "head_dim": 32}},
              {"family": "gemma", "gemma": True, "sandwich_norms": False, "attention_bias": True, "o_proj_bias": True,
               "head_dim": 32, "attn_scale": 32 ** -0.5, "hidden_act": "gelu_pytorch_tanh"}),
    # local (window 12) then global layer; caps small enough that tanh bends; scale 24 ** -0.5, not 16 ** -0.5.
    # Untied: with tied embeddings scaled by sqrt(hidden) a random model only repeats its input token.
    "gemma2": ("gemma2", {"sliding_window": 12, "tie_word_embeddings": False, "config_overrides": {
        "attn_logit_softcapping": 3.0, "final_logit_softcapping": 5.0, "query_pre_attn_scalar": 24}},
        {"family": "gemma2", "gemma": True, "sandwich_norms": True, "layer_windows": (12, 0), "attn_softcap": 3.0,
         "final_softcap": 5.0,
         "attn_scale": 24 ** -0.5, "hidden_act": "gelu_pytorch_tanh", "sliding_window": None}),
    # q/k (1 + w) norms; a rope table per layer type (linear scaling on the global one, as Gemma 3 4B+)
    "gemma3": ("gemma3", {"sliding_window": 12, "tie_word_embeddings": False, "config_overrides": {
        "layer_types": ["sliding_attention", "full_attention"], "rope_parameters": GEMMA3_ROPE,
        "query_pre_attn_scalar": 24}},
        {"family": "gemma3_text", "gemma": True, "qk_norm": True, "layer_windows": (12, 0),
         "layer_types": ("sliding_attention", "full_attention"), "attn_softcap": None}),
    # Gemma 3 4B+ are multimodal checkpoints: their language model served text-only, the vision tower not loaded
    "gemma3-multimodal": ("gemma3_multimodal", {"sliding_window": 12, "tie_word_embeddings": False,
                                                "config_overrides": {"layer_types": ["sliding_attention",
                                                                                     "full_attention"]}},
                          {"family": "gemma3_text", "language_model_only": True, "layer_windows": (12, 0),
                           "architecture": "Gemma3ForConditionalGeneration", "tie_word_embeddings": False}),
    # 4 experts, top-2, renormalized; a window on every layer (seed 41 ends one prompt at eos after 3 tokens)
    "mixtral": ("mixtral", {"sliding_window": 24, "seed": 42}, {"family": "mixtral", "sliding_window": 24}),
    # shared expert with its sigmoid gate; layer 1 a dense MLP (mlp_only_layers); top-2 not renormalized
    "qwen2_moe": ("qwen2_moe", {"config_overrides": {"mlp_only_layers": [1], "norm_topk_prob": False}},
                  {"family": "qwen2_moe", "attention_bias": True}),
    "qwen3_moe": ("qwen3_moe", {"config_overrides": {"norm_topk_prob": True, "num_experts_per_tok": 3}},
                  {"family": "qwen3_moe", "qk_norm": True}),
}
MOE_SPECS = {  # id -> what ModelConfig.moe must hold (num_experts, top_k, normalize, shared_size, sparse_layers)
    "mixtral": (4, 2, True, 0, (True, True)),
    "qwen2_moe": (4, 2, False, 128, (True, False)),
    "qwen3_moe": (4, 3, True, 0, (True, True)),
}


@pytest.mark.parametrize("family_id", list(FAMILIES))
def test_greedy_equal_to_transformers_through_a_prefix_hit_and_a_preemption(family_id, tmp_path):
    """Wave 1 computes a 40-token prompt; wave 2 brings a prompt sharing its first 36 tokens (two full pages
    come from the prefix cache) and two others into a 9-page pool, too small for all three to finish without
    a recompute preemption. Every output equals transformers' one-prompt-at-a-time greedy decoding."""
    arch, kw, reads = FAMILIES[family_id]
    path = build_random_model(tmp_path / arch, arch=arch, **dict(dict(SMALL, seed=41), **kw))
    cfg = ModelConfig.from_dir(path)
    assert {k: getattr(cfg, k) for k in reads} == reads
    if family_id in MOE_SPECS:
        m = cfg.moe
        assert (m.num_experts, m.top_k, m.normalize, m.shared_size, m.sparse_layers) == MOE_SPECS[family_id]
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
    ("qwen3", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e6}}, (),
     ["rope_type", "'dynamic'"]),
    # Gemma: an activation, a rope table of one layer type, an attention type, a multimodal checkpoint
    ("gemma2", {"hidden_activation": "gelu_new"}, (), ["hidden_activation = 'gelu_new'"]),
    ("gemma3", {"rope_parameters": {"full_attention": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e6},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}, (),
     ["rope_parameters['full_attention'].rope_type", "'dynamic'"]),
    ("gemma3", {"layer_types": ["sliding_attention", "chunked_attention"]}, (), ["layer_types", "chunked_attention"]),
    # a flat config under the multimodal model_type; a multimodal checkpoint of another class
    ("gemma3", {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"]}, (),
     ["model_type 'gemma3' needs text_config"]),
    ("gemma3_multimodal", {"architectures": ["PaliGemmaForConditionalGeneration"]}, (),
     ["architectures", "Gemma3ForConditionalGeneration"]),
    ("gemma3_multimodal", {"text_config": {"model_type": "gemma2"}}, (), ["text_config.model_type = 'gemma2'"]),
    # MoE: another family's fields, a top-k past the experts
    ("mixtral", {"shared_expert_intermediate_size": 64}, (), ["shared_expert_intermediate_size = 64", "qwen2_moe"]),
    ("mixtral", {"num_experts_per_tok": 5}, (), ["num_experts_per_tok = 5", "[1, 4]"]),
    ("qwen3", {"num_experts": 4}, (), ["num_experts = 4", "mixtral"]),
    ("qwen2", {"attn_logit_softcapping": 50.0}, (), ["attn_logit_softcapping = 50.0", "gemma2"]),
]


@pytest.fixture(scope="module")
def gemma2_dir(tmp_path_factory) -> Path:
    return build_random_model(tmp_path_factory.mktemp("gemma2"), arch="gemma2", seed=4, **SMALL)


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory) -> Path:
    return build_random_model(tmp_path_factory.mktemp("gemma3"), arch="gemma3", seed=4, **SMALL)


@pytest.fixture(scope="module")
def gemma3_multimodal_dir(tmp_path_factory) -> Path:
    return build_random_model(tmp_path_factory.mktemp("gemma3mm"), arch="gemma3_multimodal", seed=4, **SMALL)


@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory) -> Path:
    return build_random_model(tmp_path_factory.mktemp("mixtral"), arch="mixtral", seed=4, **SMALL)


@pytest.mark.parametrize("base,changes,drop,shown", REFUSALS, ids=[f"{c[0]}-{i}" for i, c in enumerate(REFUSALS)])
def test_unimplemented_fields_stop_start_up(base, changes, drop, shown, request, tmp_path):
    src = request.getfixturevalue(f"{base}_dir") if base != "qwen2" else build_random_model(
        tmp_path / "src", arch="qwen2", seed=4, **SMALL)
    path = with_config(src, tmp_path / "m", changes, drop=drop)
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


def test_gemma_legacy_gelu_runs_the_tanh_approximation(tmp_path):
    """Gemma 1's released config.json says hidden_act "gelu" (and hidden_activation "gelu_pytorch_tanh"):
    transformers runs the tanh approximation, and so does pagedkv."""
    src = build_random_model(tmp_path / "src", arch="gemma", seed=4, **SMALL)
    path = with_config(src, tmp_path / "m", {"hidden_act": "gelu", "hidden_activation": "gelu_pytorch_tanh"})
    cfg = ModelConfig.from_dir(path)
    assert cfg.hidden_act == "gelu_pytorch_tanh" and cfg.gemma and not cfg.sandwich_norms


# config.json of released checkpoints (as published; only the fields, no weights: ModelConfig reads no tensors)
RELEASED = {
    "gemma-2-2b-it": {
        "architectures": ["Gemma2ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "attn_logit_softcapping": 50.0, "bos_token_id": 2, "cache_implementation": "hybrid", "eos_token_id": [1, 107],
        "final_logit_softcapping": 30.0, "head_dim": 256, "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 2304, "initializer_range": 0.02,
        "intermediate_size": 9216, "max_position_embeddings": 8192, "model_type": "gemma2", "num_attention_heads": 8,
        "num_hidden_layers": 26, "num_key_value_heads": 4, "pad_token_id": 0, "query_pre_attn_scalar": 256,
        "rms_norm_eps": 1e-06, "rope_theta": 10000.0, "sliding_window": 4096, "torch_dtype": "float32",
        "transformers_version": "4.42.4", "use_cache": True, "vocab_size": 256000},
    "gemma-3-1b-it": {
        "architectures": ["Gemma3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "attn_logit_softcapping": None, "bos_token_id": 2, "cache_implementation": "hybrid", "eos_token_id": [1, 106],
        "final_logit_softcapping": None, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": 1152, "initializer_range": 0.02, "intermediate_size": 6912, "max_position_embeddings": 32768,
        "model_type": "gemma3_text", "num_attention_heads": 4, "num_hidden_layers": 26, "num_key_value_heads": 1,
        "pad_token_id": 0, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000,
        "rope_scaling": None, "rope_theta": 1000000, "sliding_window": 512, "sliding_window_pattern": 6,
        "torch_dtype": "bfloat16", "transformers_version": "4.50.0.dev0", "use_cache": True, "vocab_size": 262144},
    "gemma-3-4b-it": {
        "architectures": ["Gemma3ForConditionalGeneration"], "boi_token_index": 255999, "eoi_token_index": 256000,
        "eos_token_id": [1, 106], "image_token_index": 262144, "initializer_range": 0.02, "mm_tokens_per_image": 256,
        "model_type": "gemma3", "text_config": {
            "hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text", "num_hidden_layers": 34,
            "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024},
        "torch_dtype": "bfloat16", "transformers_version": "4.50.0.dev0", "vision_config": {
            "hidden_size": 1152, "image_size": 896, "intermediate_size": 4304, "model_type": "siglip_vision_model",
            "num_attention_heads": 16, "num_hidden_layers": 27, "patch_size": 14, "vision_use_head": False}},
    "gemma-7b": {
        "architectures": ["GemmaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 2,
        "eos_token_id": 1, "head_dim": 256, "hidden_act": "gelu", "hidden_activation": None, "hidden_size": 3072,
        "initializer_range": 0.02, "intermediate_size": 24576, "max_position_embeddings": 8192,
        "model_type": "gemma", "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 16,
        "pad_token_id": 0, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 10000.0,
        "torch_dtype": "bfloat16", "transformers_version": "4.38.0.dev0", "use_cache": True, "vocab_size": 256000},
    "Mixtral-8x7B-Instruct-v0.1": {
        "architectures": ["MixtralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2,
        "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
        "max_position_embeddings": 32768, "model_type": "mixtral", "num_attention_heads": 32,
        "num_experts_per_tok": 2, "num_hidden_layers": 32, "num_key_value_heads": 8, "num_local_experts": 8,
        "output_router_logits": False, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.02,
        "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "transformers_version": "4.36.0.dev0", "use_cache": True, "vocab_size": 32000},
    "Qwen1.5-MoE-A2.7B": {
        "architectures": ["Qwen2MoeForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
        "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
        "intermediate_size": 5632, "max_position_embeddings": 8192, "max_window_layers": 21,
        "model_type": "qwen2_moe", "num_attention_heads": 16, "num_hidden_layers": 24, "num_key_value_heads": 16,
        "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "transformers_version": "4.36.0.dev0", "use_cache": True,
        "use_sliding_window": False, "vocab_size": 151936, "decoder_sparse_step": 1, "moe_intermediate_size": 1408,
        "shared_expert_intermediate_size": 5632, "num_experts_per_tok": 4, "num_experts": 60, "norm_topk_prob": False,
        "output_router_logits": False, "router_aux_loss_coef": 0.001},
    "Qwen3-30B-A3B": {
        "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128,
        "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144,
        "max_position_embeddings": 40960, "max_window_layers": 48, "mlp_only_layers": [], "model_type": "qwen3_moe",
        "moe_intermediate_size": 768, "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128,
        "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4, "output_router_logits": False,
        "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001,
        "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936},
}
GEMMA3_1B_WINDOWS = tuple(0 if (i + 1) % 6 == 0 else 512 for i in range(26))
# name -> (what ModelConfig reads, (num_experts, top_k, normalize, expert_size, shared_size) or None, unknown fields)
RELEASED_READS = {
    "gemma-2-2b-it": ({"family": "gemma2", "layer_windows": (4096, 0) * 13, "attn_softcap": 50.0,
                       "final_softcap": 30.0, "attn_scale": 256 ** -0.5, "eos_token_ids": (1, 107),
                       "tie_word_embeddings": True, "hidden_act": "gelu_pytorch_tanh"}, None, ()),
    "gemma-3-1b-it": ({"family": "gemma3_text", "layer_windows": GEMMA3_1B_WINDOWS, "attn_softcap": None,
                       "qk_norm": True, "num_kv_heads": 1, "eos_token_ids": (1, 106)}, None, ()),
    "gemma-3-4b-it": ({"family": "gemma3_text", "architecture": "Gemma3ForConditionalGeneration",
                       "language_model_only": True, "tie_word_embeddings": True, "eos_token_ids": (1, 106),
                       "layer_windows": tuple(0 if (i + 1) % 6 == 0 else 1024 for i in range(34)),
                       "attn_scale": 256 ** -0.5, "num_kv_heads": 4}, None, ()),
    "gemma-7b": ({"family": "gemma", "hidden_act": "gelu_pytorch_tanh", "sandwich_norms": False,
                  "attn_scale": 256 ** -0.5}, None, ()),
    "Mixtral-8x7B-Instruct-v0.1": ({"family": "mixtral", "sliding_window": None}, (8, 2, True, 14336, 0), ()),
    "Qwen1.5-MoE-A2.7B": ({"family": "qwen2_moe", "layer_windows": (), "attention_bias": True},
                          (60, 4, False, 1408, 5632), ()),
    "Qwen3-30B-A3B": ({"family": "qwen3_moe", "qk_norm": True, "head_dim": 128, "sliding_window": None},
                      (128, 8, True, 768, 0), ()),
}


@pytest.mark.parametrize("name", list(RELEASED))
def test_released_config_files_are_read_not_refused(name, tmp_path):
    """Every field of these released config.json files is served or known irrelevant; nothing is refused."""
    (tmp_path / "config.json").write_text(json.dumps(RELEASED[name]))
    cfg = ModelConfig.from_dir(tmp_path)
    reads, moe, unknown = RELEASED_READS[name]
    assert {k: getattr(cfg, k) for k in reads} == reads
    assert cfg.unknown_fields == unknown
    if moe is None:
        assert cfg.moe is None
    else:
        m = cfg.moe
        assert (m.num_experts, m.top_k, m.normalize, m.expert_size, m.shared_size) == moe
        assert all(m.sparse_layers) and len(m.sparse_layers) == cfg.num_layers
