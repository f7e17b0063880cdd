"""The model shape read from a Hugging Face config.json."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

SUPPORTED_ARCHITECTURES = {"LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM"}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}


def parse_dtype(name: str) -> torch.dtype:
    key = DTYPE_ALIASES.get(name, name)
    if key not in DTYPES:
        raise ValueError(f"--dtype {name!r}: must be one of {', '.join(DTYPES)} (or fp32/bf16/fp16)")
    return DTYPES[key]


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
    attention_bias: bool
    sliding_window: int | None
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_dir(cls, path: Path) -> ModelConfig:
        from transformers import AutoConfig

        hf = AutoConfig.from_pretrained(str(path))
        archs = list(getattr(hf, "architectures", None) or [])
        arch = archs[0] if archs else ""
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"model {path}: architecture {arch or '(none)'} is not supported; "
                f"supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
            )
        heads = hf.num_attention_heads
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
        eos = getattr(hf, "eos_token_id", None)
        eos_ids = tuple(eos if isinstance(eos, list) else ([eos] if eos is not None else []))
        bias = bool(getattr(hf, "attention_bias", False)) or arch == "Qwen2ForCausalLM"
        window = getattr(hf, "sliding_window", None) if getattr(hf, "use_sliding_window", True) else None
        return cls(
            path=path,
            architecture=arch,
            hf_config=hf,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_layers=hf.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            rms_norm_eps=hf.rms_norm_eps,
            max_position_embeddings=hf.max_position_embeddings,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            attention_bias=bias,
            sliding_window=window if arch == "MistralForCausalLM" else None,
            eos_token_ids=eos_ids,
        )
