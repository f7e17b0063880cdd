"""The model read from a Hugging Face directory: config.json and generation_config.json, as one ``ModelConfig``.

Which fields are honoured and which refused is config_fields.py's (the field table and the check this module runs
first); generation_config.json's sampling values are generation_config.py's.

Per-layer attention windows (Gemma 2/3's alternating local and global layers, Qwen2's max_window_layers) are
honoured in the model: each layer attends with its own window (``ModelConfig.layer_windows``). The scheduler
does not need them: it frees a request's pages only by the request's own sink + window policy, never by the
model's window, so a page stays while any layer can still read it (local layers simply mask it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from executor_svc.config_fields import (
    FAMILIES,
    GEMMA,
    GEMMA_NORMS,
    MOE,
    PER_LAYER_WINDOWS,
    TEXT_OF_MULTIMODAL,
    UNIFORM_WINDOW,
    check_fields,
    check_outer_fields,
    is_off,
)
from executor_svc.generation_config import read_generation_config

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}


def parse_dtype(name: str) -> torch.dtype:
    key = DTYPE_ALIASES.get(name, name)
    if key not in DTYPES:
        raise ValueError(f"--dtype {name!r}: must be one of {', '.join(DTYPES)} (or fp32/bf16/fp16)")
    return DTYPES[key]


def _token_ids(value, where: str) -> list[int]:
    ids = value if isinstance(value, list) else ([] if value is None else [value])
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ValueError(f"{where}: eos_token_id = {value!r} must be a token id or a list of them")
    return ids


@dataclass(frozen=True, slots=True)
class MoeSpec:
    """Top-k routed experts in place of the MLP (Mixtral, Qwen2-MoE, Qwen3-MoE)."""

    num_experts: int
    top_k: int
    normalize: bool  # top-k weights renormalized to sum 1
    expert_size: int  # each expert's MLP width
    shared_size: int  # Qwen2-MoE: the sigmoid-gated shared expert's width (0: none)
    sparse_layers: tuple[bool, ...]  # per layer: experts (True) or a dense MLP of intermediate_size
    mixtral_names: bool  # block_sparse_moe.experts.N.w1/w2/w3 (else mlp.experts.N.gate/up/down_proj)


@dataclass(frozen=True, slots=True)
class ModelConfig:
    path: Path
    architecture: str
    hf_config: object
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v biases
    sliding_window: int | None
    eos_token_ids: tuple[int, ...]
    family: str = "llama"
    qk_norm: bool = False  # Qwen3: RMSNorm over each q/k head before rope
    fused_projections: bool = False  # Phi-3: qkv_proj and gate_up_proj in the checkpoint
    hidden_act: str = "silu"
    o_proj_bias: bool = False
    mlp_bias: bool = False
    # generation_config.json's sampling values (temperature, top_p, top_k, ...): sampling_defaults() of them
    generation_defaults: dict = field(default_factory=dict)
    unknown_fields: tuple[str, ...] = ()
    # 4-bit weights (executor_svc.model.quant_config.QuantSpec) from quantization_config; None: float weights
    quantization: object = None
    # per layer: its attention window in tokens (0: full attention); () when sliding_window covers every layer
    layer_windows: tuple[int, ...] = ()
    layer_types: tuple[str, ...] = ()  # Gemma 3: each layer's rope set (full_attention / sliding_attention)
    gemma: bool = False  # (1 + w) RMSNorm in fp32, embeddings scaled by sqrt(hidden_size)
    sandwich_norms: bool = False  # Gemma 2/3: RMSNorm also on attention's and the MLP's outputs
    attn_scale: float = 0.0  # 0: head_dim ** -0.5; Gemma: query_pre_attn_scalar ** -0.5
    attn_softcap: float | None = None  # Gemma 2: cap * tanh(scores / cap)
    final_softcap: float | None = None  # Gemma 2: cap * tanh(logits / cap)
    moe: MoeSpec | None = None
    # a multimodal checkpoint (TEXT_OF_MULTIMODAL) served text-only: its language model's tensors are loaded
    language_model_only: bool = False

    @property
    def model_window(self) -> int:
        """Tokens every layer attends to at most (0: some layer attends to the whole context): pages this far
        behind the newest token are read by no layer (Describe.model_sliding_window)."""
        if self.layer_windows:
            return max(self.layer_windows) if all(self.layer_windows) else 0
        return self.sliding_window or 0

    @classmethod
    def from_dir(cls, path: Path) -> ModelConfig:
        from transformers import AutoConfig

        path = Path(path)
        try:
            raw = json.loads((path / "config.json").read_text())
        except (OSError, ValueError) as err:
            raise ValueError(f"model {path}: config.json is unreadable: {err}") from err
        family = raw.get("model_type") if isinstance(raw, dict) else None
        if family not in FAMILIES and family not in TEXT_OF_MULTIMODAL:  # before AutoConfig, which knows
            raise ValueError(f"model {path}: model_type = {family!r} is not supported; "  # families we do not serve
                             f"supported: {', '.join([*FAMILIES, *TEXT_OF_MULTIMODAL])}")
        hf = outer = AutoConfig.from_pretrained(str(path))
        outer_unknown: list[str] = []
        if family in TEXT_OF_MULTIMODAL:
            if not isinstance(raw.get("text_config"), dict):
                raise ValueError(f"model {path}: model_type {family!r} needs text_config (its language model's "
                                 "config); config.json has none")
            hf, outer_unknown = _language_model_config(outer, path)
        family, unknown = check_fields(hf, path)
        unknown = sorted(set(unknown) | set(outer_unknown))
        heads = hf.num_attention_heads
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
        vocab = hf.vocab_size
        gen = read_generation_config(path)
        eos: list[int] = []
        configs = [hf] if outer is hf else [hf, outer]  # a multimodal checkpoint lists eos ids at the top too
        listed = [_token_ids(getattr(c, "eos_token_id", None), f"model {path}: config.json") for c in configs]
        for i in ([i for ids in listed for i in ids]
                  + _token_ids(gen.get("eos_token_id"), f"model {path}: generation_config.json")):
            if i >= vocab:
                raise ValueError(f"model {path}: eos_token_id {i} is outside the vocabulary ({vocab} tokens)")
            if i not in eos:
                eos.append(i)
        window = (getattr(hf, "sliding_window", None) or None) if family in UNIFORM_WINDOW else None
        llama = family == "llama"
        biased = family in ("llama", "qwen3", "qwen3_moe", "gemma") and bool(getattr(hf, "attention_bias", False))
        gemma = family in GEMMA
        return cls(
            path=path,
            architecture=TEXT_OF_MULTIMODAL[outer.model_type][0] if outer is not hf else FAMILIES[family],
            hf_config=hf,
            vocab_size=vocab,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_layers=hf.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            rms_norm_eps=hf.rms_norm_eps,
            max_position_embeddings=hf.max_position_embeddings,
            tie_word_embeddings=bool(getattr(outer, "tie_word_embeddings", False)),
            attention_bias=family == "qwen2" or biased or (family == "qwen2_moe" and bool(hf.qkv_bias)),
            sliding_window=window,
            eos_token_ids=tuple(eos),
            family=family,
            qk_norm=family in ("qwen3", "qwen3_moe", "gemma3_text"),
            sandwich_norms=gemma,
            fused_projections=family == "phi3",
            hidden_act=(hf.hidden_activation if gemma else getattr(hf, "hidden_act", None)) or "silu",
            o_proj_bias=biased,
            mlp_bias=llama and bool(getattr(hf, "mlp_bias", False)),
            generation_defaults={k: gen[k] for k in ("temperature", "top_p", "top_k", "repetition_penalty", "min_p")
                                 if k in gen},
            unknown_fields=tuple(unknown),
            quantization=_quantization(outer, path),
            language_model_only=outer is not hf,
            layer_windows=_layer_windows(hf, family),
            layer_types=tuple(hf.layer_types) if family == "gemma3_text" else (),
            gemma=family in GEMMA_NORMS,
            attn_scale=hf.query_pre_attn_scalar ** -0.5 if gemma else head_dim ** -0.5,
            attn_softcap=getattr(hf, "attn_logit_softcapping", None) if gemma else None,
            final_softcap=getattr(hf, "final_logit_softcapping", None) if gemma else None,
            moe=_moe(hf, family),
        )


def _language_model_config(outer, path: Path):
    """(the language model's config, unknown outer fields) of a multimodal checkpoint served text-only."""
    d = outer.to_dict()
    arch, text_family = TEXT_OF_MULTIMODAL[d["model_type"]]
    archs = list(d.get("architectures") or [])
    if archs and archs != [arch]:
        raise ValueError(f"model {path}: architectures = {archs} is not supported for model_type "
                         f"{d['model_type']!r} (expected [{arch!r}])")
    text = outer.text_config
    if getattr(text, "model_type", None) != text_family:
        raise ValueError(f"model {path}: text_config.model_type = {getattr(text, 'model_type', None)!r} is not "
                         f"supported (expected {text_family!r})")
    return text, check_outer_fields(d, f"model {path}", text_family)


def _layer_windows(hf, family: str) -> tuple[int, ...]:
    """Each layer's window where the family has per-layer attention types (as transformers builds each
    attention: the config's sliding_window on "sliding_attention" layers, none elsewhere)."""
    if family not in PER_LAYER_WINDOWS:
        return ()
    window = getattr(hf, "sliding_window", None) or 0
    windows = tuple(window if t == "sliding_attention" else 0 for t in hf.layer_types)
    return windows if any(windows) else ()


def _moe(hf, family: str) -> MoeSpec | None:
    if family not in MOE:
        return None
    if family == "mixtral":
        return MoeSpec(hf.num_local_experts, hf.num_experts_per_tok, True, hf.intermediate_size, 0,
                       (True,) * hf.num_hidden_layers, True)
    sparse = tuple(i not in hf.mlp_only_layers and (i + 1) % hf.decoder_sparse_step == 0
                   for i in range(hf.num_hidden_layers))
    shared = hf.shared_expert_intermediate_size if family == "qwen2_moe" else 0
    return MoeSpec(hf.num_experts, hf.num_experts_per_tok, bool(hf.norm_topk_prob), hf.moe_intermediate_size,
                   shared, sparse, False)


def _quantization(hf, path: Path):
    qc = getattr(hf, "quantization_config", None)
    if is_off(qc):
        return None
    from executor_svc.model.quant_config import parse_quant_config

    return parse_quant_config(qc if isinstance(qc, dict) else qc.to_dict(), f"model {path}")
