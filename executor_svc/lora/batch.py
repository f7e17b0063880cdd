"""One step's LoRA: which flat rows use which adapter (``LoraBatch``, built once per step by ``lora_batch``) and the
deltas added after each targeted linear (``LoraLinear``), for rows of several adapters and the base model at once.

SGMV-style on torch ops, never a loop over adapters: the adapter rows are sorted by slot into S segments (one per
adapter the step uses), padded to the longest (L rows), gathered to x_seg [S, L, in]; then

    shrink = bmm(x_seg, A_stack[seg])               [S, L, M * R]   (M targeted modules of the fused linear)
    delta_m = bmm(shrink[..., m], B_stack_m[seg]) * scale[seg]   [S, L, out_m]

and each delta's real rows are added (index_add_) into their rows of the linear's output slice. Padding rows
compute and are dropped; rows of the base model are never touched. A step without adapter rows has no LoraBatch,
and the model runs exactly as without LoRA (its fast paths included).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from executor_svc.lora.stack import LinearLora, LoraStack
from executor_svc.model.decoder_layer import DecoderLayer
from executor_svc.model.moe import DenseMlp


@dataclasses.dataclass(slots=True, eq=False)
class LoraBatch:
    stack: LoraStack
    seg: torch.Tensor  # [S] the segments' adapter rows in the stack (slot - 1)
    gather: torch.Tensor  # [S, L] flat row of each segment entry (padding repeats the segment's first row)
    src: torch.Tensor  # [M] real entries' indices in gather.view(-1)
    dst: torch.Tensor  # [M] their flat rows (gather.view(-1)[src])
    scale: torch.Tensor  # [S, 1, 1] fp32

    def delta(self, lin: LinearLora, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y`` (the fused linear's output for ``x``) with each adapter row's LoRA delta added in place."""
        seg = self.seg
        shrunk = torch.bmm(x[self.gather], lin.shrink[seg])  # [S, L, M * R]
        r = self.stack.rank
        for j, (offset, width) in enumerate(lin.slices):
            d = torch.bmm(shrunk[..., j * r:(j + 1) * r], lin.expand[j][seg]).mul_(self.scale)
            y.narrow(-1, offset, width).index_add_(0, self.dst, d.reshape(-1, width)[self.src])
        return y

    def layers(self, layers: list[DecoderLayer]) -> list[DecoderLayer]:
        """The model's layers for this step: each targeted linear wrapped to add its deltas (a shallow copy per layer;
        the model's own are untouched)."""
        out = []
        for lw, here in zip(layers, self.stack.layers):
            if not here:
                out.append(lw)
                continue
            wrap = {k: LoraLinear(getattr(lw, k), here[k], self) for k in ("qkv", "o") if k in here}
            if isinstance(lw.mlp, DenseMlp) and ("gate_up" in here or "down" in here):
                gate_up = LoraLinear(lw.mlp.gate_up, here["gate_up"], self) if "gate_up" in here else lw.mlp.gate_up
                down = LoraLinear(lw.mlp.down, here["down"], self) if "down" in here else lw.mlp.down
                wrap.update(mlp=DenseMlp(gate_up, down, lw.mlp.act), gate_up=gate_up, down=down)
            out.append(dataclasses.replace(lw, **wrap))
        return out



class LoraLinear:
    """A base linear (any of quant.py's or cpu_linear.py's) and this step's deltas after it."""

    __slots__ = ("base", "lin", "batch")

    def __init__(self, base: Callable, lin: LinearLora, batch: LoraBatch) -> None:
        self.base, self.lin, self.batch = base, lin, batch

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.batch.delta(self.lin, x, self.base(x))


def lora_batch(stack: LoraStack | None, row_slots: list[int], device: torch.device) -> LoraBatch | None:
    """The LoraBatch of a step whose flat rows use ``row_slots`` (0: the base model); None when no row uses an
    adapter."""
    if stack is None or not any(row_slots):
        return None
    slots = torch.tensor(row_slots, dtype=torch.long)
    rows = torch.nonzero(slots, as_tuple=True)[0]
    order = torch.argsort(slots[rows], stable=True)
    rows, used = rows[order], slots[rows][order]
    seg_slots, counts = torch.unique_consecutive(used, return_counts=True)
    s, width = len(seg_slots), int(counts.max())
    starts = torch.cumsum(counts, 0) - counts
    col = torch.arange(width)
    real = col[None, :] < counts[:, None]  # [S, L]
    pick = starts[:, None] + torch.where(real, col[None, :], 0)  # (padding: the segment's first row)
    gather = rows[pick]
    src = torch.nonzero(real.reshape(-1), as_tuple=True)[0]
    seg = seg_slots - 1
    return LoraBatch(stack, seg.to(device), gather.to(device), src.to(device), gather.reshape(-1)[src].to(device),
                     stack.scales[seg.to(stack.scales.device)].view(s, 1, 1))


def step_row_slots(counts_and_slots: list[tuple[int, int]]) -> list[int]:
    """Each flat row's adapter slot, from the step's (token count, slot) per request in plan order (batch.py lays
    each request's tokens out in that order)."""
    out: list[int] = []
    for count, slot in counts_and_slots:
        out += [slot] * count
    return out

