"""ModelInfo's figures added up over the executors: a tenant's (``tenant_info``) and, for a caller who may see the
cluster, every executor's counts (``add_cluster_counts``)."""

from __future__ import annotations

from pagedkv.api.v1 import api_pb2 as api
from pagedkv.tenancy import Tenant
from scheduler_svc.constraints import constraint_bytes
from scheduler_svc.snapshot import SchedulerSnapshot


def tenant_info(snapshots: list[SchedulerSnapshot], tenant: Tenant, live: set[int], max_queued: int,
                cross_tenant: bool) -> api.TenantInfo:
    """A tenant's settings and, added up over the executors, its usage: what it holds and runs over those that
    serve (indices in ``live``: up or draining, the tenant ledger's members), its counts since start over all.
    ``cross_tenant``: also the figures that depend on other tenants' activity (its fair share of pages now, its
    requests preempted to give others theirs), for a caller who may see the cluster; left 0 otherwise, so that
    nothing shows one tenant what another does."""
    info = api.TenantInfo(
        id=tenant.id, weight=tenant.weight, page_quota=tenant.page_quota, reserved_pages=tenant.reserved_pages,
        max_concurrent_requests=tenant.max_concurrent_requests, page_budget=tenant.page_budget,
        overflow=tenant.overflow, sliding_window=tenant.sliding_window, sink_tokens=tenant.sink_tokens,
        max_queued_requests=max_queued, structured_outputs=tenant.structured_outputs,
        max_constraint_bytes=constraint_bytes(tenant),
        max_constrained_requests=tenant.max_constrained_requests)
    for i, snap in enumerate(snapshots):
        u = snap.tenants.get(tenant.id)
        if u is None:
            continue
        if i in live:
            info.used_pages += u.used_pages
            info.num_running += u.num_running
            info.num_waiting += u.num_waiting
            info.num_swapped += u.num_swapped
            info.retained_pages += u.retained_pages
            info.max_retained_pages += u.max_retained_pages
            if cross_tenant:
                info.fair_share_pages += u.fair_share_pages
        info.peak_used_pages += u.peak_used_pages
        info.service = max(info.service, u.service)  # (one ledger-wide figure: each executor has the same)
        info.grammar_cpu_seconds = max(info.grammar_cpu_seconds, u.grammar_cpu_s)  # (likewise)
        info.budget_hits += u.budget_hits
        if cross_tenant:
            info.fair_share_preemptions += u.fair_share_preemptions
    return info


def add_cluster_counts(info: api.ModelInfoResponse, snapshots: list[SchedulerSnapshot], live: set[int]) -> None:
    """Adds every executor's counts to ``info`` (free and cached pages: those up or draining)."""
    for i, snap in enumerate(snapshots):
        pool = dict(num_free_pages=snap.pool.num_free, num_cached_pages=snap.pool.num_cached) if i in live else {}
        c = snap.counters
        add = dict(
            **pool, num_used_pages=snap.pool.num_used,
            num_running=snap.num_running, num_waiting=snap.num_waiting, num_preemptions=c.preemptions,
            peak_used_pages=c.peak_used_pages, num_computed_tokens=c.computed_tokens,
            num_cached_prompt_tokens=c.cached_prompt_tokens,
            num_used_host_pages=snap.host.num_used if i in live else 0, num_swapped=snap.num_swapped,
            num_swap_preemptions=c.swap_preemptions, num_recompute_preemptions=c.recompute_preemptions,
            num_pages_swapped_out=c.pages_swapped_out, num_pages_swapped_in=c.pages_swapped_in,
            num_swap_bytes=(c.pages_swapped_out + c.pages_swapped_in) * snap.page_bytes,
            num_spilled_pages=c.spilled_pages, num_spill_hits=c.spill_hits)
        for name, value in add.items():
            setattr(info, name, getattr(info, name) + value)
