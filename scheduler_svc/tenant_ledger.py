"""Tenant limits across every executor of one scheduler: one number per limit, as the tenants file says.

Each executor has its own ``Scheduler`` (page pools, request lists). A tenant's page quota, concurrency limit,
reserved pages, fair share and weighted service (VTC) are the scheduler's, summed over all of them: the
ledger is what every member consults. It keeps no copies: the sums are read from the members' pools and
request lists when asked (a handful of executors; the single-executor case costs what it did before).

- **quota** (``page_quota``): device pages the tenant holds on all executors together;
- **concurrency** (``max_concurrent_requests``): sequences running on all executors together;
- **reserved pages**: kept free for the tenant in total, spread over the pools in proportion to their size
  (each pool keeps its share of what the tenant does not hold yet);
- **fair share**: the scheduler's device pages split by weight among the tenants active anywhere;
- **weighted service**: one VTC counter per tenant (``VtcCounters``), shared by every member's wait queue.

The members are the executors that serve (up or draining): one that goes down leaves until it is up again.
Quotas and reserves given as fractions are fractions of all members' device pages; the ledger resolves them
again whenever a member joins or leaves (``resize``), and fits every count to those pages (``Tenants.resolve``:
on fewer pages a reserve or quota is cut, never left larger than the pool). Live requests get their limits
again from the new settings (``Cluster``: ``Scheduler.set_tenants``). Across several schedulers limits stay per
scheduler.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from pagedkv.tenancy import Tenant, Tenants
from scheduler_svc.wait_queue import GRAMMAR_MS_COST, VtcCounters

if TYPE_CHECKING:
    from scheduler_svc.pages import PagePool


class LedgerMember(Protocol):
    """What the ledger reads of one executor's planner (tenant_limits.TenantLimits is the one member kind)."""

    @property
    def num_pages(self) -> int: ...  # its device pages

    def pages_used(self, tenant: str) -> int: ...  # device pages the tenant holds there

    def seats(self) -> dict[str, int]: ...  # sequences running there, per tenant

    def active_tenants(self) -> set[str]: ...  # tenants with a request running, waiting or swapped there

    def queued(self, tenant: str) -> tuple[int, int]: ...  # requests waiting to start there: the tenant's, all

    def has_tenant(self, tenant: str) -> bool: ...  # whether the tenant has a live request there


class TenantLedger:
    def __init__(self, tenants: Tenants | None = None) -> None:
        self._tenants = tenants if tenants is not None else Tenants()
        self._members: list[LedgerMember] = []
        self._service = VtcCounters()

    @property
    def tenants(self) -> Tenants:
        return self._tenants

    @property
    def members(self) -> tuple[LedgerMember, ...]:
        """The executors that serve (each planner's part of the ledger)."""
        return tuple(self._members)

    @property
    def service(self) -> VtcCounters:
        """Each tenant's weighted service, shared by every member's wait queue."""
        return self._service

    def charge_compile(self, tenant_id: str, cpu_s: float) -> None:
        """CPU a constraint's compile cost the executors, charged to its tenant's service (wait_queue's rate)."""
        self._service.add(tenant_id, GRAMMAR_MS_COST * 1e3 * cpu_s / self._tenants.get(tenant_id).weight, cpu_s)

    def set_tenants(self, tenants: Tenants) -> None:
        """New tenant settings (a reload; ``resize`` fits them to the members' pools)."""
        self._tenants = tenants

    # ---- membership ----------------------------------------------------------------------------
    def join(self, member: LedgerMember) -> None:
        if member not in self._members:
            self._members.append(member)
            self.resize()

    def leave(self, member: LedgerMember) -> None:
        if member in self._members:
            self._members.remove(member)
            self.resize()

    def resize(self) -> None:
        """The tenants file's settings follow the members' pools: fractions resolved, counts fitted to them."""
        if self._members:
            self._tenants = self._tenants.resolve(self.total_pages)

    @property
    def total_pages(self) -> int:
        return sum(m.num_pages for m in self._members)

    # ---- sums ----------------------------------------------------------------------------------
    def used_pages(self, tenant: str) -> int:
        """Device pages the tenant holds on every member."""
        members = self._members
        if len(members) == 1:
            return members[0].pages_used(tenant)
        return sum(m.pages_used(tenant) for m in members)

    def seats(self) -> dict[str, int]:
        """Sequences running per tenant on every member (a parent that has not forked holds n)."""
        members = self._members
        if len(members) == 1:
            return members[0].seats()
        seats: dict[str, int] = {}
        for m in members:
            for t, n in m.seats().items():
                seats[t] = seats.get(t, 0) + n
        return seats

    def seats_of(self, tenant: str) -> int:
        return sum(m.seats().get(tenant, 0) for m in self._members)

    def active(self) -> set[str]:
        """Tenants with a request running, waiting or swapped on any member."""
        out: set[str] = set()
        for m in self._members:
            out |= m.active_tenants()
        return out

    def queued(self, tenant: str) -> tuple[int, int]:
        """Requests waiting to start in the members' wait queues: the tenant's, and everyone's."""
        mine = total = 0
        for m in self._members:
            a, b = m.queued(tenant)
            mine += a
            total += b
        return mine, total

    def has_requests(self, tenant: str) -> bool:
        return any(m.has_tenant(tenant) for m in self._members)

    # ---- limits --------------------------------------------------------------------------------
    def over_quota(self, tenant: Tenant, need: int) -> bool:
        return bool(tenant.page_quota) and self.used_pages(tenant.id) + need > tenant.page_quota

    def _share_of(self, pages: int, pool: PagePool) -> int:
        """pages spread over the members in proportion to their pools: pool's part (rounded up)."""
        total = self.total_pages
        if len(self._members) <= 1 or not total:
            return pages
        return -(-pages * pool.num_pages // total)

    def reserved_for_others(self, tenant: str, pool: PagePool, used: dict[str, int] | None = None) -> int:
        """Free pages of pool that other tenants' reserved minimums still claim; ``used`` replaces pool's
        per-tenant counts (a what-if: the victims of a preemption not made yet)."""
        if not self._tenants.total_reserved:
            return 0
        claimed = 0
        for t in self._tenants:
            if t.id == tenant or not t.reserved_pages:
                continue
            held = self.used_pages(t.id)
            if used is not None:
                held += used[t.id] - pool.used_by[t.id]
            claimed += max(0, t.reserved_pages - held)
        return self._share_of(claimed, pool)

    def capacity(self, tenant_id: str, pool: PagePool) -> int:
        """The most pages one request of the tenant can ever get on pool: its quota, less the part of every
        other tenant's reserved minimum that pool keeps; never below 0 (0: nothing of the tenant fits)."""
        t = self._tenants.get(tenant_id)
        others = self._tenants.total_reserved - (t.reserved_pages if t.id in self._tenants.by_id else 0)
        return max(0, min(t.page_quota or pool.num_pages, pool.num_pages - self._share_of(others, pool)))

    def fair_shares(self) -> dict[str, float]:
        """Pages each active tenant is entitled to under pressure: all members' pages split by weight, at
        least its reserved minimum, at most its quota."""
        active = self.active()
        if not active:
            return {}
        weights = {t: self._tenants.get(t).weight for t in active}
        total_weight = sum(weights.values())
        pages = self.total_pages
        shares = {}
        for t in active:
            ten = self._tenants.get(t)
            share = max(ten.reserved_pages, pages * weights[t] / total_weight)
            shares[t] = min(share, ten.page_quota) if ten.page_quota else share
        return shares

    def over_share(self) -> set[str]:
        return {t for t, share in self.fair_shares().items() if self.used_pages(t) > share}
