"""Which config.json fields pagedkv honours and which it refuses: the families, the field table, the check.

Every field of the supported families' configs (transformers' LlamaConfig, MistralConfig, Qwen2Config,
Qwen3Config, Phi3Config, GemmaConfig, Gemma2Config, Gemma3TextConfig, MixtralConfig, Qwen2MoeConfig,
Qwen3MoeConfig) is
classified in FIELDS below: ``handled`` (the model code implements it; where it changes the math a test
compares with transformers), ``refused`` (start-up stops with a ValueError naming the field and its value
whenever it is set to anything but its "off" value), or ``irrelevant`` (it does not change inference math;
the reason is given). tests/unit/test_model_config.py walks transformers' config classes and fails on a field
that is in none of the three, so a new transformers field has to be classified before it is silently
ignored. Some handled fields accept only some values (check_fields below); others are refused.

A field in a checkpoint's config.json that no supported family defines is ignored by transformers too (its
code for these families never reads it), so ignoring it keeps pagedkv equal to transformers; such fields are
listed in ``ModelConfig.unknown_fields`` and logged at start-up. Fields that change the math of some family
(FOREIGN_MATH, and the soft-capping ones) are refused in a family whose code does not read them (FAMILY_MATH
says which family reads which): a config that sets them is almost surely another family's checkpoint.
"""

from __future__ import annotations

from pathlib import Path

# model_type -> the causal-LM class transformers builds for it
FAMILIES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
            "qwen3": "Qwen3ForCausalLM", "phi3": "Phi3ForCausalLM", "gemma": "GemmaForCausalLM",
            "gemma2": "Gemma2ForCausalLM",
            "gemma3_text": "Gemma3ForCausalLM", "mixtral": "MixtralForCausalLM",
            "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
# model_type of a multimodal checkpoint -> (its architecture, its language model's model_type): served text-only
TEXT_OF_MULTIMODAL = {"gemma3": ("Gemma3ForConditionalGeneration", "gemma3_text")}
GEMMA_NORMS = ("gemma", "gemma2", "gemma3_text")  # (1 + w) RMSNorm in fp32, embeddings scaled by sqrt(hidden)
GEMMA = ("gemma2", "gemma3_text")  # and sandwich norms, query_pre_attn_scalar, soft-capping, local/global layers
MOE = ("mixtral", "qwen2_moe", "qwen3_moe")  # top-k routed experts
PER_LAYER_WINDOWS = ("qwen2", "qwen3", "qwen2_moe") + GEMMA  # layer_types says which layers have the window
UNIFORM_WINDOW = ("mistral", "phi3", "mixtral", "qwen3_moe")  # sliding_window applies to every layer
# hidden_act values the MLP implements, each the same torch function transformers' ACT2FN uses
ACTIVATIONS = ("silu", "swish", "gelu", "gelu_pytorch_tanh", "relu")
# rope types whose tables are position-independent (computed once, as transformers computes them);
# "dynamic" and "longrope" change the tables with the sequence length and are refused
ROPE_TYPES = ("default", "linear", "llama3", "yarn")

HANDLED, REFUSED, IRRELEVANT = "handled", "refused", "irrelevant"

# field -> (class, what pagedkv does with it / why it does not matter)
FIELDS: dict[str, tuple[str, str]] = {
    # shapes
    "vocab_size": (HANDLED, "embedding and lm_head rows; token ids are checked against it"),
    "hidden_size": (HANDLED, "model width"),
    "intermediate_size": (HANDLED, "MLP width"),
    "num_hidden_layers": (HANDLED, "layer count"),
    "num_attention_heads": (HANDLED, "query heads"),
    "num_key_value_heads": (HANDLED, "KV heads (GQA/MQA); pages are sized by it"),
    "head_dim": (HANDLED, "per-head width, may differ from hidden_size / heads (tested against HF; Qwen3 and "
                          "Gemma state it explicitly); Phi-3 has none: hidden_size / heads"),
    "max_position_embeddings": (HANDLED, "the longest position served; rope scaling reads it"),
    # math
    "hidden_act": (HANDLED, f"MLP activation: {', '.join(ACTIVATIONS)} (tested against HF); others refused"),
    "rms_norm_eps": (HANDLED, "RMSNorm epsilon (tested against HF)"),
    "rope_parameters": (HANDLED, f"rope theta and type: {', '.join(ROPE_TYPES)}; dynamic, longrope and "
                                 "partial_rotary_factor != 1 refused"),
    "rope_scaling": (HANDLED, "old name of rope_parameters (transformers converts it)"),
    "rope_theta": (HANDLED, "old top-level rope base (transformers moves it into rope_parameters)"),
    "tie_word_embeddings": (HANDLED, "lm_head shares the embedding; untied needs lm_head.weight"),
    "attention_bias": (HANDLED, "Llama, Qwen3, Qwen3-MoE, Gemma 1: q/k/v/o biases (tested against HF); Qwen2 "
                                "always has q/k/v biases (Qwen2-MoE: qkv_bias); the others none, as in their "
                                "transformers code"),
    "mlp_bias": (HANDLED, "Llama: gate/up/down biases (tested against HF)"),
    "sliding_window": (HANDLED, "Mistral, Phi-3, Mixtral, Qwen3-MoE: every layer's window; Qwen2/Qwen3/"
                                "Qwen2-MoE/Gemma 2/3: the window of the sliding_attention layers (layer_types); "
                                "tested against HF"),
    "use_sliding_window": (HANDLED, "Qwen: whether sliding_window applies (transformers derives layer_types "
                                    "from it; tested against HF)"),
    "max_window_layers": (HANDLED, "Qwen2/Qwen3: layers from it up get the window; Qwen2-MoE: even layers "
                                   "below it (transformers derives layer_types; tested against HF)"),
    "original_max_position_embeddings": (IRRELEVANT, "Phi-3: default rope's tables do not read it (longrope, "
                                                     "which does, is refused); transformers only rebuilds its "
                                                     "cache there, same math"),
    "layer_types": (HANDLED, "per layer full_attention or sliding_attention (its own window; Gemma 3 also its "
                             "rope table), in the families that have it; other types, or windows in a family "
                             "without per-layer types, refused"),
    "eos_token_id": (HANDLED, "stop ids, merged with generation_config.json's and sent in Describe"),
    "quantization_config": (HANDLED, "4-bit AWQ (GEMM) and GPTQ (desc_act, sym, any group size) weights load, "
                                     "kept 4-bit (tested against HF on the dequantized weights); other methods, "
                                     "bit widths and layouts refused with the field and value"),
    "attn_logit_softcapping": (HANDLED, "Gemma 2/3: cap * tanh(scores / cap) before the softmax (tested against "
                                        "HF); refused in the other families"),
    "final_logit_softcapping": (HANDLED, "Gemma 2/3: cap * tanh(logits / cap) (tested against HF); refused in the "
                                         "other families"),
    # Gemma 2/3
    "hidden_activation": (HANDLED, "Gemma 2/3: the MLP activation (their hidden_act is not read, as in "
                                   "transformers); Gemma 1 reads hidden_act (transformers maps its legacy 'gelu' "
                                   "to gelu_pytorch_tanh)"),
    "query_pre_attn_scalar": (HANDLED, "Gemma: attention scale query_pre_attn_scalar ** -0.5 (tested against HF)"),
    "_sliding_window_pattern": (HANDLED, "Gemma 3: every n-th layer global (transformers writes layer_types "
                                         "from it)"),
    "sliding_window_pattern": (HANDLED, "Gemma 3: old way to state layer_types (transformers converts it)"),
    "rope_local_base_freq": (HANDLED, "Gemma 3: old name of the local layers' rope theta (transformers moves it "
                                      "into rope_parameters['sliding_attention'])"),
    "use_bidirectional_attention": (REFUSED, "Gemma: non-causal attention (embedding models) is not implemented"),
    # mixture of experts
    "num_local_experts": (HANDLED, "Mixtral/Qwen3-MoE: routed experts per MoE layer (tested against HF)"),
    "num_experts": (HANDLED, "Qwen2-MoE/Qwen3-MoE: routed experts per MoE layer (tested against HF)"),
    "num_experts_per_tok": (HANDLED, "MoE: top-k experts each token goes to (tested against HF)"),
    "norm_topk_prob": (HANDLED, "Qwen MoE: top-k weights renormalized to sum 1 (Mixtral always does; tested)"),
    "moe_intermediate_size": (HANDLED, "Qwen MoE: each routed expert's MLP width"),
    "shared_expert_intermediate_size": (HANDLED, "Qwen2-MoE: the shared expert's width, gated by "
                                                 "sigmoid(shared_expert_gate) (tested against HF)"),
    "decoder_sparse_step": (HANDLED, "Qwen MoE: every n-th layer is MoE, the others a dense MLP (tested)"),
    "mlp_only_layers": (HANDLED, "Qwen MoE: layers with a dense MLP instead of experts (tested against HF)"),
    "qkv_bias": (HANDLED, "Qwen2-MoE: q/k/v biases (tested against HF)"),
    "output_router_logits": (IRRELEVANT, "MoE: returns the router logits for the training loss; same routing"),
    "router_aux_loss_coef": (IRRELEVANT, "MoE: weight of the training load-balancing loss"),
    "router_jitter_noise": (IRRELEVANT, "Mixtral: noise on the router input in training mode only"),
    # no effect on inference math
    "pretraining_tp": (IRRELEVANT, "transformers' Llama no longer reads it; it only split the same matmuls"),
    "bos_token_id": (IRRELEVANT, "the tokenizer adds it to the prompt; the model does nothing special with it"),
    "pad_token_id": (IRRELEVANT, "nothing is padded: each request is its own sequence"),
    "attention_dropout": (IRRELEVANT, "dropout is off at inference (transformers' eval mode)"),
    "resid_pdrop": (IRRELEVANT, "Phi-3 residual dropout: off at inference (transformers' eval mode)"),
    "embd_pdrop": (IRRELEVANT, "Phi-3 embedding dropout: off at inference (transformers' eval mode)"),
    "initializer_range": (IRRELEVANT, "random initialisation for training; weights are loaded"),
    # multimodal checkpoints served text-only (TEXT_OF_MULTIMODAL)
    "text_config": (HANDLED, "Gemma 3 4B+: the language model's config, checked field by field as gemma3_text "
                             "(tested against HF's Gemma3ForConditionalGeneration on text)"),
    "vision_config": (IRRELEVANT, "the vision tower: prompts are text only (the API takes no images); its tensors "
                                  "are not loaded"),
    "mm_tokens_per_image": (IRRELEVANT, "image placement: prompts are text only"),
    "boi_token_index": (IRRELEVANT, "image placement: prompts are text only"),
    "eoi_token_index": (IRRELEVANT, "image placement: prompts are text only"),
    "image_token_index": (IRRELEVANT, "image placement: prompts are text only (without an image transformers "
                                      "embeds the id as an ordinary token, as pagedkv does)"),
    "use_cache": (IRRELEVANT, "transformers' own KV cache switch; pagedkv always pages KV"),
    "cache_implementation": (IRRELEVANT, "Gemma 2/3 config.json: which KV cache class transformers' generate() "
                                         "builds (hybrid); pagedkv pages KV, each layer masked by its own window"),
    "dtype": (IRRELEVANT, "the checkpoint's dtype; --dtype chooses the compute dtype"),
    "torch_dtype": (IRRELEVANT, "old name of dtype"),
    "model_type": (HANDLED, f"selects the family: {', '.join(FAMILIES)}; others refused"),
    "architectures": (HANDLED, "must be the family's causal-LM class; others refused"),
    "is_encoder_decoder": (IRRELEVANT, "false for every decoder-only family (the model_type check covers it)"),
    "chunk_size_feed_forward": (IRRELEVANT, "these families' transformers code never chunks the MLP"),
    "output_attentions": (IRRELEVANT, "what transformers returns, not what it computes"),
    "output_hidden_states": (IRRELEVANT, "what transformers returns, not what it computes"),
    "return_dict": (IRRELEVANT, "what transformers returns, not what it computes"),
    "id2label": (IRRELEVANT, "classification heads only"),
    "label2id": (IRRELEVANT, "classification heads only"),
    "problem_type": (IRRELEVANT, "classification heads only"),
    "transformers_version": (IRRELEVANT, "bookkeeping"),
    "_name_or_path": (IRRELEVANT, "bookkeeping"),
    "tokenizer_class": (IRRELEVANT, "the scheduler loads the tokenizer itself"),
}

# Fields of other families that change their math. transformers' Llama/Mistral/Qwen2/Qwen3/Phi3 would ignore them,
# but a config that sets them is another family's checkpoint under a borrowed model_type, so it is refused.
FOREIGN_MATH = (
    "query_pre_attn_scalar", "use_qk_norm", "qk_layernorm", "num_experts", "num_local_experts",
    "num_experts_per_tok", "embedding_multiplier", "logits_scaling", "residual_multiplier",
    "attention_multiplier", "partial_rotary_factor", "use_mrope", "alibi", "use_parallel_residual",
    "attn_logit_softcapping", "final_logit_softcapping", "moe_intermediate_size", "shared_expert_intermediate_size",
)
# field -> the families whose code reads it (elsewhere it is refused when set)
FAMILY_MATH = {
    "query_pre_attn_scalar": GEMMA, "attn_logit_softcapping": GEMMA, "final_logit_softcapping": GEMMA,
    "num_experts": MOE, "num_local_experts": MOE, "num_experts_per_tok": MOE,
    "moe_intermediate_size": ("qwen2_moe", "qwen3_moe"), "shared_expert_intermediate_size": ("qwen2_moe",),
}
REFUSED_FIELDS = tuple(name for name, (kind, _) in FIELDS.items() if kind == REFUSED) + FOREIGN_MATH


def is_off(value) -> bool:
    """A refused field may be present when it asks for nothing."""
    return value is None or value is False or value == {} or value == []


def check_fields(hf, path: Path | str) -> tuple[str, list[str]]:
    """Refuses what the model code does not implement; returns the family and the unknown fields."""
    where = f"model {path}"
    d = hf.to_dict()
    family = d.get("model_type")
    if family not in FAMILIES:
        raise ValueError(f"{where}: model_type = {family!r} is not supported; supported: {', '.join(FAMILIES)}")
    archs = list(d.get("architectures") or [])
    if archs and archs != [FAMILIES[family]]:
        raise ValueError(f"{where}: architectures = {archs} is not supported for model_type {family!r} "
                         f"(expected [{FAMILIES[family]!r}])")
    for name in REFUSED_FIELDS:
        if family in FAMILY_MATH.get(name, ()):
            continue
        if name in d and not is_off(d[name]) and not (name == "partial_rotary_factor" and d[name] == 1.0):
            raise ValueError(f"{where}: {name} = {d[name]!r} is not supported ({_why(name, family)})")
    act_field = "hidden_activation" if family in GEMMA else "hidden_act"
    act = d.get(act_field) or "silu"
    if act not in ACTIVATIONS:
        raise ValueError(f"{where}: {act_field} = {act!r} is not supported; supported: {', '.join(ACTIVATIONS)}")
    for label, rope in _rope_sets(d, family):
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"{where}: {label}.rope_type = {rope_type!r} is not supported "
                             f"(it changes with the sequence length); supported: {', '.join(ROPE_TYPES)}")
        if rope.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError(f"{where}: {label}.partial_rotary_factor = {rope['partial_rotary_factor']!r} "
                             "is not supported (rotary embedding over the whole head only)")
    layer_types = list(d.get("layer_types") or [])
    odd = sorted({t for t in layer_types} - {"full_attention", "sliding_attention"})
    if odd or (family not in PER_LAYER_WINDOWS and "sliding_attention" in layer_types):
        windowed = [i for i, t in enumerate(layer_types) if t != "full_attention"]
        raise ValueError(f"{where}: layer_types = {_short(layer_types)} puts {odd or 'a window'} on layers "
                         f"{windowed}; model_type {family!r} has no per-layer attention types")
    if family in MOE:
        _check_moe(d, where)
    if not is_off(d.get("quantization_config")):
        from executor_svc.model.quant_config import parse_quant_config

        parse_quant_config(d["quantization_config"], where)
    return family, unknown_fields(d)


def _why(name: str, family: str) -> str:
    if name in FAMILY_MATH:
        return f"model_type {family!r} does not read it; only {', '.join(FAMILY_MATH[name])} do"
    if name in FIELDS:
        return FIELDS[name][1]
    return "a field of another model family that changes its math"


def _rope_sets(d: dict, family: str) -> list[tuple[str, dict]]:
    """(label, rope parameters) of each set the family uses: Gemma 3 has one per layer type."""
    rope = d.get("rope_parameters") or {}
    if family == "gemma3_text":
        return [(f"rope_parameters[{t!r}]", rope.get(t) or {}) for t in ("full_attention", "sliding_attention")]
    return [("rope_parameters", rope)]


def _check_moe(d: dict, where: str) -> None:
    experts, top_k = d.get("num_experts", d.get("num_local_experts")), d.get("num_experts_per_tok")
    if not isinstance(experts, int) or experts < 1:
        raise ValueError(f"{where}: num_experts = {experts!r} must be an integer >= 1")
    if not isinstance(top_k, int) or not 1 <= top_k <= experts:
        raise ValueError(f"{where}: num_experts_per_tok = {top_k!r} must be an integer in [1, {experts}]")
    step = d.get("decoder_sparse_step", 1)
    if not isinstance(step, int) or step < 1:
        raise ValueError(f"{where}: decoder_sparse_step = {step!r} must be an integer >= 1")


def _short(values: list) -> str:
    return repr(values) if len(values) <= 8 else repr(values[:8])[:-1] + f", ... ({len(values)} layers)]"


def unknown_fields(d: dict) -> list[str]:
    """Fields no supported family defines (transformers ignores them too): logged, not refused."""
    return sorted(k for k in d if k not in FIELDS and k not in FOREIGN_MATH)


def check_outer_fields(d: dict, where: str, text_family: str) -> list[str]:
    """A multimodal checkpoint's outer config (its text config is checked as a family by check_fields):
    refuses what it sets of REFUSED_FIELDS; returns its unknown fields."""
    for name in REFUSED_FIELDS:
        if name in d and not is_off(d[name]):
            raise ValueError(f"{where}: {name} = {d[name]!r} is not supported ({_why(name, text_family)})")
    return unknown_fields(d)
