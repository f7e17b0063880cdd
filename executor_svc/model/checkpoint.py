"""A checkpoint's tensors as the model reads them: the safetensors files, a multimodal checkpoint's language model
under causal-LM names, the module names of each layer (fused q/k/v and gate/up, experts, router), and every tensor
a config implies (``expected_tensors``: load_model refuses a checkpoint that lacks one)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from executor_svc.model.quant_config import quant_tensor_names
from executor_svc.model_config import ModelConfig, MoeSpec


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"model {path}: no *.safetensors files (only safetensors checkpoints load)")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            for key in fh.keys():
                weights[key] = fh.get_tensor(key)
    return weights


# a multimodal checkpoint's language model tensors -> the names of a causal LM's (both layouts in use)
LANGUAGE_MODEL_PREFIXES = (("language_model.model.", "model."), ("model.language_model.", "model."),
                           ("language_model.lm_head.", "lm_head."), ("lm_head.", "lm_head."))


def language_model_tensors(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The language model's tensors under causal-LM names; the vision tower's and projector's are dropped."""
    out = {}
    for key, tensor in weights.items():
        for old, new in LANGUAGE_MODEL_PREFIXES:
            if key.startswith(old):
                out[new + key[len(old):]] = tensor
                break
    return out


def fused_modules(cfg: ModelConfig, p: str) -> tuple[list[str], list[str]]:
    """The checkpoint modules whose outputs make the fused q/k/v and gate/up matmuls of layer prefix p."""
    if cfg.fused_projections:  # Phi-3
        return [p + "self_attn.qkv_proj"], [p + "mlp.gate_up_proj"]
    return [p + f"self_attn.{n}_proj" for n in "qkv"], [p + f"mlp.{n}_proj" for n in ("gate", "up")]


def expert_modules(spec: MoeSpec, p: str, e: int) -> tuple[list[str], str]:
    """Expert e's (gate and up modules, down module) in layer prefix p, as the checkpoints name them."""
    if spec.mixtral_names:
        x = p + f"block_sparse_moe.experts.{e}."
        return [x + "w1", x + "w3"], x + "w2"
    x = p + f"mlp.experts.{e}."
    return [x + "gate_proj", x + "up_proj"], x + "down_proj"


def router_name(spec: MoeSpec, p: str) -> str:
    return p + ("block_sparse_moe.gate.weight" if spec.mixtral_names else "mlp.gate.weight")


def _mlp_modules(cfg: ModelConfig, i: int, p: str) -> tuple[list[str], list[str]]:
    """(linear modules, plain tensors) of layer i's MLP or MoE block."""
    spec = cfg.moe
    if spec is None or not spec.sparse_layers[i]:
        return fused_modules(cfg, p)[1] + [p + "mlp.down_proj"], []
    modules = []
    for e in range(spec.num_experts):
        gate_up, down = expert_modules(spec, p, e)
        modules += gate_up + [down]
    tensors = [router_name(spec, p)]
    if spec.shared_size:
        modules += [p + f"mlp.shared_expert.{n}_proj" for n in ("gate", "up", "down")]
        tensors.append(p + "mlp.shared_expert_gate.weight")
    return modules, tensors


def expected_tensors(cfg: ModelConfig) -> list[str]:
    """Every tensor the config implies, as transformers' modules would hold them."""
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if cfg.quantization is not None and cfg.quantization.lm_head:  # (GPTQ's lm_head: its own 4-bit tensors)
        names += [f"lm_head.{t}" for t in quant_tensor_names(cfg.quantization)]
    elif not cfg.tie_word_embeddings:
        names.append("lm_head.weight")
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        if cfg.sandwich_norms:
            names += [p + "pre_feedforward_layernorm.weight", p + "post_feedforward_layernorm.weight"]
        if cfg.qk_norm:
            names += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
        qkv = fused_modules(cfg, p)[0]
        mlp, tensors = _mlp_modules(cfg, i, p)
        names += tensors
        for module in qkv + [p + "self_attn.o_proj"] + mlp:
            spec = cfg.quantization
            if spec is not None and spec.quantizes(module):
                names += [f"{module}.{t}" for t in quant_tensor_names(spec)]
            else:
                names.append(f"{module}.weight")
        if cfg.attention_bias:
            names += [p + f"self_attn.{n}_proj.bias" for n in "qkv"]
        if cfg.o_proj_bias:
            names.append(p + "self_attn.o_proj.bias")
        if cfg.mlp_bias:
            names += [p + f"mlp.{n}_proj.bias" for n in ("gate", "up", "down")]
    return names
