"""Mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE): a router picks each token's top-k experts.

As transformers computes it: router logits in the model dtype, softmax in fp32, top-k, the k weights
renormalized to sum 1 where the config says so (Mixtral always; Qwen: norm_topk_prob), each expert's
SwiGLU over the tokens routed to it, weighted and summed in expert order. Qwen2-MoE adds a shared expert
every token goes through, scaled by sigmoid(shared_expert_gate). On the CPU the experts are a plain loop
over the experts that received tokens this step.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from executor_svc.model_config import MoeSpec


class DenseMlp:
    """The ordinary gated MLP: down(act(gate) * up), gate and up in one matmul."""

    def __init__(self, gate_up: Callable, down: Callable, act: Callable) -> None:
        self.gate_up, self.down, self.act = gate_up, down, act

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(h).chunk(2, dim=-1)
        return self.down(self.act(gate) * up)

    def linears(self) -> list:
        return [self.gate_up, self.down]

    def tensors(self) -> list[torch.Tensor]:
        return []


class MoeMlp:
    def __init__(self, spec: MoeSpec, router: torch.Tensor, experts: list[tuple[Callable, Callable]],
                 act: Callable, shared: tuple[Callable, Callable] | None = None,
                 shared_gate: torch.Tensor | None = None) -> None:
        self.spec = spec
        self.router = router  # [num_experts, hidden]
        self.experts = experts  # (gate_up, down) linears of each expert
        self.act = act
        self.shared = shared
        self.shared_gate = shared_gate  # [1, hidden]

    def _swiglu(self, linears: tuple[Callable, Callable], h: torch.Tensor) -> torch.Tensor:
        return DenseMlp(*linears, self.act)(h)

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        logits = F.linear(h, self.router)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, chosen = torch.topk(probs, self.spec.top_k, dim=-1)  # [T, k]
        if self.spec.normalize:
            weights /= weights.sum(dim=-1, keepdim=True)
        if not self.spec.mixtral_names:  # Qwen casts the weights to the model dtype; Mixtral keeps them fp32
            weights = weights.to(h.dtype)
        out = torch.zeros_like(h)
        for e in torch.unique(chosen).tolist():  # ascending: the order transformers adds the experts in
            token_idx, slot = torch.where(chosen == e)
            y = self._swiglu(self.experts[e], h[token_idx]) * weights[token_idx, slot, None]
            out.index_add_(0, token_idx, y.to(h.dtype))
        if self.shared is not None:
            out = out + torch.sigmoid(F.linear(h, self.shared_gate)) * self._swiglu(self.shared, h)
        return out

    def linears(self) -> list:
        extra = list(self.shared) if self.shared is not None else []
        return [lin for pair in self.experts for lin in pair] + extra

    def tensors(self) -> list[torch.Tensor]:
        return [self.router] + ([self.shared_gate] if self.shared_gate is not None else [])
