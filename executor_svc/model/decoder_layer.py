"""One decoder layer's weights, as a slots dataclass (``DecoderLayer``): its norms, the fused q/k/v and o linears, its
MLP (dense or MoE), its own window and rotary table. Built by ``LlamaModel._layer_weights`` (llama.py); read by the
model's forward, its StepPath (step_path.py) and decode_layers' weights (decode_stack.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from executor_svc.model.moe import DenseMlp, MoeMlp


@dataclass(slots=True, eq=False)
class DecoderLayer:
    in_norm: torch.Tensor  # before attention (input_layernorm)
    qkv: object  # a linear (quant.py, cpu_linear.py): q, k and v fused, in that order
    o: object
    mlp_norm: torch.Tensor  # before the MLP (post_attention_layernorm; Gemma 2/3: pre_feedforward_layernorm)
    mlp: DenseMlp | MoeMlp
    window: int | None = None  # the layer's own window (per-layer windows; 0: full attention), else the step's
    rope: str | None = None  # its layer type's rotary table (Gemma 3), else the model's one
    attn_out_norm: torch.Tensor | None = None  # Gemma 2/3's sandwich norms: after attention
    mlp_out_norm: torch.Tensor | None = None  # and after the MLP
    q_norm: torch.Tensor | None = None  # Qwen3, Gemma 3: over each query / key head, before rope
    k_norm: torch.Tensor | None = None
    gate_up: object = None  # a dense MLP's linears (mlp.gate_up, mlp.down), as tests and benchmarks read them
    down: object = None

    def norms(self) -> list[torch.Tensor]:
        """The norm weights the layer holds."""
        return [t for t in (self.in_norm, self.mlp_norm, self.attn_out_norm, self.mlp_out_norm, self.q_norm,
                            self.k_norm) if t is not None]
