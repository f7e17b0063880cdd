"""Float32 and bfloat16 linears on the CPU through oneDNN, the weight reordered once at load (as vLLM's CPU backend
does with its ``onednn_mm``): y = x @ W.T + b.

torch's float32 ``F.linear`` on the CPU calls MKL's sgemm. On the AMD EPYC (AVX2) this project runs on, MKL takes
the decode-sized products (a few to a few dozen rows) 1.5-5x slower than oneDNN over a prepacked weight, and the
49k-row lm_head at batch 1 at half the memory bandwidth (bench/NOTES.md, session 11). And MKL's rows depend on the
batch: a row's output differs between a product of fewer than 16 rows and one of more. oneDNN's do not (each row
of x gives the same bits whatever else is in the batch; tests/unit/test_cpu_linear.py), so a request's tokens do
not depend on what it was batched with -- with one exception: on an AVX-512 AMD EPYC, oneDNN takes a lone row
(M = 1) through another kernel whose sums differ in the last bits for K = 1,536 (SmolLM2's down projection). A
lone row is therefore computed as two (the row twice), which goes through the batched kernel: at batch 1 the
weight read dominates, so the second row costs ~5% of the product.

In bfloat16 (where oneDNN has a bfloat16 kernel for this CPU: AVX512-BF16, AMX) the prepacked product runs 1.5-2x
torch's ``F.linear`` here (AMX, SmolLM2's shapes: 1,330 against 780 GFLOP/s at 32 rows, 3,060 against 2,520 at
512; bench/NOTES.md "Session 14"), ~4-8x the float32 rate. Its rows are not batch-independent (oneDNN picks
another kernel by row count, as torch's bfloat16 ``F.linear`` does): 16-bit results are held to the reference
within tolerance, never bit for bit.

``PAGEDKV_CPU_ATTENTION=reference`` (the same switch that turns the CPU kernel library off) keeps torch's
``F.linear``: the reference path.
"""

from __future__ import annotations

import os

import torch


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
    """y = x @ W.T + b over a float32 or bfloat16 weight in oneDNN's blocked layout (made once; the original is not
    kept)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.out_features, self.in_features = weight.shape
        # NOTE: no batch-size hint: the layout is then the same for every batch size, and so is each row's result.
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)
        self.bias = bias
        # A lone float32 row goes through the batched kernel (its bits then do not depend on the batch); bfloat16's
        # rows depend on it whatever is done, and a lone row goes straight through.
        self.lone_as_two = weight.dtype == torch.float32

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.shape[0] == 1 and self.lone_as_two:  # (the module docstring)
            return torch.ops.mkldnn._linear_pointwise(x.expand(2, -1).contiguous(), self.packed, self.bias,
                                                      "none", [], "")[:1]
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def nbytes(self) -> int:
        bias = 0 if self.bias is None else self.bias.numel() * self.bias.element_size()
        return self.packed.numel() * self.packed.element_size() + bias

