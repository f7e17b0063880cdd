"""What the rest of the scheduler service may know of one executor's scheduler: a read-only snapshot.

The API (ModelInfo), the gauges and placement read these frozen values; nothing outside the scheduler reads
its attributes. Counters are cumulative since the process started (they survive a pool reset when an
executor comes back with another geometry).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Counters:
    """Cumulative counts of one executor's scheduler, kept outside the KV manager (which a pool reset replaces)."""

    preemptions: int = 0
    swap_preemptions: int = 0
    recompute_preemptions: int = 0
    computed_tokens: int = 0
    cached_prompt_tokens: int = 0  # prompt tokens served from the prefix cache
    prompt_tokens_queried: int = 0  # prompt tokens of first admissions (the hit rate's denominator)
    pages_swapped_out: int = 0
    pages_swapped_in: int = 0
    spilled_pages: int = 0  # of the pages swapped out: cached pages the device evicted
    spill_hits: int = 0  # of the pages swapped in: prefix hits served from the host tier
    peak_used_pages: int = 0


@dataclass(frozen=True, slots=True)
class PoolSnapshot:
    num_pages: int = 0
    num_used: int = 0
    num_free: int = 0
    num_cached: int = 0


@dataclass(frozen=True, slots=True)
class TenantUsage:
    """One tenant's figures on one executor."""

    used_pages: int = 0
    host_pages: int = 0
    peak_used_pages: int = 0
    num_running: int = 0
    num_waiting: int = 0
    num_swapped: int = 0
    service: float = 0.0  # weighted tokens charged to it (its own; not the fair scheduler's counter)
    grammar_cpu_s: float = 0.0  # CPU its constraints cost the executors (its own)
    budget_hits: int = 0
    fair_share_preemptions: int = 0
    fair_share_pages: float = 0.0
    retained_pages: int = 0  # held by its retained KV (retention.py; in used_pages too)
    max_retained_pages: int = 0


@dataclass(frozen=True, slots=True)
class SchedulerSnapshot:
    block_size: int
    max_num_seqs: int
    pool: PoolSnapshot
    host: PoolSnapshot
    num_running: int
    num_waiting: int
    num_swapped: int
    counters: Counters  # a copy
    page_bytes: int  # bytes one page moves in a swap
    prefix_caching: bool
    kv_slots_filled: int = 0  # token slots of used device pages that hold KV (with tenants=True)
    tenants: dict[str, TenantUsage] = field(default_factory=dict)  # with tenants=True

    @property
    def load(self) -> float:
        """Pages in use and requests queued and running, each as a share of what the executor holds."""
        return self.pool.num_used / self.pool.num_pages + (
            self.num_running + self.num_waiting + self.num_swapped) / self.max_num_seqs

