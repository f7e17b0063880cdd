"""Float32 and bfloat16 linears on the CPU, the weight packed once at load: y = x @ W.T + b.

Float32, on a CPU with AVX-512: our own product (cpu_gemm.cpp, torch.ops.pagedkv_cpu.linear_f32) over weight
panels of 32 output columns. Each output is one chain of fused multiply-adds over k in order, whatever the number
of rows, so a request's tokens do not depend on what it is batched with (tests/unit/test_cpu_linear.py checks
every row's bits against batch size). On a Zen 4 it reads the weights of a decode-sized product (1-8 rows) at ~31
GB/s where oneDNN's read them at 19-26, is 13% faster at 32 rows and level from 512 (bench/linear_f32.py): a
SmolLM2 decode step at batch 1 35.2 -> 23.5 ms, at batch 32 90.2 -> 71.4 ms (bench/NOTES.md, session 17).

Float32 elsewhere (AVX2 and older), or before the kernel library is built: oneDNN, the weight reordered once into
its blocked layout (as vLLM's CPU backend does with its ``onednn_mm``). torch's float32 ``F.linear`` calls MKL's
sgemm, which on an AMD EPYC (AVX2) took decode-sized products 1.5-5x slower and gave rows that depend on the batch
(bench/NOTES.md, session 11). oneDNN's rows do not, with one exception: on an AVX-512 AMD EPYC it takes a lone
row (M = 1) through another kernel whose sums differ in the last bits for K = 1,536, so a lone row is computed as
two (the row twice).

In bfloat16 (where oneDNN has a bfloat16 kernel for this CPU: AVX512-BF16, AMX) oneDNN's prepacked product runs
1.5-2x torch's ``F.linear`` here (AMX, SmolLM2's shapes: 1,330 against 780 GFLOP/s at 32 rows, 3,060 against 2,520
at 512; bench/NOTES.md "Session 14"), ~4-8x the float32 rate. Its rows are not batch-independent (oneDNN picks
another kernel by row count, as torch's bfloat16 ``F.linear`` does): 16-bit results are held to the reference
within tolerance, never bit for bit.

``PAGEDKV_CPU_ATTENTION=reference`` (the same switch that turns the CPU kernel library off) keeps torch's
``F.linear``: the reference path.
"""

from __future__ import annotations

import os
from typing import Any

import torch

_ours: list[Any] = []  # [torch.ops.pagedkv_cpu or None], decided once


def float32_kernel() -> Any | None:
    """``torch.ops.pagedkv_cpu`` where its float32 product is built (AVX-512), else None (oneDNN's is used)."""
    if not _ours:
        from executor_svc.attention import cpu_kernel

        ops = cpu_kernel.load()
        _ours.append(ops if ops is not None and ops.linear_f32_available() else None)
    return _ours[0]


def available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether float linears on ``device`` in ``dtype`` run as PackedLinear: float32, or bfloat16 where oneDNN
    supports it on this CPU, on the CPU, oneDNN built into torch, and the reference path not asked for."""
    if dtype == torch.bfloat16:
        supported = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
        if supported is None or not supported():
            return False
    elif dtype != torch.float32:
        return False
    return (device.type == "cpu" and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and os.environ.get("PAGEDKV_CPU_ATTENTION", "").lower() != "reference")


class PackedLinear:
    """y = x @ W.T + b over a float32 or bfloat16 weight packed once (the original is not kept): our float32
    product's panels where it is built, else oneDNN's blocked layout."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        self.ops = float32_kernel() if weight.dtype == torch.float32 else None
        if self.ops is not None:
            self.packed = self.ops.pack_linear_f32(weight.contiguous())
            self.bias = None if bias is None else bias.contiguous()
            self.lone_as_two = False
            return
        # NOTE: no batch-size hint: the layout is then the same for every batch size, and so is each row's result.
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)
        # A lone float32 row goes through the batched kernel (its bits then do not depend on the batch); bfloat16's
        # rows depend on it whatever is done, and a lone row goes straight through.
        self.lone_as_two = weight.dtype == torch.float32

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.ops is not None:
            if x.dim() == 2:
                return self.ops.linear_f32(x, self.packed, self.out_features, self.bias)
            y = self.ops.linear_f32(x.reshape(-1, self.in_features), self.packed, self.out_features, self.bias)
            return y.view(*x.shape[:-1], self.out_features)
        if x.dim() == 2 and x.shape[0] == 1 and self.lone_as_two:  # (the module docstring)
            return torch.ops.mkldnn._linear_pointwise(x.expand(2, -1).contiguous(), self.packed, self.bias,
                                                      "none", [], "")[:1]
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def nbytes(self) -> int:
        bias = 0 if self.bias is None else self.bias.numel() * self.bias.element_size()
        return self.packed.numel() * self.packed.element_size() + bias
