"""The scheduling settings of one scheduler process (every executor's planner has the same)."""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler_svc.policy import PreemptionConfig


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    watermark: float = 0.01  # share of pages kept free when admitting new requests
    enable_prefix_caching: bool = True
    fairness: bool = True  # admission across tenants by weighted service (VTC); False: arrival order
    scheduling_policy: str = "fcfs"  # inside a tenant: "fcfs" (arrival order) or "priority" (priority.py)
    sliding_window: int = 0  # serve every request with attention over sink + the last N tokens (0: off)
    sink_tokens: int = 0
    model_window: int = 0  # the model's own window (Describe.model_sliding_window): every request's at most
    preemption: PreemptionConfig = field(default_factory=PreemptionConfig)
    target_tpot_s: float = 0.0  # steps with decode rows sized to this by the step-time model (slo_budget.py; 0: off)
    target_ttft_s: float = 0.0  # with it: a step takes the full budget once a first token is this late (0: never)
    exact_tail_pages: int = 0  # the executor's exact tail (Describe.exact_tail_pages): no prefix hit on a prompt's last
    # pages that many (kv_manager.py)
    kv_retention_max_share: float = 0.5  # of a tenant's quota (of the pool without one) its retained KV may hold
