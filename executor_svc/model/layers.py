"""The pieces of a decoder layer that hold no weights of their own, as transformers computes them: RMSNorm (Llama's,
and Gemma's (1 + w) in fp32), the MLP activations, and the rotary embedding's tables (incl. rope scaling types)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from executor_svc.model_config import ModelConfig


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def gemma_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm: ``weight`` holds 1 + w in fp32, applied before the cast back."""
    h = x.to(torch.float32)
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight).to(x.dtype)


ACTIVATIONS = {  # the torch functions transformers' ACT2FN uses for these names
    "silu": F.silu, "swish": F.silu, "gelu": F.gelu, "relu": F.relu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Rotary:
    """cos/sin tables computed the way transformers computes them (incl. rope scaling types)."""

    def __init__(self, cfg: ModelConfig, device: torch.device, layer_type: str | None = None) -> None:
        """``layer_type``: Gemma 3's rope parameter set (rope_parameters[layer_type])."""
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        hf = cfg.hf_config
        params = getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {}
        if layer_type is not None:
            params = params[layer_type]
        rope_type = params.get("rope_type", params.get("type", "default"))
        kw = {} if layer_type is None else {"layer_type": layer_type}
        if rope_type == "default":
            base = params.get("rope_theta", getattr(hf, "rope_theta", 10000.0))
            dim = cfg.head_dim
            inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
            self.scaling = 1.0
        elif rope_type in ("linear", "llama3", "yarn"):
            inv_freq, self.scaling = ROPE_INIT_FUNCTIONS[rope_type](hf, device, **kw)
        else:  # config_fields refuses these first; longrope and dynamic change the tables with the length
            raise ValueError(f"rope type {rope_type!r} is not supported (its tables depend on the length)")
        self.inv_freq = inv_freq.to(device=device, dtype=torch.float32)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.scaling).to(dtype), (emb.sin() * self.scaling).to(dtype)
