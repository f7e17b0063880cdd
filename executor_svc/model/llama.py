"""Llama-family decoder (Llama 2/3, Qwen2, Qwen3, Mistral, Phi-3) over a flat batch and the paged KV pool.

Qwen3 adds an RMSNorm over each query/key head before rope (q_norm, k_norm); Phi-3 stores q/k/v and gate/up
already fused (qkv_proj, gate_up_proj, in the same order as the fused matmuls here).

The arithmetic follows transformers' eager implementation op for op (RMSNorm in fp32, rotary
embedding from the same inverse frequencies, fp32 softmax) so greedy output is token-exact.
"""

from __future__ import annotations

from pathlib import Path

import structlog
import torch
import torch.nn.functional as F
from safetensors import safe_open

from executor_svc.attention.metadata import AttentionMetadata
from executor_svc.model.quant import DenseLinear, build_int4, quant_tensor_names, unpack_linear
from executor_svc.model_config import ModelConfig
from executor_svc.pages import DevicePagePool


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


ACTIVATIONS = {  # the torch functions transformers' ACT2FN uses for these names
    "silu": F.silu, "swish": F.silu, "gelu": F.gelu, "relu": F.relu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Rotary:
    """cos/sin tables computed the way transformers computes them (incl. rope scaling types)."""

    def __init__(self, cfg: ModelConfig, device: torch.device) -> None:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        hf = cfg.hf_config
        params = getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {}
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type == "default":
            base = params.get("rope_theta", getattr(hf, "rope_theta", 10000.0))
            dim = cfg.head_dim
            inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
            self.scaling = 1.0
        elif rope_type in ("linear", "llama3", "yarn"):
            inv_freq, self.scaling = ROPE_INIT_FUNCTIONS[rope_type](hf, device)
        else:  # model_config refuses these first; longrope and dynamic change the tables with the length
            raise ValueError(f"rope type {rope_type!r} is not supported (its tables depend on the length)")
        self.inv_freq = inv_freq.to(device=device, dtype=torch.float32)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.scaling).to(dtype), (emb.sin() * self.scaling).to(dtype)


class LlamaModel:
    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], device: torch.device,
                 dtype: torch.dtype) -> None:
        self.cfg = cfg
        self.device = device
        self.dtype = dtype
        self.rotary = Rotary(cfg, device)
        self.raw = weights  # the checkpoint's tensors (4-bit ones stay int32 until packed)
        self.linear_kinds: dict[str, int] = {}  # "int4-cpu" / "dense" / "dequantized (why)" -> linears
        w = {k: v.to(device=device, dtype=dtype) for k, v in weights.items()
             if v.is_floating_point() and not k.endswith(".scales")}
        self.act = ACTIVATIONS[cfg.hidden_act]
        self.embed = w["model.embed_tokens.weight"]
        self.final_norm = w["model.norm.weight"]
        self.lm_head = self.embed if cfg.tie_word_embeddings else w["lm_head.weight"]
        self.layers = [self._layer_weights(w, i) for i in range(cfg.num_layers)]
        del self.raw
        self.scale = cfg.head_dim ** -0.5
        self.qkv_sizes = [cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim,
                          cfg.num_kv_heads * cfg.head_dim]

    def _layer_weights(self, w: dict[str, torch.Tensor], i: int) -> dict:
        """One layer's norms and linears, with q/k/v and gate/up fused into single matmuls. Biases are taken
        exactly where the config has them (as transformers builds its Linear layers), never just because a
        tensor is in the file."""
        cfg = self.cfg
        p = f"model.layers.{i}."
        qkv, gate_up = _fused_modules(cfg, p)
        out = {
            "in_norm": w[p + "input_layernorm.weight"],
            "post_norm": w[p + "post_attention_layernorm.weight"],
            "qkv": self._linear(w, qkv, cfg.attention_bias),
            "o": self._linear(w, [p + "self_attn.o_proj"], cfg.o_proj_bias),
            "gate_up": self._linear(w, gate_up, cfg.mlp_bias),
            "down": self._linear(w, [p + "mlp.down_proj"], cfg.mlp_bias),
        }
        if cfg.qk_norm:
            out["q_norm"] = w[p + "self_attn.q_norm.weight"]
            out["k_norm"] = w[p + "self_attn.k_norm.weight"]
        return out

    def _linear(self, w: dict[str, torch.Tensor], modules: list[str], bias: bool):
        """One matmul over modules (same input, outputs concatenated): 4-bit where the checkpoint holds them
        quantized, else the float weights as before."""
        biases = [w[m + ".bias"] for m in modules] if bias else None
        spec = self.cfg.quantization
        if spec is None or not all(spec.quantizes(m) for m in modules):
            kind = "dense"
            linear = DenseLinear(torch.cat([w[m + ".weight"] for m in modules]),
                                 None if biases is None else torch.cat(biases))
        else:
            int4 = [unpack_linear(spec, {t: self.raw[f"{m}.{t}"] for t in quant_tensor_names(spec)}, m)
                    for m in modules]
            linear, kind = build_int4(int4, biases, self.device, self.dtype)
        self.linear_kinds[kind] = self.linear_kinds.get(kind, 0) + 1
        return linear

    def weight_bytes(self) -> dict[str, int]:
        """Bytes held: the decoder layers' linears, and everything else (embeddings, norms, lm_head)."""
        linears = sum(lw[k].nbytes() for lw in self.layers for k in ("qkv", "o", "gate_up", "down"))
        other = [self.embed, self.final_norm] + [lw[k] for lw in self.layers
                                                 for k in ("in_norm", "post_norm", "q_norm", "k_norm") if k in lw]
        if self.lm_head is not self.embed:
            other.append(self.lm_head)
        return {"linears": linears, "other": sum(t.numel() * t.element_size() for t in other)}

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                pool: DevicePagePool, attention, logits_idx: torch.Tensor) -> torch.Tensor:
        """One flattened step: input_ids/positions [T]; returns fp32 logits for the rows in logits_idx."""
        cfg = self.cfg
        n = input_ids.shape[0]
        x = F.embedding(input_ids, self.embed)
        cos, sin = self.rotary.cos_sin(positions, self.dtype)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        for i, lw in enumerate(self.layers):
            h = _rms_norm(x, lw["in_norm"], cfg.rms_norm_eps)
            q, k, v = lw["qkv"](h).split(self.qkv_sizes, dim=-1)
            q = q.view(n, cfg.num_heads, cfg.head_dim)
            k = k.view(n, cfg.num_kv_heads, cfg.head_dim)
            v = v.reshape(n, cfg.num_kv_heads, cfg.head_dim)
            if cfg.qk_norm:  # Qwen3: per head, before rope
                q = _rms_norm(q, lw["q_norm"], cfg.rms_norm_eps)
                k = _rms_norm(k, lw["k_norm"], cfg.rms_norm_eps)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            k_cache, v_cache = pool.layer(i)
            attention.write_cache(k_cache, v_cache, k, v, meta)
            a = attention.forward(q, k_cache, v_cache, meta).reshape(n, cfg.num_heads * cfg.head_dim)
            x = x + lw["o"](a)
            h = _rms_norm(x, lw["post_norm"], cfg.rms_norm_eps)
            gate, up = lw["gate_up"](h).chunk(2, dim=-1)
            x = x + lw["down"](self.act(gate) * up)
        x = _rms_norm(x[logits_idx], self.final_norm, cfg.rms_norm_eps)
        return F.linear(x, self.lm_head).float()


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"model {path}: no *.safetensors files (only safetensors checkpoints load)")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            for key in fh.keys():
                weights[key] = fh.get_tensor(key)
    return weights


def load_model(cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> LlamaModel:
    weights = _read_safetensors(cfg.path)
    missing = [k for k in expected_tensors(cfg) if k not in weights]
    if missing:
        more = f" and {len(missing) - 6} more" if len(missing) > 6 else ""
        raise ValueError(f"model {cfg.path}: missing tensors {missing[:6]}{more} (the config asks for them)")
    model = LlamaModel(cfg, weights, device, dtype)
    if cfg.quantization is not None:
        log = structlog.get_logger("executor")
        kinds = model.linear_kinds
        (log.warning if any(k.startswith("dequantized") for k in kinds) else log.info)(
            "weights_4bit", format=cfg.quantization.describe(), linear_kinds=kinds,
            linear_bytes=model.weight_bytes()["linears"], other_bytes=model.weight_bytes()["other"],
            note="dequantized linears hold full-size float weights" if any(
                k.startswith("dequantized") for k in kinds) else "kept 4-bit")
    return model


def _fused_modules(cfg: ModelConfig, p: str) -> tuple[list[str], list[str]]:
    """The checkpoint modules whose outputs make the fused q/k/v and gate/up matmuls of layer prefix p."""
    if cfg.fused_projections:  # Phi-3
        return [p + "self_attn.qkv_proj"], [p + "mlp.gate_up_proj"]
    return [p + f"self_attn.{n}_proj" for n in "qkv"], [p + f"mlp.{n}_proj" for n in ("gate", "up")]


def expected_tensors(cfg: ModelConfig) -> list[str]:
    """Every tensor the config implies, as transformers' modules would hold them."""
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not cfg.tie_word_embeddings:
        names.append("lm_head.weight")
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        if cfg.qk_norm:
            names += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
        qkv, gate_up = _fused_modules(cfg, p)
        for module in qkv + [p + "self_attn.o_proj"] + gate_up + [p + "mlp.down_proj"]:
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
