"""Every tenant rule as one executor's scheduler applies it: quotas, reserved pages, seats, fair shares and the
fit rule, over the scheduler-wide ``TenantLedger`` (so each limit holds for the sum over executors), plus the
per-tenant event counts of this executor.

The victim choice that gives a tenant its fair share under pressure is in ``fair_share.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

from scheduler_svc import fit
from scheduler_svc.pages import PagePool
from scheduler_svc.request import Request
from scheduler_svc.tenancy import Tenant, Tenants
from scheduler_svc.tenant_ledger import TenantLedger


@dataclass(slots=True)
class TenantStats:
    peak_used_pages: int = 0  # on this executor
    budget_hits: int = 0  # requests that reached their page budget
    fair_share_preemptions: int = 0  # of this tenant's requests, to give another tenant its share


class TenantLimits:
    def __init__(self, ledger: TenantLedger, pool: PagePool, max_model_len: int, max_batched_tokens: int,
                 max_num_seqs: int) -> None:
        self.ledger = ledger
        self.pool = pool  # (replaced with the scheduler's when an executor comes back with another geometry)
        self.max_model_len = max_model_len
        self.max_batched_tokens = max_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.stats_by_tenant: dict[str, TenantStats] = {}

    @property
    def tenants(self) -> Tenants:
        return self.ledger.tenants

    def get(self, tenant_id: str) -> Tenant:
        return self.ledger.tenants.get(tenant_id)

    def stats(self, tenant_id: str) -> TenantStats:
        st = self.stats_by_tenant.get(tenant_id)
        if st is None:
            st = self.stats_by_tenant[tenant_id] = TenantStats()
        return st

    def record_peaks(self) -> None:
        for tenant, used in self.pool.used_by.items():
            st = self.stats(tenant)
            if used > st.peak_used_pages:
                st.peak_used_pages = used

    # ---- the fit rule --------------------------------------------------------------------------
    def capacity(self, tenant_id: str) -> int:
        """The most pages one request of the tenant can ever get here."""
        return self.ledger.capacity(tenant_id, self.pool)

    def max_len_for(self, req: Request) -> int:
        return fit.max_len(self.capacity(req.tenant), self.pool.block_size, self.max_model_len,
                           bool(req.window_tokens))

    def window_page_limit(self, tenant_id: str, sink: int, window: int) -> int:
        return fit.window_page_limit(self.capacity(tenant_id), sink, window, self.pool.block_size,
                                     self.max_batched_tokens)

    def apply(self, req: Request) -> None:
        """Sets the request's max_len and (a window without a budget) its page limit from its tenant's."""
        req.max_len = self.max_len_for(req)
        if req.window_tokens and not req.page_budget:
            req.page_limit = self.window_page_limit(req.tenant, req.sink_tokens, req.window_tokens)

    def fit_error(self, req: Request) -> str:
        """Why this executor can never hold the request ('' when it can)."""
        return fit.fit_error(tenant=req.tenant, num_tokens=req.num_tokens, n=req.n, page_budget=req.page_budget,
                             sink=req.sink_tokens, window=req.window_tokens, capacity=self.capacity(req.tenant),
                             block_size=self.pool.block_size, max_model_len=self.max_model_len,
                             max_batched_tokens=self.max_batched_tokens, max_num_seqs=self.max_num_seqs)

    # ---- quotas, reserves, seats ---------------------------------------------------------------
    def over_quota(self, tenant: Tenant, need: int) -> bool:
        return self.ledger.over_quota(tenant, need)

    def reserved_for_others(self, tenant_id: str, used: dict[str, int] | None = None) -> int:
        return self.ledger.reserved_for_others(tenant_id, self.pool, used)

    def can_take(self, tenant_id: str, need: int, slack: int = 0) -> bool:
        """need more pages for the tenant: within its quota, leaving other tenants' reserved minimums free."""
        if self.ledger.over_quota(self.get(tenant_id), need):
            return False
        return self.pool.can_allocate(need + slack + self.ledger.reserved_for_others(tenant_id, self.pool))

    def seats(self) -> dict[str, int]:
        return self.ledger.seats()

    def seats_of(self, tenant_id: str) -> int:
        return self.ledger.seats_of(tenant_id)

    def at_seat_limit(self, tenant_id: str, n: int, seats: int | None = None) -> bool:
        """Whether n more sequences would take the tenant past max_concurrent_requests."""
        limit = self.get(tenant_id).max_concurrent_requests
        if not limit:
            return False
        return (self.seats_of(tenant_id) if seats is None else seats) + n > limit

    # ---- fair shares ---------------------------------------------------------------------------
    def fair_shares(self) -> dict[str, float]:
        return self.ledger.fair_shares()

    def over_share(self) -> set[str]:
        return self.ledger.over_share()

    def used_pages(self, tenant_id: str) -> int:
        return self.ledger.used_pages(tenant_id)
