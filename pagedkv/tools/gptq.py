"""GPTQ (Frantar et al., 2022): 4-bit weights chosen column by column so that each column's rounding error is
compensated on the columns not yet quantized, through the inverse Hessian of the layer's inputs
(H = 2 X^T X over calibration tokens). Used by pagedkv.tools.quantize when it is given calibration text; without
it the tools round to nearest.

The Hessians are gathered in one float32 pass of the source model through transformers (every linear sees the
float model's own inputs, not the already-quantized ones of the layers before it: GPTQ's non-sequential form).
The output has _round_to_nearest's shapes and meaning, so packing, the reference checkpoint and the config are
shared: ``w ~= (q - zeros[g_idx].T) * scales[g_idx].T``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

DAMP = 0.01  # of the mean diagonal, added to H's diagonal (AutoGPTQ's damp_percent)
BLOCK = 128  # columns updated lazily together (the paper's batched update)


def hessians(src: Path, sequences: Sequence[Sequence[int]], names: set[str]) -> dict[str, torch.Tensor]:
    """module name -> H = 2/n sum(x x^T) over every token of ``sequences`` at that linear's input (float64)."""
    from transformers import AutoModelForCausalLM

    if not sequences or not all(sequences):
        raise ValueError("calibration: give at least one sequence, none of them empty")
    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    model.eval()
    sums: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}

    def hook(name: str):
        def add(_module, inputs, _output) -> None:
            x = inputs[0].detach().reshape(-1, inputs[0].shape[-1]).double()
            sums[name] = sums.get(name, 0) + x.T @ x
            counts[name] = counts.get(name, 0) + x.shape[0]
        return add

    handles = [m.register_forward_hook(hook(n)) for n, m in model.named_modules()
               if n in names and isinstance(m, torch.nn.Linear)]
    missing = names - {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    if missing:
        raise ValueError(f"calibration: no linear named {sorted(missing)[:3]} in {src}")
    try:
        with torch.inference_mode():
            for seq in sequences:
                model(torch.tensor([list(seq)], dtype=torch.long))
    finally:
        for h in handles:
            h.remove()
    return {n: 2 * s / counts[n] for n, s in sums.items()}


def _grid(w: torch.Tensor, sym: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Per output row of a group [N, g]: (fp16-rounded scale [N], integer zero [N]) as _round_to_nearest picks them."""
    if sym:
        scale = (2 * w.abs().amax(1).clamp(min=1e-5) / 15).half().float()
        return scale, torch.full((w.shape[0],), 8.0, dtype=w.dtype)
    lo, hi = w.amin(1).clamp(max=0), w.amax(1).clamp(min=0)
    scale = ((hi - lo).clamp(min=1e-5) / 15).half().float()
    return scale, (-lo / scale).round().clamp(1, 15)  # (GPTQ v1 stores zero - 1: a zero of 0 cannot be written)


def quantize(w: torch.Tensor, h: torch.Tensor, group_size: int, sym: bool
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K], H [K, K] -> (q [N, K] 0..15, zeros [G, N], fp16 scales [G, N], g_idx [K]); groups in input order."""
    n, k = w.shape
    group = k if group_size == -1 else group_size
    if k % group:
        raise ValueError(f"GPTQ: {k} inputs are not a multiple of the group size {group}")
    w = w.float().clone()  # (float32 rounding, as round-to-nearest's; the inverse in float64)
    h = h.double().clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    h += DAMP * torch.diag(h).mean() * torch.eye(k, dtype=h.dtype)
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True).float()
    q = torch.empty(n, k, dtype=torch.int64)
    zeros = torch.empty(k // group, n, dtype=torch.int64)
    scales = torch.empty(k // group, n, dtype=torch.float16)
    scale = zero = None
    for b0 in range(0, k, BLOCK):
        b1 = min(b0 + BLOCK, k)
        wb, hb = w[:, b0:b1].clone(), hinv[b0:b1, b0:b1]
        err = torch.zeros_like(wb)
        for i in range(b1 - b0):
            col = b0 + i
            if col % group == 0:  # the group's grid from its columns as updated so far
                g_end = min(col + group, b1) - b0
                rest = w[:, b0 + g_end:col + group]  # (a group running past this block: not yet updated by it)
                scale, zero = _grid(torch.cat([wb[:, i:g_end], rest], 1), sym)
                zeros[col // group], scales[col // group] = zero.to(torch.int64), scale.half()
            qi = (wb[:, i] / scale).round().add(zero).clamp(0, 15)
            q[:, col] = qi.to(torch.int64)
            e = (wb[:, i] - (qi - zero) * scale) / hb[i, i]
            wb[:, i:] -= e[:, None] * hb[i, i:][None, :]
            err[:, i] = e
        w[:, b1:] -= err @ hinv[b0:b1, b1:]
    return q, zeros, scales, torch.arange(k) // group
