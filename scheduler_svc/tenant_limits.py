"""The tenant rules that depend on one executor's pool: a request's capacity there, whether the pool
can give a tenant more pages (quota, other tenants' reserves), seats; plus this executor's part of the scheduler-wide
``TenantLedger`` (``LedgerMember``: what its pool and queues hold per tenant) and its per-tenant event counts.

The rules that hold for the sum over executors (quotas, fair shares, seats in total) are the ledger's; the victim
choice that gives a tenant its fair share under pressure is in fair_share.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from scheduler_svc.pages import PagePool
from scheduler_svc.queues import RequestQueues
from scheduler_svc.retention import max_retained_pages
from scheduler_svc.tenant_ledger import TenantLedger


@dataclass(slots=True)
class TenantStats:
    peak_used_pages: int = 0  # on this executor
    budget_hits: int = 0  # requests that reached their page budget
    fair_share_preemptions: int = 0  # of this tenant's requests, to give another tenant its share


class TenantLimits:
    def __init__(self, ledger: TenantLedger, pool: PagePool, queues: RequestQueues,
                 stats: dict[str, TenantStats] | None = None) -> None:
        """Joins ``ledger`` as this executor's member; ``stats``: the counts so far (a rebuilt planner keeps them)."""
        self._ledger = ledger
        self._pool = pool
        self._queues = queues
        self._stats: dict[str, TenantStats] = stats if stats is not None else {}
        self.adapters = None  # the executor's LoRA slots (adapter_slots.py): a tenant's own adapters count as its pages
        ledger.join(self)

    # ---- the ledger's member -------------------------------------------------------------------
    @property
    def num_pages(self) -> int:
        return self._pool.num_pages

    def pages_used(self, tenant: str) -> int:
        if self.adapters is None:
            return self._pool.used_by[tenant]
        return self._pool.used_by[tenant] + self.adapters.pages_of(tenant)

    def seats(self) -> dict[str, int]:
        return self._queues.seats()

    def active_tenants(self) -> set[str]:
        return self._queues.active_tenants()

    def queued(self, tenant: str) -> tuple[int, int]:
        waiting = self._queues.waiting
        return waiting.tenant_len(tenant), len(waiting)

    def has_tenant(self, tenant: str) -> bool:
        return self._queues.has_tenant(tenant)

    def join(self) -> None:
        """This executor counts for its tenants' limits (it serves: up or draining)."""
        self._ledger.join(self)

    def leave(self) -> None:
        """This executor counts for no tenant (down, or its planner replaced)."""
        self._ledger.leave(self)

    # ---- per-tenant counts ---------------------------------------------------------------------
    @property
    def stats_by_tenant(self) -> dict[str, TenantStats]:
        return self._stats

    def stats(self, tenant_id: str) -> TenantStats:
        st = self._stats.get(tenant_id)
        if st is None:
            st = self._stats[tenant_id] = TenantStats()
        return st

    def record_peaks(self) -> None:
        for tenant, used in self._pool.used_by.items():
            if self.adapters is not None:
                used = self.pages_used(tenant)  # (its own adapters' pages in the slots too)
            st = self.stats(tenant)
            if used > st.peak_used_pages:
                st.peak_used_pages = used

    def reset_peak(self, tenant: str) -> None:
        """The tenant's peak starts again from what it holds now."""
        self.stats(tenant).peak_used_pages = self._pool.used_by[tenant]

    # ---- this pool's rules ---------------------------------------------------------------------
    def capacity(self, tenant_id: str) -> int:
        """The most pages one request of the tenant can ever get here."""
        return self._ledger.capacity(tenant_id, self._pool)

    def reserved_for_others(self, tenant_id: str, used: dict[str, int] | None = None) -> int:
        """Free pages of this pool that other tenants' reserved minimums claim (``used``: a what-if)."""
        return self._ledger.reserved_for_others(tenant_id, self._pool, used)

    def can_take(self, tenant_id: str, need: int, slack: int = 0, adapter: int = 0) -> bool:
        """need more pages for the tenant: within its quota, leaving other tenants' reserved minimums free.
        ``adapter``: pages an adapter of its own paged in with them adds to its quota's count (not the pool's)."""
        ledger = self._ledger
        if ledger.over_quota(ledger.tenants.get(tenant_id), need + adapter):
            return False
        return self._pool.can_allocate(need + slack + ledger.reserved_for_others(tenant_id, self._pool))

    def max_retained(self, tenant_id: str, share: float) -> int:
        """Pages the tenant's retained KV may hold here: ``share`` of its quota (of the pool without one)."""
        return max_retained_pages(share, self._ledger.tenants.get(tenant_id).page_quota, self._pool.num_pages)

    def at_seat_limit(self, tenant_id: str, n: int, seats: int | None = None) -> bool:
        """Whether n more sequences would take the tenant past max_concurrent_requests (``seats``: those it runs
        on every executor, if the caller counted them)."""
        ledger = self._ledger
        limit = ledger.tenants.get(tenant_id).max_concurrent_requests
        if not limit:
            return False
        return (ledger.seats_of(tenant_id) if seats is None else seats) + n > limit
