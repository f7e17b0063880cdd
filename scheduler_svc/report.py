"""How one executor's planner becomes a ``SchedulerSnapshot`` (snapshot.py): figures read from its parts through their
methods, frozen."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import replace

from pagedkv.wire import DROPPED_PAGE
from scheduler_svc.kv_manager import KVManager
from scheduler_svc.pages import PagePool
from scheduler_svc.queues import RequestQueues
from scheduler_svc.request import Request
from scheduler_svc.snapshot import Counters, PoolSnapshot, SchedulerSnapshot, TenantUsage
from scheduler_svc.tenant_ledger import TenantLedger
from scheduler_svc.tenant_limits import TenantLimits


def pool_snapshot(pool: PagePool | None) -> PoolSnapshot:
    if pool is None:
        return PoolSnapshot()
    return PoolSnapshot(pool.num_pages, pool.num_used, pool.num_free, pool.num_cached)


def snapshot_of(pool: PagePool, kv: KVManager, queues: RequestQueues, limits: TenantLimits, ledger: TenantLedger,
                counters: Counters, max_num_seqs: int, page_bytes: int, tenants: bool,
                retained: Mapping[str, int] | None = None, retained_share: float = 0.0) -> SchedulerSnapshot:
    """The frozen figures of one executor's planner, from its parts; with ``tenants`` also per-tenant figures and
    the KV slots filled (these walk the requests). ``retained``: the pages each tenant's retained KV holds, at most
    ``retained_share`` of its quota (retention.py)."""
    retained = retained or {}
    host, running = kv.host, queues.running
    usage = {}
    if tenants:
        names = set(limits.stats_by_tenant) | {t for t, n in pool.used_by.items() if n} | {
            r.tenant for r in queues.requests.values()}
        shares, total = ledger.fair_shares(), max(1, ledger.total_pages)
        for t in names:
            st, (num_running, num_waiting, num_swapped) = limits.stats(t), queues.counts(t)
            usage[t] = TenantUsage(
                used_pages=limits.pages_used(t), host_pages=host.used_by[t] if host is not None else 0,
                peak_used_pages=st.peak_used_pages, num_running=num_running, num_waiting=num_waiting,
                num_swapped=num_swapped, service=queues.waiting.charged(t), budget_hits=st.budget_hits,
                grammar_cpu_s=queues.waiting.grammar_cpu(t),
                fair_share_preemptions=st.fair_share_preemptions,
                fair_share_pages=shares.get(t, 0.0) * pool.num_pages / total, retained_pages=retained.get(t, 0),
                max_retained_pages=limits.max_retained(t, retained_share))
    return SchedulerSnapshot(
        block_size=pool.block_size, max_num_seqs=max_num_seqs, pool=pool_snapshot(pool), host=pool_snapshot(host),
        num_running=len(running), num_waiting=len(queues.waiting), num_swapped=len(queues.swapped),
        counters=replace(counters), page_bytes=page_bytes, prefix_caching=kv.caching,
        kv_slots_filled=slots_filled(running, pool.block_size) if tenants else 0, tenants=usage)


def slots_filled(running: Iterable[Request], block_size: int) -> int:
    """Token slots of the device pages in use that hold KV (each page once, however many share it)."""
    bs = block_size
    fill: dict[int, int] = {}
    for r in running:
        full, rest = divmod(r.num_computed, bs)
        for j, page in enumerate(r.page_table):
            if page == DROPPED_PAGE:
                continue
            n = bs if j < full else (rest if j == full else 0)
            if n > fill.get(page, 0):
                fill[page] = n
    return sum(fill.values())
