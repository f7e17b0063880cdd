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
- **weighted service**: one VTC counter per tenant (``Service``), shared by every member's wait queue.

The members are the executors that serve (up or draining): one that goes down leaves until it is up again.
Quotas and reserves given as fractions are fractions of all members' device pages; the ledger resolves them
again whenever a member joins or leaves (``resize``), and fits every count to those pages (``Tenants.resolve``:
on fewer pages a reserve or quota is cut, never left larger than the pool). Live requests get their limits
again from the new settings (``Cluster``: ``Scheduler.set_tenants``). Across several schedulers limits stay per
scheduler.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from scheduler_svc.fairness import Service
from scheduler_svc.tenancy import Tenant, Tenants

if TYPE_CHECKING:
    from scheduler_svc.pages import PagePool
    from scheduler_svc.scheduler import Scheduler


class TenantLedger:
    def __init__(self, tenants: Tenants | None = None) -> None:
        self.tenants = tenants if tenants is not None else Tenants()
        self.members: list[Scheduler] = []
        self.service = Service()

    # ---- membership ----------------------------------------------------------------------------
    def join(self, member: Scheduler) -> None:
        if member not in self.members:
            self.members.append(member)
            self.resize()

    def leave(self, member: Scheduler) -> None:
        if member in self.members:
            self.members.remove(member)
            self.resize()

    def resize(self) -> None:
        """The tenants file's settings follow the members' pools: fractions resolved, counts fitted to them."""
        if self.members:
            self.tenants = self.tenants.resolve(self.total_pages)

    @property
    def total_pages(self) -> int:
        return sum(m.pool.num_pages for m in self.members)

    # ---- sums ----------------------------------------------------------------------------------
    def used_pages(self, tenant: str) -> int:
        """Device pages the tenant holds on every member."""
        members = self.members
        if len(members) == 1:
            return members[0].pool.used_by[tenant]
        return sum(m.pool.used_by[tenant] for m in members)

    def host_pages(self, tenant: str) -> int:
        return sum(m.host.used_by[tenant] for m in self.members if m.host is not None)

    def seats(self) -> dict[str, int]:
        """Sequences running per tenant on every member (a parent that has not forked holds n)."""
        seats: dict[str, int] = {}
        for m in self.members:
            for r in m.running:
                seats[r.tenant] = seats.get(r.tenant, 0) + r.n
        return seats

    def seats_of(self, tenant: str) -> int:
        return sum(r.n for m in self.members for r in m.running if r.tenant == tenant)

    def active(self) -> set[str]:
        """Tenants with a request running, waiting or swapped on any member."""
        out: set[str] = set()
        for m in self.members:
            out.update(r.tenant for r in m.running)
            out.update(t for t, q in m.waiting.queues.items() if q)
            out.update(r.tenant for r in m.swapped)
        return out

    def queued(self, tenant: str) -> tuple[int, int]:
        """Requests waiting to start in the members' wait queues: the tenant's, and everyone's."""
        mine = total = 0
        for m in self.members:
            mine += m.waiting.tenant_len(tenant)
            total += len(m.waiting)
        return mine, total

    def has_requests(self, tenant: str) -> bool:
        return any(r.tenant == tenant for m in self.members for r in m.requests.values())

    # ---- limits --------------------------------------------------------------------------------
    def over_quota(self, tenant: Tenant, need: int) -> bool:
        return bool(tenant.page_quota) and self.used_pages(tenant.id) + need > tenant.page_quota

    def _share_of(self, pages: int, pool: PagePool) -> int:
        """pages spread over the members in proportion to their pools: pool's part (rounded up)."""
        total = self.total_pages
        if len(self.members) <= 1 or not total:
            return pages
        return -(-pages * pool.num_pages // total)

    def reserved_for_others(self, tenant: str, pool: PagePool, used: dict[str, int] | None = None) -> int:
        """Free pages of pool that other tenants' reserved minimums still claim; ``used`` replaces pool's
        per-tenant counts (a what-if: the victims of a preemption not made yet)."""
        if not self.tenants.total_reserved:
            return 0
        claimed = 0
        for t in self.tenants:
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
        t = self.tenants.get(tenant_id)
        others = self.tenants.total_reserved - (t.reserved_pages if t.id in self.tenants.by_id else 0)
        return max(0, min(t.page_quota or pool.num_pages, pool.num_pages - self._share_of(others, pool)))

    def fair_shares(self) -> dict[str, float]:
        """Pages each active tenant is entitled to under pressure: all members' pages split by weight, at
        least its reserved minimum, at most its quota."""
        active = self.active()
        if not active:
            return {}
        weights = {t: self.tenants.get(t).weight for t in active}
        total_weight = sum(weights.values())
        pages = self.total_pages
        shares = {}
        for t in active:
            ten = self.tenants.get(t)
            share = max(ten.reserved_pages, pages * weights[t] / total_weight)
            shares[t] = min(share, ten.page_quota) if ten.page_quota else share
        return shares

    def over_share(self) -> set[str]:
        return {t for t, share in self.fair_shares().items() if self.used_pages(t) > share}
