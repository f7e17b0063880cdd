"""The served adapters' weights, stacked for batched matmuls (``LoraStack``), and where they come from at start-up
(``load_adapters``).

Slot 0 is the base model; adapter k (in --lora-modules order) is slot k + 1 and row k of every stack. For each layer
and each fused linear of llama.py (``qkv``: q, k, v; ``o``; ``gate_up``: gate, up; ``down``) that any adapter
targets, the stack holds

    shrink  [N, in, M * R]   the targeted modules' A, transposed, side by side (M modules, R the largest rank)
    expand  M x [N, R, out_m] each module's B, transposed

with zeros past an adapter's own rank and for a module it does not target, so that one bmm over a step's
adapters shrinks and one bmm per module expands (batch.py). The per-adapter scale (alpha / r, or alpha / sqrt(r)) is
kept apart and applied after the expand, as PEFT applies it.

In memory the stacks are laid out by adapter, not by tensor: one region per adapter holds its rows of every stacked
tensor (``_layout``; each block aligned), and every stacked tensor is a strided view over the N regions. So each
adapter's weights are one contiguous block, served from pages of the KV pool (executor_svc/lora/pages.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from executor_svc.lora.adapter import LoraAdapter, load_adapter, module_shapes
from executor_svc.lora.names import check_unique
from executor_svc.model_config import ModelConfig

# llama.py's fused linears and the modules whose outputs they concatenate, in order
FUSED = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate_up": ("gate_proj", "up_proj"),
         "down": ("down_proj",)}
ALIGN_BYTES = 16  # every stacked tensor's block starts this aligned in an adapter's region (and each region does)


@dataclass(frozen=True, slots=True, eq=False)
class LinearLora:
    """One fused linear's LoRA in one layer: the stacked weights of the modules any adapter targets there."""

    shrink: torch.Tensor  # [N, in, len(slices) * R]
    expand: tuple[torch.Tensor, ...]  # per targeted module: [N, R, width]
    slices: tuple[tuple[int, int], ...]  # per targeted module: (offset, width) in the fused linear's output


@dataclass(frozen=True, slots=True)
class _Block:
    """Where one fused linear's stacked tensors lie in each adapter's region: element offsets of shrink's block
    [in, M * R], then of each expand's [R, width]."""

    linear: str
    targeted: tuple[str, ...]
    offsets: tuple[int, ...]


def _layout(adapters: list[LoraAdapter], cfg: ModelConfig, dtype: torch.dtype) -> tuple[list[list[_Block]], int]:
    """The blocks of each layer, and the elements of one adapter's region (all its blocks, padded to the largest
    rank and aligned): every adapter's region has the same layout, so that row k of a stacked tensor is in
    adapter k's region."""
    align = max(1, ALIGN_BYTES // torch.empty(0, dtype=dtype).element_size())
    shapes, r, at, layers = module_shapes(cfg), max(a.rank for a in adapters), 0, []
    for layer in range(cfg.num_layers):
        here = []
        for linear, modules in FUSED.items():
            targeted = tuple(m for m in modules if any((layer, m) in a.weights for a in adapters))
            if not targeted:
                continue
            offsets = []
            for rows, cols in [(shapes[targeted[0]][0], len(targeted) * r)] + [(r, shapes[m][1]) for m in targeted]:
                offsets.append(at)
                at += -(-rows * cols // align) * align
            here.append(_Block(linear, targeted, tuple(offsets)))
        layers.append(here)
    return layers, at


def region_bytes(adapters: list[LoraAdapter], cfg: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes of one adapter's region in the stack (``LoraStack``'s ``memory`` rows): what it holds, padding to the
    largest rank served, to every module any adapter targets, and alignment included."""
    return _layout(adapters, cfg, dtype)[1] * torch.empty(0, dtype=dtype).element_size()


class LoraStack:
    """The served adapters (``adapters``, in load order; slot = index + 1) and their stacked weights per layer and
    fused linear (``layers[i][linear]``; a linear no adapter targets in that layer is absent).

    Every stacked tensor is a view of ``memory`` [N, region elements or more], row k adapter k's region (one
    contiguous block of memory per adapter): given, it is the pool's pages the adapters hold (executor_svc/lora/
    pages.py), else the stack allocates it. The weights are copied in here; ``pages``: the pages each adapter holds
    (startup.py sets them; empty when the stack allocated its own memory)."""

    def __init__(self, adapters: list[LoraAdapter], cfg: ModelConfig, device: torch.device,
                 dtype: torch.dtype, memory: torch.Tensor | None = None) -> None:
        self.adapters = adapters
        self.dtype = dtype
        self.slots = {a.name: i + 1 for i, a in enumerate(adapters)}  # name -> slot (0: the base model)
        self.rank = max(a.rank for a in adapters)
        self.pages: list[int] = []
        # fp32 whatever the model dtype: a delta is scaled as PEFT scales it (by a Python float: in fp32, then rounded)
        self.scales = torch.tensor([a.scale for a in adapters], dtype=torch.float32, device=device)
        blocks, elems = _layout(adapters, cfg, dtype)
        if memory is None:
            memory = torch.empty(len(adapters), elems, dtype=dtype, device=device)
        elif memory.dtype != dtype or memory.dim() != 2 or memory.shape[0] != len(adapters) or memory.shape[1] < elems:
            raise ValueError(f"the adapters' memory {memory.dtype} {list(memory.shape)} cannot hold "
                             f"{len(adapters)} regions of {elems} {dtype} elements")
        self.memory = memory.zero_()  # (zeros past an adapter's rank and for the modules it does not target)
        shapes = module_shapes(cfg)
        self.layers: list[dict[str, LinearLora]] = [{b.linear: self._linear(layer, b, shapes, device) for b in here}
                                                    for layer, here in enumerate(blocks)]

    def _view(self, offset: int, rows: int, cols: int) -> torch.Tensor:
        """[N, rows, cols]: the block at ``offset`` of every adapter's region."""
        return self.memory[:, offset:offset + rows * cols].view(len(self.adapters), rows, cols)

    def _linear(self, layer: int, block: _Block, shapes: dict[str, tuple[int, int]],
                device: torch.device) -> LinearLora:
        r, targeted = self.rank, block.targeted
        shrink = self._view(block.offsets[0], shapes[targeted[0]][0], len(targeted) * r)
        expand = []
        for j, (m, offset) in enumerate(zip(targeted, block.offsets[1:])):
            b_stack = self._view(offset, r, shapes[m][1])
            for k, a in enumerate(self.adapters):
                if (layer, m) in a.weights:
                    lora_a, lora_b = a.weights[layer, m]
                    shrink[k, :, j * r:j * r + a.rank] = lora_a.t().to(device=device, dtype=self.dtype)
                    b_stack[k, :a.rank] = lora_b.t().to(device=device, dtype=self.dtype)
            expand.append(b_stack)
        offsets, at = {}, 0
        for m in FUSED[block.linear]:
            offsets[m] = at
            at += shapes[m][1]
        return LinearLora(shrink, tuple(expand), tuple((offsets[m], shapes[m][1]) for m in targeted))

    def describe(self) -> list[tuple[str, int, int]]:
        """(name, rank, bytes of its A/B weights) per adapter, in load order (DescribeResponse.adapters)."""
        return [(a.name, a.rank, a.num_bytes(self.dtype)) for a in self.adapters]

    def held_bytes(self) -> int:
        """Bytes the stacks take (padded to the largest rank and aligned; the adapters' pages when in the pool)."""
        return self.memory.numel() * self.memory.element_size()


def load_adapters(modules: list[tuple[str, Path]] | None, cfg: ModelConfig, max_rank: int) -> list[LoraAdapter]:
    """The adapters of --lora-modules, each read and checked against the served model (adapter.py): before the
    model's weights load, so that a refusal comes at once."""
    modules = modules or []
    check_unique(modules)
    if max_rank < 1:
        raise ValueError(f"--max-lora-rank {max_rank} must be at least 1")
    return [load_adapter(name, path, cfg, max_rank) for name, path in modules]
