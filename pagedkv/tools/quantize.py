"""4-bit checkpoints (AWQ GEMM / GPTQ) made from a float one, for tests and benchmarks: by round-to-nearest, or,
given calibration text, by GPTQ's error-compensating rounding (pagedkv.tools.gptq)."""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path

AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ: nibble i of a word holds output AWQ_PACK_ORDER[i] of its 8
QUANTIZED_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                     "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
                     "self_attn.qkv_proj", "mlp.gate_up_proj")  # Phi-3's fused ones, quantized whole (AutoAWQ)


def quantize_checkpoint(src: Path, out_dir: Path, *, method: str = "gptq", group_size: int = 128,
                        desc_act: bool = False, sym: bool = True, checkpoint_format: str = "gptq",
                        seed: int = 0, reference_dir: Path | None = None, lm_head: bool = False,
                        calibration: Sequence[Sequence[int]] | None = None) -> Path:
    """Writes src's decoder linears as a 4-bit AWQ (GEMM) or GPTQ checkpoint: the tensors (qweight, qzeros,
    scales, g_idx) and config.json ``quantization_config`` that AutoAWQ / AutoGPTQ write, from plain
    round-to-nearest (no calibration: the point is the format). ``desc_act`` puts the inputs into groups in
    a random order, as GPTQ's activation order does, recorded in g_idx. ``reference_dir``, when given, gets
    an ordinary float32 checkpoint holding exactly the dequantized weights ((q - zero) * scale, computed
    here from the integers before packing), which transformers can run as the reference. ``lm_head`` (GPTQ only,
    as GPTQModel's ``lm_head=True``) quantizes the head too: a tied head becomes lm_head's own 4-bit tensors beside
    the float embedding, and both configs say ``tie_word_embeddings: false``. ``calibration`` (token id sequences;
    GPTQ without desc_act only) replaces round-to-nearest by GPTQ over the Hessians of those tokens' inputs to
    each linear (pagedkv.tools.gptq), as AutoGPTQ / GPTQModel calibrate."""
    import json

    import torch
    from safetensors.torch import load_file, save_file

    if method not in ("awq", "gptq"):
        raise ValueError(f"method must be 'awq' or 'gptq', got {method!r}")
    if lm_head and method != "gptq":
        raise ValueError("lm_head: only GPTQ checkpoints quantize the head")
    if calibration is not None and (method != "gptq" or desc_act):
        raise ValueError("calibration: GPTQ without desc_act only")
    src, out_dir = Path(src), Path(out_dir)
    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    config = json.loads((src / "config.json").read_text())
    if lm_head and "lm_head.weight" not in tensors:  # tied: the head's own copy of the embedding, quantized below
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    if lm_head and tensors["lm_head.weight"].shape[0] % 8:
        raise ValueError(f"lm_head: {tensors['lm_head.weight'].shape[0]} outputs (the vocabulary) are not a multiple "
                         "of 8, which GPTQ's packed zeros need")
    gen = torch.Generator().manual_seed(seed)
    chosen = {n.removesuffix(".weight") for n in tensors
              if (lm_head and n == "lm_head.weight") or (n.endswith(".weight") and _quantized_linear(
                  n.removesuffix(".weight").split(".", 3)[-1]))}
    if calibration is not None:
        from pagedkv.tools import gptq
    hess = None if calibration is None else gptq.hessians(src, calibration, chosen)
    packed: dict[str, torch.Tensor] = {}
    reference: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        module = name.removesuffix(".weight")
        head = lm_head and name == "lm_head.weight"
        if not head and not (name.endswith(".weight") and _quantized_linear(module.split(".", 3)[-1])):
            packed[name] = reference[name] = t.contiguous()
            continue
        if hess is None:
            q, zeros, scales, g_idx = _round_to_nearest(t.float(), method, group_size, desc_act, sym, gen)
        else:
            q, zeros, scales, g_idx = gptq.quantize(t.float(), hess[module], group_size, sym)
        reference[name] = ((q - zeros[g_idx].T) * scales.float()[g_idx].T).contiguous()
        if method == "awq":
            packed[module + ".qweight"] = _pack_last(q.T, AWQ_PACK_ORDER)
            packed[module + ".qzeros"] = _pack_last(zeros, AWQ_PACK_ORDER)
        else:
            packed[module + ".qweight"] = _pack_last(q.contiguous(), tuple(range(8))).T.contiguous()
            stored = zeros - 1 if checkpoint_format == "gptq" else zeros  # AutoGPTQ's v1 stores zero - 1
            packed[module + ".qzeros"] = _pack_last(stored, tuple(range(8)))
            packed[module + ".g_idx"] = g_idx.to(torch.int32)
        packed[module + ".scales"] = scales
    out_dir.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name != "config.json" and f.is_file():
            shutil.copy(f, out_dir / f.name)
    if lm_head:
        config["tie_word_embeddings"] = False
    if reference_dir is not None:
        reference_dir = Path(reference_dir)
        shutil.copytree(out_dir, reference_dir, dirs_exist_ok=True)
        (reference_dir / "config.json").write_text(json.dumps(config, indent=2))
        save_file(reference, str(reference_dir / "model.safetensors"), metadata={"format": "pt"})
    if method == "awq":  # as AutoAWQ writes it
        qc = {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm",
              "modules_to_not_convert": None}
    else:  # as AutoGPTQ / optimum write it
        qc = {"quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": desc_act, "sym": sym,
              "damp_percent": 0.01, "true_sequential": True, "static_groups": False,
              "checkpoint_format": checkpoint_format, "model_name_or_path": None, "model_file_base_name": None,
              "lm_head": lm_head}
    config["quantization_config"] = qc
    config["torch_dtype"] = "float16"
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    save_file(packed, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir


def _quantized_linear(name: str) -> bool:
    """A decoder linear the tools quantize (name below model.layers.N.): attention, MLP, each MoE expert and
    Qwen2-MoE's shared expert; never a router (mlp.gate, block_sparse_moe.gate) or shared_expert_gate."""
    import re

    experts = r"block_sparse_moe\.experts\.\d+\.w[123]|mlp\.(experts\.\d+|shared_expert)\.(gate|up|down)_proj"
    return name in QUANTIZED_LINEARS or re.fullmatch(experts, name) is not None


def _round_to_nearest(w, method: str, group_size: int, desc_act: bool, sym: bool, gen):
    """w [N, K] -> (q [N, K] 0..15, zeros [G, N], fp16 scales [G, N], g_idx [K]) with
    w ~= (q - zeros[g_idx].T) * scales[g_idx].T."""
    import torch

    n, k = w.shape
    group = k if group_size == -1 else group_size
    order = torch.randperm(k, generator=gen) if desc_act else torch.arange(k)
    g_idx = torch.empty(k, dtype=torch.int64)
    g_idx[order] = torch.arange(k) // group  # the i-th input in activation order goes to group i // group
    groups = -(-k // group)
    q = torch.empty(n, k)
    zeros = torch.empty(groups, n)
    scales = torch.empty(groups, n, dtype=torch.float16)
    for g in range(groups):
        cols = (g_idx == g).nonzero().flatten()
        wg = w[:, cols]
        if method == "gptq" and sym:
            top = wg.abs().amax(1).clamp(min=1e-5)
            scale, zero = (2 * top / 15).half(), torch.full((n,), 8.0)
        else:
            lo, hi = wg.amin(1).clamp(max=0), wg.amax(1).clamp(min=0)
            scale = ((hi - lo).clamp(min=1e-5) / 15).half()
            # GPTQ v1 stores zero - 1 in 4 bits, so a zero of 0 cannot be written: keep it >= 1
            zero = (-lo / scale.float()).round().clamp(1 if method == "gptq" else 0, 15)
        q[:, cols] = (wg / scale.float()[:, None]).round().add(zero[:, None]).clamp(0, 15)
        zeros[g], scales[g] = zero, scale
    return q.to(torch.int64), zeros.to(torch.int64), scales, g_idx


def _pack_last(values, order: tuple[int, ...]):
    """int [R, 8C] -> int32 [R, C]: nibble i of word c holds values[:, 8c + order[i]]."""
    import torch

    r, cols = values.shape
    grouped = values.reshape(r, cols // 8, 8)[:, :, list(order)].to(torch.int64)
    words = (grouped << torch.arange(0, 32, 4, dtype=torch.int64)).sum(-1)
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)
