"""How a model runs its steps over one attention backend and page pool (``StepPath``), decided once, on the first
step over them, instead of per step and per layer: the fused CPU ops or torch's, whether the layers store their own
K/V (``rotary_write``), the weights of ``decode_layers`` when a decode-only step may run every layer in one call,
which layers' MLPs run as ``down(silu_mul(gate_up(h)))``, and the layers' windows. What depends on the step itself
(its decode groups, a shared prefix) is still looked at each step (``LlamaModel.decode_stack``); a step with LoRA
rows (executor_svc/lora/batch.py) never runs decode_layers, which cannot add their deltas: LlamaModel.forward hands
such a step its own layers, and only the model's own take the one call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from executor_svc.attention import cascade
from executor_svc.attention.torch_backend import TorchPagedAttention
from executor_svc.model.decode_stack import stack_weights
from executor_svc.model.moe import DenseMlp
from executor_svc.pages import DevicePagePool


@dataclass(frozen=True, slots=True, eq=False)
class StepPath:
    attention: object  # the backend and pool it was decided for (LlamaModel.step_path decides again for others)
    pool: DevicePagePool
    ops: object | None  # torch.ops.pagedkv_cpu when the layers run with the fused CPU ops (fused_ops), else None
    rotary_write: bool  # with ops: each layer writes its K/V itself (ops.rotary_write): plain pages in the model
    # dtype, and a backend whose write_cache stores K/V as they are (PagedAttention.plain_cache_writes)
    stack: list[torch.Tensor] | None  # decode_layers' weights (decode_stack.py) where a decode-only step may run in
    # that one call: the torch backend reading these pages in place; else None
    stack_shared: bool  # decode_layers attends a shared prefix itself (cascade.shared_in_kernel)
    silu_mlps: tuple[bool, ...]  # per layer: a dense SiLU MLP (with ops: down(silu_mul(gate_up(h))))
    windows: frozenset[int | None]  # the layers' windows (one copy of the step's metadata each: _metas_by_window)


def decide(model, attention, pool: DevicePagePool) -> StepPath:
    """The path of ``model`` (a LlamaModel) over ``attention`` and ``pool``."""
    ops = model.fused_ops()
    k_cache = pool.layer(0)[0]
    rotary_write = (ops is not None and attention.plain_cache_writes and isinstance(k_cache, torch.Tensor)
                    and k_cache.dtype == model.dtype)
    stack = None
    if (ops is not None and isinstance(attention, TorchPagedAttention) and attention.plain_cache_writes
            and attention.reads_in_place(torch.empty(0, dtype=model.dtype), k_cache)):
        stack = stack_weights(model, ops)
    shared = stack is not None and cascade.shared_in_kernel(ops, torch.empty(0, 0, model.cfg.head_dim))
    silu = tuple(isinstance(lw.mlp, DenseMlp) and model.act is F.silu for lw in model.layers)
    return StepPath(attention, pool, ops, rotary_write, stack, shared, silu,
                    frozenset(lw.window for lw in model.layers))
