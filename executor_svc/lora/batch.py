"""One step's LoRA: which flat rows use which adapter (``LoraBatch``, built once per step by ``lora_batch``) and the
deltas added after each targeted linear (``LoraLinear``), for rows of several adapters and the base model at once.

Each adapter row goes one of two ways (M: the fused linear's targeted modules, R: the stack's rank):

    runs      RUN_ROWS or more consecutive rows of one adapter (a prompt's chunk): in place, no copies
                  shrunk = x[rows] @ A_stack[k] * scale[k]            (mm)          [n, M * R]
                  y[rows, slice_m] += shrunk[:, m] @ B_stack_m[k]     (addmm_)      [n, out_m]
    segments  the other rows, SGMV-style on torch ops: sorted by adapter into S segments padded to the longest
              (L rows), gathered to x_seg [S, L, in]
                  shrunk = bmm(x_seg, A_stack[seg]) * scale[seg]                    [S, L, M * R]
                  delta_m = bmm(shrunk[..., m], B_stack_m[seg])                     [S, L, out_m]
              and the real entries added to their rows of y's slice m: one gather of delta_m over the rows from
              the segments' first row to their last (``span``; a zero row for the base rows between), or, where
              those rows lie far apart, index_add_.

Where the segments' adapters are a range of the stack's rows (a decode step over all of them), A_stack[seg] and
B_stack_m[seg] are views of the stack (``first``): nothing is copied, and an adapter of the range that the step does
not use is an empty segment. Else they are copies of the rows used. ``lora_batch`` chooses L for least padding: an
adapter with many more short rows than the others (a request's many decodes) is a run of its own too, its rows
gathered and scattered. Padding rows compute and are dropped; rows of the base model are never touched. The scale
multiplies the shrink (R columns a module) rather than each delta (out_m columns): the same product within rounding,
and nothing when every scale is 1. A step without adapter rows has no LoraBatch, and the model runs exactly as
without LoRA (its fast paths included).
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

import torch

from executor_svc.lora import cuda_sgmv
from executor_svc.lora.stack import LinearLora, LoraStack
from executor_svc.model.decoder_layer import DecoderLayer
from executor_svc.model.moe import DenseMlp

RUN_ROWS = 32  # consecutive rows of one adapter from which they are a run (done in place), not a segment's
RUN_COST = 32  # a run's own calls, in rows of segment padding (lora_batch's choice of L)


@dataclass(frozen=True, slots=True, eq=False)
class Run:
    """Rows of one adapter done on their own: ``count`` rows from flat row ``start``, or, with ``rows``, those."""

    adapter: int  # its row in the stack (slot - 1)
    start: int
    count: int
    rows: torch.Tensor | None  # [count] flat rows (None: start .. start + count - 1)
    scale: torch.Tensor | None  # [1, 1] fp32 (None: 1)


@dataclass(frozen=True, slots=True, eq=False)
class Span:
    """The flat rows lo .. hi - 1 of a step, from the segments' first row to their last: row lo + i adds entry inv[i]
    of the segments' deltas (flattened [S * L]), or, with ``zero_row``, S * L: a row of zeros (a row between
    that is not the segments': the base model's, a run's)."""

    lo: int
    hi: int
    inv: torch.Tensor  # [hi - lo]
    zero_row: bool


@dataclass(slots=True, eq=False)
class LoraBatch:
    stack: LoraStack
    seg: torch.Tensor  # [S] the segments' adapter rows in the stack (slot - 1)
    gather: torch.Tensor  # [S, L] flat row of each segment entry (padding repeats one of the segment's rows)
    src: torch.Tensor | None  # [K] real entries' indices in gather.view(-1) (None: every entry is real)
    dst: torch.Tensor  # [K] their flat rows (gather.view(-1)[src])
    scale: torch.Tensor | None  # [S, 1, 1] fp32 (None: every adapter's scale is 1)
    first: int | None = None  # seg is first, first + 1, ..., first + S - 1: the stacks' rows are read as views
    whole: bool = False  # ... and they are all the stack's rows (first 0, S = N)
    runs: tuple[Run, ...] = ()
    span: Span | None = None  # where the segments' deltas are added by one gather (None: by index_add_ at dst)
    row_adapter: torch.Tensor | None = None  # on a GPU: each flat row's stack row (-1: base), for the SGMV kernels

    def delta(self, lin: LinearLora, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y`` (the fused linear's output for ``x``) with each adapter row's LoRA delta added in place: on a GPU by
        kernels_cuda/lora_sgmv.cu (cuda_sgmv.py) where it can take the linear, else by torch ops."""
        if self.row_adapter is not None and cuda_sgmv.usable(x, lin):
            return cuda_sgmv.lora_delta_cuda(lin, x, y, self.row_adapter, self.stack.scales, self.stack.rank)
        if self.gather.numel():
            self._segments(lin, x, y)
        r = self.stack.rank
        for run in self.runs:
            a, rows = run.adapter, run.rows
            shrunk = torch.mm(x.narrow(0, run.start, run.count) if rows is None else x.index_select(0, rows),
                              lin.shrink[a])  # [count, M * R]
            if run.scale is not None:
                shrunk.mul_(run.scale)
            for j, (offset, width) in enumerate(lin.slices):
                out, h = y.narrow(-1, offset, width), shrunk[:, j * r:(j + 1) * r]
                if rows is None:
                    out.narrow(0, run.start, run.count).addmm_(h, lin.expand[j][a])
                else:
                    out.index_add_(0, rows, torch.mm(h, lin.expand[j][a]))
        return y

    def _segments(self, lin: LinearLora, x: torch.Tensor, y: torch.Tensor) -> None:
        s, length = self.gather.shape
        x_seg = x.index_select(0, self.gather.view(-1)).view(s, length, x.shape[-1])
        shrunk = torch.bmm(x_seg, self._rows(lin.shrink))  # [S, L, M * R]
        if self.scale is not None:
            shrunk.mul_(self.scale)
        m, span = len(lin.slices), self.span
        hs = (shrunk,) if m == 1 else shrunk.view(s, length, m, -1).unbind(2)
        for h, b, (offset, width) in zip(hs, lin.expand, lin.slices):
            if span is None:
                d = torch.bmm(h, self._rows(b)).view(-1, width)
                d = d if self.src is None else d.index_select(0, self.src)
                y.narrow(-1, offset, width).index_add_(0, self.dst, d)
            elif span.zero_row:
                d = torch.empty(s * length + 1, width, dtype=shrunk.dtype, device=y.device)
                d[-1].zero_()
                torch.bmm(h, self._rows(b), out=d[:-1].view(s, length, width))
                y[span.lo:span.hi, offset:offset + width].add_(d.index_select(0, span.inv))
            else:
                d = torch.bmm(h, self._rows(b)).view(-1, width)
                y[span.lo:span.hi, offset:offset + width].add_(d.index_select(0, span.inv))

    def _rows(self, stacked: torch.Tensor) -> torch.Tensor:
        """The segments' rows of a stacked tensor [N, ...]: a view when they are a range of it, else a copy."""
        if self.first is None:
            return stacked.index_select(0, self.seg)
        return stacked if self.whole else stacked.narrow(0, self.first, self.seg.shape[0])

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

    def __init__(self, base, lin: LinearLora, batch: LoraBatch) -> None:
        self.base, self.lin, self.batch = base, lin, batch

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.batch.delta(self.lin, x, self.base(x))


def lora_batch(stack: LoraStack | None, row_slots: list[int], device: torch.device,
               kernels: bool = False) -> LoraBatch | None:
    """The LoraBatch of a step whose flat rows use ``row_slots`` (0: the base model); None when no row uses an
    adapter. ``kernels``: on a CUDA device, the deltas go through the SGMV kernels (the cuda attention backend runs:
    kernels_cuda/ is on) where they can take a linear."""
    if stack is None or not any(row_slots):
        return None
    runs, short = _runs(row_slots)
    length, ranged = _segment_length({slot: len(rows) for slot, rows in short.items()})
    for slot in [slot for slot, rows in short.items() if len(rows) > length]:
        rows = short.pop(slot)
        runs.append((slot, rows[0], len(rows), torch.tensor(rows, dtype=torch.long)))
    seg_slots = sorted(short)
    if ranged:
        seg_slots = list(range(seg_slots[0], seg_slots[-1] + 1))  # (the ones no row uses: empty segments)
    gather, real = [], []
    for slot in seg_slots:
        rows = short.get(slot, [])
        real += range(len(gather), len(gather) + len(rows))
        gather += rows + [rows[0] if rows else 0] * (length - len(rows))
    flat = torch.tensor(gather, dtype=torch.long)
    src = None if len(real) == len(gather) else torch.tensor(real, dtype=torch.long)
    scales = stack.scales
    # every scale 1 (lora_alpha = r): nothing to multiply. (Asked on the host only: a GPU's answer would wait.)
    unit = scales.device.type == "cpu" and bool((scales == 1).all())
    seg = torch.tensor([slot - 1 for slot in seg_slots], dtype=torch.long)
    return LoraBatch(stack, seg.to(device), flat.view(len(seg_slots), length).to(device),
                     None if src is None else src.to(device), (flat if src is None else flat[src]).to(device),
                     None if unit else scales[seg.to(scales.device)].view(-1, 1, 1),
                     seg_slots[0] - 1 if ranged else None, ranged and len(seg_slots) == len(scales),
                     tuple(Run(slot - 1, start, n, None if rows is None else rows.to(device),
                               None if unit else scales[slot - 1:slot].view(1, 1)) for slot, start, n, rows in runs),
                     _span(gather, real, device),
                     (torch.tensor(row_slots, dtype=torch.long) - 1).to(device)
                     if kernels and device.type == "cuda" else None)


def _runs(row_slots: list[int]) -> tuple[list[tuple], dict[int, list[int]]]:
    """The in-place runs ((slot, first row, rows, None) each: RUN_ROWS or more consecutive rows of one adapter), and
    each adapter's other rows (slot -> flat rows, ascending)."""
    runs, short, at = [], {}, 0
    for slot, group in itertools.groupby(row_slots):
        n = sum(1 for _ in group)
        if slot and n >= RUN_ROWS:
            runs.append((slot, at, n, None))
        elif slot:
            short.setdefault(slot, []).extend(range(at, at + n))
        at += n
    return runs, short


def _segment_length(counts: dict[int, int]) -> tuple[int, bool]:
    """(L, whether the segments read a range of the stack's rows as views) for adapters with ``counts`` short rows
    (slot -> rows): the L of least cost, a segment costing L rows and an adapter with more rows than L its rows plus
    RUN_COST. A range is read when it spans at most three times the adapters in it: an unused one's weights are
    read once, where a copy of the used ones reads and writes theirs before the bmm reads them again."""
    best = (float("inf"), 0, False)
    for length in sorted(set(counts.values())):
        inside = [slot for slot, c in counts.items() if c <= length]
        span = max(inside) - min(inside) + 1
        ranged = span <= 3 * len(inside)
        cost = (span if ranged else len(inside)) * length + sum(c + RUN_COST for c in counts.values() if c > length)
        best = min(best, (cost, length, ranged), key=lambda b: b[0])
    return best[1], best[2]


def _span(gather: list[int], real: list[int], device: torch.device) -> Span | None:
    """LoraBatch.span for the segments' real entries ``real`` of the padded ``gather``, where their rows are dense
    enough that a gather of the deltas over the rows between beats a scatter."""
    if not real:
        return None
    rows = [gather[i] for i in real]
    lo, hi = min(rows), max(rows) + 1
    if hi - lo > 2 * len(rows) + 16:
        return None
    inv = [len(gather)] * (hi - lo)
    for i, row in zip(real, rows):
        inv[row - lo] = i
    return Span(lo, hi, torch.tensor(inv, dtype=torch.long, device=device), hi - lo > len(rows))


def step_row_slots(counts_and_slots: list[tuple[int, int]]) -> list[int]:
    """Each flat row's adapter slot, from the step's (token count, slot) per request in plan order (batch.py lays
    each request's tokens out in that order)."""
    out: list[int] = []
    for count, slot in counts_and_slots:
        out += [slot] * count
    return out
