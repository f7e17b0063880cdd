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
embedding from the same inverse frequencies, fp32 softmax) so greedy output is token-exact. The norms, activations
and rotary tables are layers.py's; which tensors a checkpoint holds and how they are read, checkpoint.py's.
"""

from __future__ import annotations

import dataclasses

import structlog
import torch
import torch.nn.functional as F

from executor_svc.attention import cascade
from executor_svc.attention.metadata import AttentionMetadata
from executor_svc.model import cpu_linear, step_path
from executor_svc.model.checkpoint import (
    expected_tensors,
    expert_modules,
    fused_modules,
    language_model_tensors,
    read_safetensors,
    router_name,
)
from executor_svc.model.decoder_layer import DecoderLayer
from executor_svc.model.layers import ACTIVATIONS, Rotary, gemma_norm, rms_norm, rotate_half
from executor_svc.model.moe import DenseMlp, MoeMlp
from executor_svc.model.quant import DenseLinear, build_int4, unpack_linear
from executor_svc.model.quant_config import quant_tensor_names
from executor_svc.model.softcap import softcapped_attention
from executor_svc.model.step_path import StepPath
from executor_svc.model_config import ModelConfig
from executor_svc.pages import DevicePagePool


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
        self.norm = gemma_norm if cfg.gemma else rms_norm
        self.act = ACTIVATIONS[cfg.hidden_act]
        self.embed = w["model.embed_tokens.weight"]
        self.embed_scale = torch.tensor(cfg.hidden_size ** 0.5, dtype=dtype, device=device) if cfg.gemma else None
        self.final_norm = w["model.norm.weight"]
        self.packed = cpu_linear.available(device, dtype)  # float32/bfloat16 on the CPU: oneDNN linears (cpu_linear.py)
        # the logits' linear (a tied head packed is a copy of its own: the embedding lookup reads the original); a
        # GPTQ checkpoint's 4-bit head (quantization_config.lm_head) is its own tensors, tied or not
        if cfg.quantization is not None and cfg.quantization.lm_head:
            self.logits = self._linear(w, ["lm_head"], False)
        else:
            head = self.embed if cfg.tie_word_embeddings else w["lm_head.weight"]
            self.logits = cpu_linear.PackedLinear(head, None) if self.packed else DenseLinear(head, None)
        self.layers = [self._layer_weights(w, i) for i in range(cfg.num_layers)]
        del self.raw
        self.scale = cfg.attn_scale or cfg.head_dim ** -0.5
        self._fused = None  # fused_ops(), decided on the first forward
        self._path: StepPath | None = None  # step_path(), decided on the first forward over a backend and pool
        self.decode_in_one_call = True  # decode_layers where it applies (tests compare it with the Python loop)
        self.lora = None  # the served LoRA adapters (executor_svc/lora/stack.py's LoraStack), set at start-up
        self.qkv_sizes = [cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim,
                          cfg.num_kv_heads * cfg.head_dim]

    def _layer_weights(self, w: dict[str, torch.Tensor], i: int) -> DecoderLayer:
        """One layer's norms and linears, with q/k/v and gate/up fused into single matmuls. Biases are taken
        exactly where the config has them (as transformers builds its Linear layers), never just because a
        tensor is in the file."""
        cfg = self.cfg
        p = f"model.layers.{i}."
        qkv, gate_up = fused_modules(cfg, p)
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
        return DecoderLayer(**out)

    def _moe(self, w: dict[str, torch.Tensor], p: str) -> MoeMlp:
        spec = self.cfg.moe
        experts = []
        for e in range(spec.num_experts):
            gate_up, down = expert_modules(spec, p, e)
            experts.append((self._linear(w, gate_up, False), self._linear(w, [down], False)))
        shared = gate = None
        if spec.shared_size:
            s = p + "mlp.shared_expert."
            shared = (self._linear(w, [s + "gate_proj", s + "up_proj"], False),
                      self._linear(w, [s + "down_proj"], False))
            gate = w[p + "mlp.shared_expert_gate.weight"]
        return MoeMlp(spec, w[router_name(spec, p)], experts, self.act, shared, gate)

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
        linears = sum(lin.nbytes() for lw in self.layers for lin in [lw.qkv, lw.o, *lw.mlp.linears()])
        other = [self.embed, self.final_norm] + [t for lw in self.layers for t in lw.mlp.tensors()]
        other += [t for lw in self.layers for t in lw.norms()]
        head = 0 if getattr(self.logits, "weight", None) is self.embed else self.logits.nbytes()  # (tied in place)
        return {"linears": linears, "other": sum(t.numel() * t.element_size() for t in other) + head}

    def fused_ops(self):
        """``torch.ops.pagedkv_cpu`` when this model runs its layers with the fused CPU ops (cpu_ops.cpp: RMSNorm,
        residual add + RMSNorm, rotary + cache write, SiLU x up), else None: a float32 or bfloat16 model on the CPU
        with Llama's norms (not Gemma's), once the CPU kernel library loads. Its torch ops stay the reference (and
        the path of every other dtype and device); PAGEDKV_CPU_ATTENTION=reference turns both off."""
        if self._fused is None:
            ops = None
            if self.device.type == "cpu" and self.dtype in (torch.float32, torch.bfloat16) and not self.cfg.gemma \
                    and not self.cfg.sandwich_norms:
                from executor_svc.attention import cpu_kernel

                ops = cpu_kernel.load()
            self._fused = ops if ops is not None and hasattr(ops, "add_rms_norm") else False
        return self._fused or None

    def step_path(self, attention, pool: DevicePagePool) -> StepPath:
        """How steps over this backend and pool run (step_path.py): decided on the first, kept for the next."""
        path = self._path
        if path is None or path.attention is not attention or path.pool is not pool:
            path = self._path = step_path.decide(self, attention, pool)
        return path

    def decode_stack(self, meta: AttentionMetadata, pool: DevicePagePool, attention) -> list | None:
        """The weights ``decode_layers`` (cpu_decode.cpp) takes, 22 a layer, when this step's layers run in that one
        call: a float32 model whose every linear is our float32 or 4-bit product or torch's int4 kernel
        (cpu_linear.py, quant.py), SiLU MLPs, one rotary table, no per-layer windows, q/k norms or score
        soft-capping, attended in place by the torch backend (the StepPath's ``stack``); and a decode-only step in
        one group without per-request windows, its shared prefix (if it has one) attended by the kernel library
        (shared_in_kernel). Else None: the Python loop (_forward_fused), which runs the same ops in the same order."""
        path = self.step_path(attention, pool)
        stack = path.stack
        if (stack is None or not self.decode_in_one_call or not meta.one_decode_group
                or meta.decodes[0].windows is not None):
            return None
        group = meta.decodes[0]
        if group.shared_pages is None:
            group.shared_pages = cascade.shared_prefix(group, pool.block_size, meta.sliding_window or 0)
        if group.shared_pages.numel() and not path.stack_shared:
            return None
        return stack

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                pool: DevicePagePool, attention, logits_idx: torch.Tensor, lora=None) -> torch.Tensor:
        """One flattened step: input_ids/positions [T]; returns fp32 logits for the rows in logits_idx. ``lora``: the
        step's adapter rows (executor_svc/lora/batch.py's LoraBatch; None: none, and nothing changes): their layers
        add the deltas, and such a step always runs the layer loop (decode_layers cannot add them)."""
        path = self.step_path(attention, pool)
        layers = self.layers if lora is None else lora.layers(self.layers)
        if path.ops is not None:
            return self._forward_fused(path, input_ids, positions, meta, pool, attention, logits_idx, layers)
        cfg = self.cfg
        x = F.embedding(input_ids, self.embed)
        if self.embed_scale is not None:
            x = x * self.embed_scale
        rope = {t: tuple(c.unsqueeze(1) for c in r.cos_sin(positions, self.dtype)) for t, r in self.rotaries.items()}
        metas = _metas_by_window(meta, path.windows)
        for i, lw in enumerate(layers):
            h = self.norm(x, lw.in_norm, cfg.rms_norm_eps)
            a = self._attention(i, lw, h, rope[lw.rope], metas[lw.window], pool, attention)
            if cfg.sandwich_norms:
                a = self.norm(a, lw.attn_out_norm, cfg.rms_norm_eps)
            x = x + a
            h = lw.mlp(self.norm(x, lw.mlp_norm, cfg.rms_norm_eps))
            if cfg.sandwich_norms:
                h = self.norm(h, lw.mlp_out_norm, cfg.rms_norm_eps)
            x = x + h
        x = self.norm(x[logits_idx], self.final_norm, cfg.rms_norm_eps)
        logits = self.logits(x)
        if cfg.final_softcap:  # in the model dtype, as transformers
            logits = torch.tanh(logits / cfg.final_softcap) * cfg.final_softcap
        return logits.float()

    def _attention(self, i: int, lw: DecoderLayer, h: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
                   meta: AttentionMetadata, pool: DevicePagePool, attention) -> torch.Tensor:
        cfg = self.cfg
        n = h.shape[0]
        cos, sin = cos_sin
        q, k, v = lw.qkv(h).split(self.qkv_sizes, dim=-1)
        q = q.view(n, cfg.num_heads, cfg.head_dim)
        k = k.view(n, cfg.num_kv_heads, cfg.head_dim)
        v = v.reshape(n, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:  # Qwen3, Gemma 3: per head, before rope
            q = self.norm(q, lw.q_norm, cfg.rms_norm_eps)
            k = self.norm(k, lw.k_norm, cfg.rms_norm_eps)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        if pool.key_rotation is not None:  # pages that hold rotated keys (FP8: kv_quant.key_rotation)
            q, k = q @ pool.key_rotation[0], k @ pool.key_rotation[1]
        k_cache, v_cache = pool.layer(i)
        attention.write_cache(k_cache, v_cache, k, v, meta)
        if cfg.attn_softcap:
            a = softcapped_attention(q, k_cache, v_cache, meta, cfg.num_kv_heads, self.scale, cfg.attn_softcap)
        else:
            a = attention.forward(q, k_cache, v_cache, meta)
        return lw.o(a.reshape(n, cfg.num_heads * cfg.head_dim))


    def _forward_fused(self, path: StepPath, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                       pool: DevicePagePool, attention, logits_idx: torch.Tensor, layers: list) -> torch.Tensor:
        """forward with the fused CPU ops: the residual stream x is updated in place, and each layer's last add
        goes into the next layer's norm (one pass over x per norm)."""
        eps, ops = self.cfg.rms_norm_eps, path.ops
        x = F.embedding(input_ids, self.embed)
        stack = self.decode_stack(meta, pool, attention) if layers is self.layers else None  # (else: LoRA rows)
        if stack is not None:  # every layer in one call (cpu_decode.cpp): the same ops as the loop below
            cos, sin = next(iter(self.rotaries.values())).cos_sin(positions, self.dtype)
            group = meta.decodes[0]
            cfg = self.cfg
            ops.decode_layers(x, stack, pool.k_views, pool.v_views, group.page_tables, group.query_positions(),
                              group.shared_pages, cos, sin, meta.slot_pages, meta.slot_offsets, cfg.num_heads,
                              cfg.num_kv_heads, cfg.intermediate_size, meta.sliding_window or 0, eps, self.scale)
            return self._logits(ops, x, logits_idx)
        rope = {t: r.cos_sin(positions, self.dtype) for t, r in self.rotaries.items()}  # [T, D] each
        metas = _metas_by_window(meta, path.windows)
        h = ops.rms_norm(x, layers[0].in_norm, eps)
        for i, lw in enumerate(layers):
            a = self._attention_fused(path, i, lw, h, rope[lw.rope], metas[lw.window], pool, attention)
            h = ops.add_rms_norm(x, a, lw.mlp_norm, eps)  # x += a
            mlp = lw.mlp
            if path.silu_mlps[i]:
                m = mlp.down(ops.silu_mul(mlp.gate_up(h)))
            else:
                m = mlp(h)
            if i + 1 < len(layers):
                h = ops.add_rms_norm(x, m, layers[i + 1].in_norm, eps)  # x += m
            else:
                x.add_(m)
        return self._logits(ops, x, logits_idx)

    def _logits(self, ops, x: torch.Tensor, logits_idx: torch.Tensor) -> torch.Tensor:
        logits = self.logits(ops.rms_norm(x[logits_idx], self.final_norm, self.cfg.rms_norm_eps))
        if self.cfg.final_softcap:
            logits = torch.tanh(logits / self.cfg.final_softcap) * self.cfg.final_softcap
        return logits.float()

    def _attention_fused(self, path: StepPath, i: int, lw: DecoderLayer, h: torch.Tensor,
                         cos_sin: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata, pool: DevicePagePool,
                         attention) -> torch.Tensor:
        cfg = self.cfg
        n = h.shape[0]
        q, k, v = lw.qkv(h).split(self.qkv_sizes, dim=-1)
        q = q.view(n, cfg.num_heads, cfg.head_dim)
        k = k.view(n, cfg.num_kv_heads, cfg.head_dim)
        v = v.view(n, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q = self.norm(q, lw.q_norm, cfg.rms_norm_eps)
            k = self.norm(k, lw.k_norm, cfg.rms_norm_eps)
        k_cache, v_cache = pool.layer(i)
        cos, sin = cos_sin
        if path.rotary_write:
            q = path.ops.rotary_write(q, k, v, cos, sin, k_cache, v_cache, meta.slot_pages, meta.slot_offsets)
        else:  # (8-bit pages, or a backend with writes of its own)
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            if pool.key_rotation is not None:  # (FP8 pages hold rotated keys: kv_quant.key_rotation)
                q, k = q @ pool.key_rotation[0], k @ pool.key_rotation[1]
            attention.write_cache(k_cache, v_cache, k, v, meta)
        a = attention.forward(q, k_cache, v_cache, meta)
        return lw.o(a.reshape(n, cfg.num_heads * cfg.head_dim))


def _metas_by_window(meta: AttentionMetadata, windows: frozenset[int | None]) -> dict[int | None, AttentionMetadata]:
    """The step's metadata for each per-layer window (None: the step's own, which carries the model-wide
    window if any; 0: full attention). Each copy has its own decode groups, since a backend may cache a
    group's mask for the layers that share it."""
    out: dict[int | None, AttentionMetadata] = {None: meta}
    for window in windows - {None}:
        out[window] = dataclasses.replace(meta, sliding_window=window or None,
                                          decodes=[dataclasses.replace(g, mask=None) for g in meta.decodes])
    return out


def load_model(cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> LlamaModel:
    weights = read_safetensors(cfg.path)
    if cfg.language_model_only:
        weights = language_model_tensors(weights)
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

