"""Llama-family decoder (Llama 2/3, Qwen2, Qwen3, Mistral, Phi-3, Gemma 1/2/3, Mixtral, Qwen2/3-MoE) over a
flat batch and the paged KV pool.

Qwen3 adds an RMSNorm over each query/key head before rope (q_norm, k_norm); Phi-3 stores q/k/v and gate/up
already fused (qkv_proj, gate_up_proj, in the same order as the fused matmuls here). Gemma normalizes with
(1 + w) in fp32 and scales the embeddings by sqrt(hidden_size); Gemma 2/3 also normalize after attention and
after the MLP (sandwich norms), scale scores by query_pre_attn_scalar ** -0.5, soft-cap scores (Gemma 2, see
softcap.py) and logits, and alternate local (windowed) and global layers; Gemma 3 has a rope table per layer type.
Mixtral and the Qwen MoE models route each token to top-k experts (moe.py). Per-layer windows: each layer
attends with its own window (a copy of the step's metadata per distinct window).

The arithmetic follows transformers' eager implementation op for op (RMSNorm in fp32, rotary
embedding from the same inverse frequencies, fp32 softmax) so greedy output is token-exact.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import structlog
import torch
import torch.nn.functional as F
from safetensors import safe_open

from executor_svc.attention.metadata import AttentionMetadata
from executor_svc.model import cpu_linear
from executor_svc.model.moe import DenseMlp, MoeMlp
from executor_svc.model.quant import DenseLinear, build_int4, quant_tensor_names, unpack_linear
from executor_svc.model.softcap import softcapped_attention
from executor_svc.model_config import ModelConfig, MoeSpec
from executor_svc.pages import DevicePagePool


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def _gemma_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm: ``weight`` holds 1 + w in fp32, applied before the cast back."""
    h = x.to(torch.float32)
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight).to(x.dtype)


ACTIVATIONS = {  # the torch functions transformers' ACT2FN uses for these names
    "silu": F.silu, "swish": F.silu, "gelu": F.gelu, "relu": F.relu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
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


class LlamaModel:
    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], device: torch.device,
                 dtype: torch.dtype) -> None:
        self.cfg = cfg
        self.device = device
        self.dtype = dtype
        types = sorted(set(cfg.layer_types))
        self.rotaries = {t: Rotary(cfg, device, t) for t in types} if types else {None: Rotary(cfg, device)}
        self.raw = weights  # the checkpoint's tensors (4-bit ones stay int32 until packed)
        self.linear_kinds: dict[str, int] = {}  # "int4-cpu" / "dense" / "dequantized (why)" -> linears
        w = {k: v.to(device=device, dtype=dtype) for k, v in weights.items()
             if v.is_floating_point() and not k.endswith(".scales")}
        if cfg.gemma:  # norms hold 1 + w in fp32 (Gemma's RMSNorm computes it so)
            w.update({k: 1.0 + v.to(device=device, dtype=torch.float32) for k, v in weights.items()
                      if k.endswith("norm.weight")})
        self.norm = _gemma_norm if cfg.gemma else _rms_norm
        self.act = ACTIVATIONS[cfg.hidden_act]
        self.embed = w["model.embed_tokens.weight"]
        self.embed_scale = torch.tensor(cfg.hidden_size ** 0.5, dtype=dtype, device=device) if cfg.gemma else None
        self.final_norm = w["model.norm.weight"]
        self.packed = cpu_linear.available(device, dtype)  # float32 on the CPU: oneDNN linears (cpu_linear.py)
        # the logits' linear (a tied head packed is a copy of its own: the embedding lookup reads the original)
        head = self.embed if cfg.tie_word_embeddings else w["lm_head.weight"]
        self.logits = cpu_linear.PackedLinear(head, None) if self.packed else DenseLinear(head, None)
        self.layers = [self._layer_weights(w, i) for i in range(cfg.num_layers)]
        del self.raw
        self.scale = cfg.attn_scale or cfg.head_dim ** -0.5
        self._fused = None  # fused_ops(), decided on the first forward
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
            "qkv": self._linear(w, qkv, cfg.attention_bias),
            "o": self._linear(w, [p + "self_attn.o_proj"], cfg.o_proj_bias),
            "window": cfg.layer_windows[i] if cfg.layer_windows else None,
            "rope": cfg.layer_types[i] if cfg.layer_types else None,
        }
        if cfg.sandwich_norms:  # Gemma 2/3: around attention's output and around the MLP
            out["attn_out_norm"] = w[p + "post_attention_layernorm.weight"]
            out["mlp_norm"] = w[p + "pre_feedforward_layernorm.weight"]
            out["mlp_out_norm"] = w[p + "post_feedforward_layernorm.weight"]
        else:
            out["mlp_norm"] = w[p + "post_attention_layernorm.weight"]
        if cfg.qk_norm:
            out["q_norm"] = w[p + "self_attn.q_norm.weight"]
            out["k_norm"] = w[p + "self_attn.k_norm.weight"]
        if cfg.moe is not None and cfg.moe.sparse_layers[i]:
            out["mlp"] = self._moe(w, p)
        else:
            out["mlp"] = DenseMlp(self._linear(w, gate_up, cfg.mlp_bias),
                                  self._linear(w, [p + "mlp.down_proj"], cfg.mlp_bias), self.act)
            out["gate_up"], out["down"] = out["mlp"].gate_up, out["mlp"].down  # as tests/benchmarks read them
        return out

    def _moe(self, w: dict[str, torch.Tensor], p: str) -> MoeMlp:
        spec = self.cfg.moe
        experts = []
        for e in range(spec.num_experts):
            gate_up, down = _expert_modules(spec, p, e)
            experts.append((self._linear(w, gate_up, False), self._linear(w, [down], False)))
        shared = gate = None
        if spec.shared_size:
            s = p + "mlp.shared_expert."
            shared = (self._linear(w, [s + "gate_proj", s + "up_proj"], False),
                      self._linear(w, [s + "down_proj"], False))
            gate = w[p + "mlp.shared_expert_gate.weight"]
        return MoeMlp(spec, w[_router_name(spec, p)], experts, self.act, shared, gate)

    def _linear(self, w: dict[str, torch.Tensor], modules: list[str], bias: bool):
        """One matmul over modules (same input, outputs concatenated): 4-bit where the checkpoint holds them
        quantized, else the float weights as before."""
        biases = [w[m + ".bias"] for m in modules] if bias else None
        spec = self.cfg.quantization
        if spec is None or not all(spec.quantizes(m) for m in modules):
            kind = "dense"
            make = cpu_linear.PackedLinear if self.packed else DenseLinear
            linear = make(torch.cat([w[m + ".weight"] for m in modules]), None if biases is None else torch.cat(biases))
        else:
            int4 = [unpack_linear(spec, {t: self.raw[f"{m}.{t}"] for t in quant_tensor_names(spec)}, m)
                    for m in modules]
            linear, kind = build_int4(int4, biases, self.device, self.dtype)
        self.linear_kinds[kind] = self.linear_kinds.get(kind, 0) + 1
        return linear

    def weight_bytes(self) -> dict[str, int]:
        """Bytes held: the decoder layers' linears, and everything else (embeddings, norms, routers, lm_head)."""
        linears = sum(lin.nbytes() for lw in self.layers for lin in [lw["qkv"], lw["o"], *lw["mlp"].linears()])
        other = [self.embed, self.final_norm] + [t for lw in self.layers for t in lw["mlp"].tensors()]
        other += [lw[k] for lw in self.layers for k in ("in_norm", "mlp_norm", "attn_out_norm", "mlp_out_norm",
                                                        "q_norm", "k_norm") if k in lw]
        head = 0 if getattr(self.logits, "weight", None) is self.embed else self.logits.nbytes()  # (tied in place)
        return {"linears": linears, "other": sum(t.numel() * t.element_size() for t in other) + head}

    def fused_ops(self):
        """``torch.ops.pagedkv_cpu`` when this model runs its layers with the fused CPU ops (cpu_ops.cpp: RMSNorm,
        residual add + RMSNorm, rotary + cache write, SiLU x up), else None: a float32 model on the CPU with
        Llama's norms (not Gemma's), once the CPU kernel library loads. Its torch ops stay the reference (and the
        path of every other dtype and device); PAGEDKV_CPU_ATTENTION=reference turns both off."""
        if self._fused is None:
            ops = None
            if self.device.type == "cpu" and self.dtype == torch.float32 and not self.cfg.gemma \
                    and not self.cfg.sandwich_norms:
                from executor_svc.attention import cpu_kernel

                ops = cpu_kernel.load()
            self._fused = ops if ops is not None and hasattr(ops, "add_rms_norm") else False
        return self._fused or None

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                pool: DevicePagePool, attention, logits_idx: torch.Tensor) -> torch.Tensor:
        """One flattened step: input_ids/positions [T]; returns fp32 logits for the rows in logits_idx."""
        ops = self.fused_ops()
        if ops is not None:
            return self._forward_fused(ops, input_ids, positions, meta, pool, attention, logits_idx)
        cfg = self.cfg
        x = F.embedding(input_ids, self.embed)
        if self.embed_scale is not None:
            x = x * self.embed_scale
        rope = {t: tuple(c.unsqueeze(1) for c in r.cos_sin(positions, self.dtype)) for t, r in self.rotaries.items()}
        metas = _metas_by_window(meta, {lw["window"] for lw in self.layers})
        for i, lw in enumerate(self.layers):
            h = self.norm(x, lw["in_norm"], cfg.rms_norm_eps)
            a = self._attention(i, lw, h, rope[lw["rope"]], metas[lw["window"]], pool, attention)
            if cfg.sandwich_norms:
                a = self.norm(a, lw["attn_out_norm"], cfg.rms_norm_eps)
            x = x + a
            h = lw["mlp"](self.norm(x, lw["mlp_norm"], cfg.rms_norm_eps))
            if cfg.sandwich_norms:
                h = self.norm(h, lw["mlp_out_norm"], cfg.rms_norm_eps)
            x = x + h
        x = self.norm(x[logits_idx], self.final_norm, cfg.rms_norm_eps)
        logits = self.logits(x)
        if cfg.final_softcap:  # in the model dtype, as transformers
            logits = torch.tanh(logits / cfg.final_softcap) * cfg.final_softcap
        return logits.float()

    def _attention(self, i: int, lw: dict, h: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
                   meta: AttentionMetadata, pool: DevicePagePool, attention) -> torch.Tensor:
        cfg = self.cfg
        n = h.shape[0]
        cos, sin = cos_sin
        q, k, v = lw["qkv"](h).split(self.qkv_sizes, dim=-1)
        q = q.view(n, cfg.num_heads, cfg.head_dim)
        k = k.view(n, cfg.num_kv_heads, cfg.head_dim)
        v = v.reshape(n, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:  # Qwen3, Gemma 3: per head, before rope
            q = self.norm(q, lw["q_norm"], cfg.rms_norm_eps)
            k = self.norm(k, lw["k_norm"], cfg.rms_norm_eps)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        k_cache, v_cache = pool.layer(i)
        attention.write_cache(k_cache, v_cache, k, v, meta)
        if cfg.attn_softcap:
            a = softcapped_attention(q, k_cache, v_cache, meta, cfg.num_kv_heads, self.scale, cfg.attn_softcap)
        else:
            a = attention.forward(q, k_cache, v_cache, meta)
        return lw["o"](a.reshape(n, cfg.num_heads * cfg.head_dim))


    def _forward_fused(self, ops, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                       pool: DevicePagePool, attention, logits_idx: torch.Tensor) -> torch.Tensor:
        """forward with the fused CPU ops: the residual stream x is updated in place, and each layer's last add
        goes into the next layer's norm (one pass over x per norm)."""
        eps = self.cfg.rms_norm_eps
        x = F.embedding(input_ids, self.embed)
        rope = {t: r.cos_sin(positions, self.dtype) for t, r in self.rotaries.items()}  # [T, D] each
        metas = _metas_by_window(meta, {lw["window"] for lw in self.layers})
        layers = self.layers
        h = ops.rms_norm(x, layers[0]["in_norm"], eps)
        for i, lw in enumerate(layers):
            a = self._attention_fused(ops, i, lw, h, rope[lw["rope"]], metas[lw["window"]], pool, attention)
            h = ops.add_rms_norm(x, a, lw["mlp_norm"], eps)  # x += a
            mlp = lw["mlp"]
            if isinstance(mlp, DenseMlp) and self.act is F.silu:
                m = mlp.down(ops.silu_mul(mlp.gate_up(h)))
            else:
                m = mlp(h)
            if i + 1 < len(layers):
                h = ops.add_rms_norm(x, m, layers[i + 1]["in_norm"], eps)  # x += m
            else:
                x.add_(m)
        logits = self.logits(ops.rms_norm(x[logits_idx], self.final_norm, eps))
        if self.cfg.final_softcap:
            logits = torch.tanh(logits / self.cfg.final_softcap) * self.cfg.final_softcap
        return logits.float()

    def _attention_fused(self, ops, i: int, lw: dict, h: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
                         meta: AttentionMetadata, pool: DevicePagePool, attention) -> torch.Tensor:
        cfg = self.cfg
        n = h.shape[0]
        q, k, v = lw["qkv"](h).split(self.qkv_sizes, dim=-1)
        q = q.view(n, cfg.num_heads, cfg.head_dim)
        k = k.view(n, cfg.num_kv_heads, cfg.head_dim)
        v = v.view(n, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q = self.norm(q, lw["q_norm"], cfg.rms_norm_eps)
            k = self.norm(k, lw["k_norm"], cfg.rms_norm_eps)
        k_cache, v_cache = pool.layer(i)
        cos, sin = cos_sin
        if (getattr(attention, "plain_cache_writes", False) and isinstance(k_cache, torch.Tensor)
                and k_cache.dtype == torch.float32):
            q = ops.rotary_write(q, k, v, cos, sin, k_cache, v_cache, meta.slot_pages, meta.slot_offsets)
        else:  # (8-bit pages, or a backend with writes of its own)
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            attention.write_cache(k_cache, v_cache, k, v, meta)
        a = attention.forward(q, k_cache, v_cache, meta)
        return lw["o"](a.reshape(n, cfg.num_heads * cfg.head_dim))


def _metas_by_window(meta: AttentionMetadata, windows: set[int | None]) -> dict[int | None, AttentionMetadata]:
    """The step's metadata for each per-layer window (None: the step's own, which carries the model-wide
    window if any; 0: full attention). Each copy has its own decode groups, since a backend may cache a
    group's mask for the layers that share it."""
    out: dict[int | None, AttentionMetadata] = {None: meta}
    for window in windows - {None}:
        out[window] = dataclasses.replace(meta, sliding_window=window or None,
                                          decodes=[dataclasses.replace(g, mask=None) for g in meta.decodes])
    return out


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


# a multimodal checkpoint's language model tensors -> the names of a causal LM's (both layouts in use)
LANGUAGE_MODEL_PREFIXES = (("language_model.model.", "model."), ("model.language_model.", "model."),
                           ("language_model.lm_head.", "lm_head."), ("lm_head.", "lm_head."))


def _language_model_tensors(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The language model's tensors under causal-LM names; the vision tower's and projector's are dropped."""
    out = {}
    for key, tensor in weights.items():
        for old, new in LANGUAGE_MODEL_PREFIXES:
            if key.startswith(old):
                out[new + key[len(old):]] = tensor
                break
    return out


def load_model(cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> LlamaModel:
    weights = _read_safetensors(cfg.path)
    if cfg.language_model_only:
        weights = _language_model_tensors(weights)
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


def _expert_modules(spec: MoeSpec, p: str, e: int) -> tuple[list[str], str]:
    """Expert e's (gate and up modules, down module) in layer prefix p, as the checkpoints name them."""
    if spec.mixtral_names:
        x = p + f"block_sparse_moe.experts.{e}."
        return [x + "w1", x + "w3"], x + "w2"
    x = p + f"mlp.experts.{e}."
    return [x + "gate_proj", x + "up_proj"], x + "down_proj"


def _router_name(spec: MoeSpec, p: str) -> str:
    return p + ("block_sparse_moe.gate.weight" if spec.mixtral_names else "mlp.gate.weight")


def _mlp_modules(cfg: ModelConfig, i: int, p: str) -> tuple[list[str], list[str]]:
    """(linear modules, plain tensors) of layer i's MLP or MoE block."""
    spec = cfg.moe
    if spec is None or not spec.sparse_layers[i]:
        return _fused_modules(cfg, p)[1] + [p + "mlp.down_proj"], []
    modules = []
    for e in range(spec.num_experts):
        gate_up, down = _expert_modules(spec, p, e)
        modules += gate_up + [down]
    tensors = [_router_name(spec, p)]
    if spec.shared_size:
        modules += [p + f"mlp.shared_expert.{n}_proj" for n in ("gate", "up", "down")]
        tensors.append(p + "mlp.shared_expert_gate.weight")
    return modules, tensors


def expected_tensors(cfg: ModelConfig) -> list[str]:
    """Every tensor the config implies, as transformers' modules would hold them."""
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not cfg.tie_word_embeddings:
        names.append("lm_head.weight")
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        if cfg.sandwich_norms:
            names += [p + "pre_feedforward_layernorm.weight", p + "post_feedforward_layernorm.weight"]
        if cfg.qk_norm:
            names += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
        qkv = _fused_modules(cfg, p)[0]
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
