"""What admission (admission.py) and the fair-share victim choice (fair_share.py) read while the planner plans one
step: a read-only view of its state. They change nothing through it; they return decisions the planner applies.
Plus the planner's per-request helpers for a step: the first chunk of an admission, and whether a request whose
sample is in flight goes on (its in-flight counts are the request's own: ``Request.count``, ``Request.uncount``)."""

from __future__ import annotations

from dataclasses import dataclass

from scheduler_svc.adapter_slots import AdapterSlots
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.kv_manager import Hit, KVManager
from scheduler_svc.outputs import OutputProcessor
from scheduler_svc.policy import PreemptionPolicy
from scheduler_svc.queues import RequestQueues
from scheduler_svc.request import Request
from scheduler_svc.retention import KvRetention
from scheduler_svc.tenant_ledger import TenantLedger
from scheduler_svc.tenant_limits import TenantLimits


@dataclass(frozen=True, slots=True)
class PlanView:
    config: SchedulerConfig
    queues: RequestQueues
    kv: KVManager
    retained: KvRetention  # (its ``reclaimable``: admission's Reclaim decisions)
    limits: TenantLimits  # this executor's tenant rules
    ledger: TenantLedger  # the scheduler-wide sums (quotas, fair shares, seats)
    policy: PreemptionPolicy
    watermark_pages: int  # pages kept free when admitting while others run
    now: int  # the step being planned
    adapters: AdapterSlots | None = None  # the executor's LoRA device slots (None: it has none)

    def slack(self) -> int:
        """Pages an admission leaves free: the watermark, while anything runs."""
        return self.watermark_pages if self.queues.running else 0

    def adapter_slot(self, req: Request) -> int | None:
        """Where req's LoRA adapter would be paged in for it to run now: None when it needs no slot (the base
        model, or its adapter is in one), -1 when every slot is in use by running requests (it waits)."""
        slots = self.adapters
        if not req.adapter or slots is None or slots.resident(req.adapter):
            return None
        slot = slots.place(req.adapter, self.queues.running_adapters())
        return -1 if slot is None else slot


def first_chunk(view: PlanView, req: Request, hits: list[Hit], budget: int) -> tuple[list[Hit], int]:
    """The cache hits a request admitted now uses and the tokens its first step computes: with a page
    budget (or a window's page limit) at most limit - 1 pages come from the cache, the rest fit it."""
    bs = view.kv.pool.block_size
    limit = req.page_budget or req.page_limit
    if limit:
        hits = hits[: limit - 1]
    n = min(req.compute_target - len(hits) * bs, budget)
    if limit:
        n = min(n, (limit - len(hits)) * bs)
    return hits, n


def plans_ahead(req: Request, kv: KVManager, outputs: OutputProcessor) -> bool:
    """Whether a request whose sample is still in flight (async scheduling) goes on in this plan as if that
    sample did not end it. Not when the sample ends it by length (max_tokens, max_len, a 'stop' page budget:
    known now), nor when its table would have to go in full (a copy-on-write, a resend: the executor's copy
    of its tokens holds the sample, the scheduler's not yet). A stop token or stop string is known only from
    the result: then the token computed ahead is discarded."""
    if req.num_pages_sent < 0 or kv.writes_shared_page(req):
        return False
    pending = req.num_pending
    return outputs.length_end(req, req.num_tokens + pending, len(req.output_ids) + pending) is None
