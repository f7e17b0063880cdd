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
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from executor_svc.lora.adapter import LoraAdapter, load_adapter
from executor_svc.lora.names import check_unique
from executor_svc.model_config import ModelConfig

# llama.py's fused linears and the modules whose outputs they concatenate, in order
FUSED = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate_up": ("gate_proj", "up_proj"),
         "down": ("down_proj",)}


@dataclass(frozen=True, slots=True, eq=False)
class LinearLora:
    """One fused linear's LoRA in one layer: the stacked weights of the modules any adapter targets there."""

    shrink: torch.Tensor  # [N, in, len(slices) * R]
    expand: tuple[torch.Tensor, ...]  # per targeted module: [N, R, width]
    slices: tuple[tuple[int, int], ...]  # per targeted module: (offset, width) in the fused linear's output


class LoraStack:
    """The served adapters (``adapters``, in load order; slot = index + 1) and their stacked weights per layer and
    fused linear (``layers[i][linear]``; a linear no adapter targets in that layer is absent)."""

    def __init__(self, adapters: list[LoraAdapter], cfg: ModelConfig, device: torch.device,
                 dtype: torch.dtype) -> None:
        self.adapters = adapters
        self.dtype = dtype
        self.slots = {a.name: i + 1 for i, a in enumerate(adapters)}  # name -> slot (0: the base model)
        self.rank = max(a.rank for a in adapters)
        # fp32 whatever the model dtype: a delta is scaled as PEFT scales it (by a Python float: in fp32, then rounded)
        self.scales = torch.tensor([a.scale for a in adapters], dtype=torch.float32, device=device)
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        widths = {"q_proj": q, "k_proj": kv, "v_proj": kv, "o_proj": cfg.hidden_size,
                  "gate_proj": cfg.intermediate_size, "up_proj": cfg.intermediate_size, "down_proj": cfg.hidden_size}
        self.layers: list[dict[str, LinearLora]] = []
        for layer in range(cfg.num_layers):
            here = {}
            for linear, modules in FUSED.items():
                built = self._linear(layer, modules, widths, device)
                if built is not None:
                    here[linear] = built
            self.layers.append(here)

    def _linear(self, layer: int, modules: tuple[str, ...], widths: dict[str, int],
                device: torch.device) -> LinearLora | None:
        targeted = [m for m in modules if any((layer, m) in a.weights for a in self.adapters)]
        if not targeted:
            return None
        n, r = len(self.adapters), self.rank
        fan_in = next(a.weights[layer, m][0].shape[1] for m in targeted for a in self.adapters
                      if (layer, m) in a.weights)
        shrink = torch.zeros(n, fan_in, len(targeted) * r, dtype=self.dtype, device=device)
        expand = []
        for j, m in enumerate(targeted):
            b_stack = torch.zeros(n, r, widths[m], dtype=self.dtype, device=device)
            for k, a in enumerate(self.adapters):
                if (layer, m) in a.weights:
                    lora_a, lora_b = a.weights[layer, m]
                    shrink[k, :, j * r:j * r + a.rank] = lora_a.t().to(device=device, dtype=self.dtype)
                    b_stack[k, :a.rank] = lora_b.t().to(device=device, dtype=self.dtype)
            expand.append(b_stack)
        offsets, at = {}, 0
        for m in modules:
            offsets[m] = at
            at += widths[m]
        return LinearLora(shrink, tuple(expand), tuple((offsets[m], widths[m]) for m in targeted))

    def describe(self) -> list[tuple[str, int, int]]:
        """(name, rank, bytes of its A/B weights) per adapter, in load order (DescribeResponse.adapters)."""
        return [(a.name, a.rank, a.num_bytes(self.dtype)) for a in self.adapters]

    def held_bytes(self) -> int:
        """Bytes the stacks take (padded to the largest rank)."""
        return sum(t.numel() * t.element_size() for here in self.layers for lin in here.values()
                   for t in (lin.shrink, *lin.expand))


def load_adapters(modules: list[tuple[str, Path]] | None, cfg: ModelConfig, max_rank: int) -> list[LoraAdapter]:
    """The adapters of --lora-modules, each read and checked against the served model (adapter.py): before the
    model's weights load, so that a refusal comes at once."""
    modules = modules or []
    check_unique(modules)
    if max_rank < 1:
        raise ValueError(f"--max-lora-rank {max_rank} must be at least 1")
    return [load_adapter(name, path, cfg, max_rank) for name, path in modules]
