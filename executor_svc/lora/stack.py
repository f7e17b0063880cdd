"""Device slots for adapters' weights, stacked for batched matmuls (``LoraStack``), and where the start-up
adapters come from (``load_adapters``).

Adapter number 0 is the base model; slot k holds adapter number k + 1 and is row k of every stack (which adapter
is in which slot is the scheduler's choice: StepPlan.adapter_loads; executor_svc/lora/store.py). For each layer and
each fused linear of llama.py (``qkv``: q, k, v; ``o``; ``gate_up``: gate, up; ``down``) that the slots hold, the
stack holds

    shrink  [N, in, M * R]   the held modules' A, transposed, side by side (M modules, R the slots' rank)
    expand  M x [N, R, out_m] each module's B, transposed

with zeros past an adapter's own rank and for a module it does not target, so that one bmm over a step's
adapters shrinks and one bmm per module expands (batch.py). The per-adapter scale (alpha / r, or alpha / sqrt(r)) is
kept apart and applied after the expand, as PEFT applies it. ``SlotShape`` says what a slot holds: the start-up
adapters' largest rank and modules, or (with --lora-root, for run-time loads) --max-lora-rank on all seven.

In memory the stacks are laid out by slot, not by tensor: one region per slot holds its rows of every stacked
tensor (``_layout``; each block aligned), and every stacked tensor is a strided view over the N regions. So each
slot is one contiguous block, served from pages of the KV pool (executor_svc/lora/pages.py), and paging an adapter
in is one copy of its region from host memory (``region``, ``put``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from executor_svc.lora.adapter import TARGETS, LoraAdapter, load_adapter, module_shapes
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


@dataclass(frozen=True, slots=True)
class SlotShape:
    """What every slot of a stack can hold: adapters of rank <= ``rank`` whose modules in layer i are among
    ``targets[i]`` (in TARGETS order)."""

    rank: int
    targets: tuple[tuple[str, ...], ...]

    def refusal(self, adapter: LoraAdapter) -> str:
        """Why ``adapter`` does not fit a slot ('' : it fits)."""
        if adapter.rank > self.rank:
            return f"r = {adapter.rank} is above the slots' rank {self.rank} (--max-lora-rank)"
        outside = sorted({m for layer, m in adapter.weights if m not in self.targets[layer]})
        if outside:
            return (f"target_modules {outside} are not among the modules the slots hold "
                    f"({sorted({m for t in self.targets for m in t})}; --lora-root slots hold all seven)")
        return ""


def slot_shape(adapters: list[LoraAdapter], cfg: ModelConfig, rank: int | None = None) -> SlotShape:
    """The slots for ``adapters`` (their largest rank, the modules any of them targets per layer), or, with
    ``rank``, slots for any adapter of that rank at most on every targetable module (run-time loads)."""
    if rank is not None:
        return SlotShape(rank, tuple(TARGETS for _ in range(cfg.num_layers)))
    return SlotShape(max(a.rank for a in adapters),
                     tuple(tuple(m for m in TARGETS if any((layer, m) in a.weights for a in adapters))
                           for layer in range(cfg.num_layers)))


def _layout(shape: SlotShape, cfg: ModelConfig, dtype: torch.dtype) -> tuple[list[list[_Block]], int]:
    """The blocks of each layer, and the elements of one slot's region (all its blocks, padded to the slots' rank
    and aligned): every slot's region has the same layout, so that row k of a stacked tensor is in slot k's
    region."""
    align = max(1, ALIGN_BYTES // torch.empty(0, dtype=dtype).element_size())
    shapes, r, at, layers = module_shapes(cfg), shape.rank, 0, []
    for layer in range(cfg.num_layers):
        here = []
        for linear, modules in FUSED.items():
            targeted = tuple(m for m in modules if m in shape.targets[layer])
            if not targeted:
                continue
            offsets = []
            for rows, cols in [(shapes[targeted[0]][0], len(targeted) * r)] + [(r, shapes[m][1]) for m in targeted]:
                offsets.append(at)
                at += -(-rows * cols // align) * align
            here.append(_Block(linear, targeted, tuple(offsets)))
        layers.append(here)
    return layers, at


def region_bytes(adapters: list[LoraAdapter] | SlotShape, cfg: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes of one slot's region: what it holds, padding to the slots' rank, to every module they hold, and
    alignment included (``adapters``: slots shaped for them, as ``slot_shape`` gives)."""
    shape = adapters if isinstance(adapters, SlotShape) else slot_shape(adapters, cfg)
    return _layout(shape, cfg, dtype)[1] * torch.empty(0, dtype=dtype).element_size()


class LoraStack:
    """Device slots for adapters' weights, stacked per layer and fused linear (``layers[i][linear]``; a linear no
    slot holds in that layer is absent). Slot k (a request's adapter number k + 1; 0 is the base model) holds the
    adapter ``names[k]`` (None: empty, all zeros), scaled by ``scales[k]``.

    Every stacked tensor is a view of ``memory`` [slots, region elements or more], row k slot k's region (one
    contiguous block of memory per slot): given, it is the pool's pages the slots hold (executor_svc/lora/
    pages.py), else the stack allocates it. ``LoraStack(adapters, ...)`` shapes one slot per adapter and writes
    them in order (``shape`` and ``slots`` give other slots; ``adapters`` then go into the first ones).
    ``write`` puts an adapter's weights in a slot from its tensors; ``put`` from a region built by ``region``
    (one copy: how executor_svc/lora/store.py pages adapters in)."""

    def __init__(self, adapters: list[LoraAdapter], cfg: ModelConfig, device: torch.device,
                 dtype: torch.dtype, memory: torch.Tensor | None = None, *, shape: SlotShape | None = None,
                 slots: int | None = None) -> None:
        self.dtype, self.device, self.cfg = dtype, device, cfg
        self.shape = shape if shape is not None else slot_shape(adapters, cfg)
        count = slots if slots is not None else len(adapters)
        self.rank = self.shape.rank
        self.pages: list[int] = []  # the pages each slot holds in the pool (startup.py; empty: own memory)
        self.names: list[str | None] = [None] * count
        # fp32 whatever the model dtype: a delta is scaled as PEFT scales it (by a Python float: in fp32, then rounded)
        self.scales = torch.zeros(count, dtype=torch.float32, device=device)
        blocks, self.elems = _layout(self.shape, cfg, dtype)
        if memory is None:
            memory = torch.empty(count, self.elems, dtype=dtype, device=device)
        elif memory.dtype != dtype or memory.dim() != 2 or memory.shape[0] != count or memory.shape[1] < self.elems:
            raise ValueError(f"the adapters' memory {memory.dtype} {list(memory.shape)} cannot hold "
                             f"{count} regions of {self.elems} {dtype} elements")
        self.memory = memory.zero_()  # (zeros past an adapter's rank and for the modules it does not target)
        shapes = module_shapes(cfg)
        self._blocks = blocks
        self.layers: list[dict[str, LinearLora]] = [{b.linear: self._linear(b, shapes) for b in here}
                                                    for here in blocks]
        for k, a in enumerate(adapters):
            self.write(k, a)

    @property
    def slots(self) -> dict[str, int]:
        """name -> adapter number (slot + 1) of the adapters in the slots."""
        return {n: k + 1 for k, n in enumerate(self.names) if n is not None}

    def _view(self, offset: int, rows: int, cols: int, memory: torch.Tensor | None = None) -> torch.Tensor:
        """[N, rows, cols]: the block at ``offset`` of every region of ``memory`` (the stack's)."""
        memory = self.memory if memory is None else memory
        return memory[:, offset:offset + rows * cols].view(memory.shape[0], rows, cols)

    def _linear(self, block: _Block, shapes: dict[str, tuple[int, int]]) -> LinearLora:
        r, targeted = self.rank, block.targeted
        shrink = self._view(block.offsets[0], shapes[targeted[0]][0], len(targeted) * r)
        expand = [self._view(offset, r, shapes[m][1]) for m, offset in zip(targeted, block.offsets[1:])]
        offsets, at = {}, 0
        for m in FUSED[block.linear]:
            offsets[m] = at
            at += shapes[m][1]
        return LinearLora(shrink, tuple(expand), tuple((offsets[m], shapes[m][1]) for m in targeted))

    def write(self, slot: int, adapter: LoraAdapter) -> None:
        """``adapter``'s weights into ``slot`` (zeros past its rank and for the modules it does not target)."""
        if why := self.shape.refusal(adapter):
            raise ValueError(f"adapter {adapter.name!r}: {why}")
        self.memory[slot].zero_()
        r = self.rank
        for layer, here in enumerate(self._blocks):
            for block in here:
                lin = self.layers[layer][block.linear]
                for j, m in enumerate(block.targeted):
                    if (layer, m) not in adapter.weights:
                        continue
                    lora_a, lora_b = adapter.weights[layer, m]
                    lin.shrink[slot, :, j * r:j * r + adapter.rank] = lora_a.t().to(self.device, self.dtype)
                    lin.expand[j][slot, :adapter.rank] = lora_b.t().to(self.device, self.dtype)
        self.names[slot] = adapter.name
        self.scales[slot] = adapter.scale

    def put(self, slot: int, name: str, scale: float, region: torch.Tensor) -> None:
        """A region ``region`` built for these slots (``region``) into ``slot``: one copy (non-blocking from pinned
        host memory)."""
        self.memory[slot, :self.elems].copy_(region, non_blocking=True)
        self.names[slot] = name
        self.scales[slot] = scale

    def region(self, adapter: LoraAdapter, pin: bool = False) -> torch.Tensor:
        """``adapter``'s region for these slots, in host memory (pinned with ``pin``): what ``put`` copies in."""
        host = LoraStack([], self.cfg, torch.device("cpu"), self.dtype, shape=self.shape, slots=1)
        host.write(0, adapter)
        out = host.memory[0]
        return out.pin_memory() if pin else out

    def clear(self, slot: int) -> None:
        self.names[slot] = None
        self.scales[slot] = 0.0

    def held_bytes(self) -> int:
        """Bytes the stacks take (padded to the slots' rank and aligned; the slots' pages when in the pool)."""
        return self.memory.numel() * self.memory.element_size()


def load_adapters(modules: list[tuple[str, Path]] | None, cfg: ModelConfig, max_rank: int) -> list[LoraAdapter]:
    """The adapters of --lora-modules, each read and checked against the served model (adapter.py): before the
    model's weights load, so that a refusal comes at once."""
    modules = modules or []
    check_unique(modules)
    if max_rank < 1:
        raise ValueError(f"--max-lora-rank {max_rank} must be at least 1")
    return [load_adapter(name, path, cfg, max_rank) for name, path in modules]


def lora_slots(args, adapters: list[LoraAdapter], cfg: ModelConfig) -> tuple[SlotShape | None, int]:
    """The device slots the flags ask for: their shape and count (0: no LoRA at all)."""
    root, count = getattr(args, "lora_root", None), getattr(args, "max_loras", None)
    if root is not None and not Path(root).is_dir():
        raise ValueError(f"--lora-root {root}: not a directory")
    if count is not None and count < 1:
        raise ValueError(f"--max-loras {count} must be at least 1")
    if root is None and not adapters:
        if count is not None:
            raise ValueError("--max-loras: no adapter to hold (give --lora-modules or --lora-root)")
        return None, 0
    shape = slot_shape(adapters, cfg, getattr(args, "max_lora_rank", 64) if root is not None else None)
    return shape, count if count is not None else max(len(adapters), 1)
