"""What ``decode_layers`` (cpu_decode.cpp) takes when it runs every decoder layer of a decode-only step in one call:
which models it serves (float32, every linear our float32 or 4-bit product or torch's int4 kernel on the CPU, SiLU
MLPs, one rotary table, no per-layer windows, q/k norms or score soft-capping) and the 22 tensors a layer hands it.
Whether a given step runs in that one call: ``LlamaModel.decode_stack`` (llama.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from executor_svc.model import cpu_linear
from executor_svc.model.moe import DenseMlp
from executor_svc.model.quant import Int4Linear

_NONE = torch.empty(0)


def stack_weights(model, ops) -> list[torch.Tensor] | None:
    """The weights of ``model`` (a LlamaModel) as ``ops.decode_layers`` takes them, 22 a layer, or None where it
    cannot take them."""
    cfg = model.cfg
    if (not hasattr(ops, "decode_layers") or model.dtype != torch.float32 or model.act is not F.silu
            or cfg.qk_norm or cfg.attn_softcap or len(model.rotaries) != 1
            or any(lw.window is not None for lw in model.layers)):
        return None
    out: list[torch.Tensor] = []
    for lw in model.layers:
        if (not isinstance(lw.mlp, DenseMlp)
                or getattr(lw.gate_up, "out_features", None) != 2 * cfg.intermediate_size):
            return None  # (an MoE layer, or a fusion split into parts: _Concat)
        out += [lw.in_norm, lw.mlp_norm]
        for lin in (lw.qkv, lw.o, lw.gate_up, lw.down):
            tensors = linear_tensors(lin, model.dtype)
            if tensors is None:
                return None
            out += tensors
    return out


def linear_tensors(lin, dtype: torch.dtype) -> list[torch.Tensor] | None:
    """A linear as decode_layers takes it (cpu_decode.cpp: weight, aux, aux2, perm, bias), or None where it cannot:
    our float32 product's panels, our 4-bit product's, or torch's int4 product on the CPU, in a float32 model."""
    bias = _NONE if lin.bias is None else lin.bias
    if isinstance(lin, cpu_linear.PackedLinear) and lin.ops is not None:
        return [lin.packed, _NONE, _NONE, _NONE, bias]
    if not isinstance(lin, Int4Linear) or lin.dtype != dtype:
        return None
    perm = _NONE if lin.perm is None else lin.perm
    if lin.ours is not None:
        return [lin.packed, lin.zeros, lin.scales, perm, bias]
    if lin.mm is torch.ops.aten._weight_int4pack_mm_for_cpu:
        return [lin.packed, lin.scales_and_zeros, _NONE, perm, bias]
    return None
