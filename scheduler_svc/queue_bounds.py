"""How many requests may wait to start: per tenant, and on the whole scheduler.

A request waits to start from the moment the API hands it to the cluster until admission gives it pages: in an
executor's wait queue (recompute-preempted requests included) or held while no executor can take it. Each one
holds an open gRPC stream, its prompt's token ids, a detokenizer and an outbox in the scheduler
(``bench/queue_memory.py``: ~24 KiB with a tiny prompt, ~90 KiB with 4 KiB of text). A tenant's concurrency
limit bounds what runs, not what waits: without these bounds a tenant limited to 64 running requests could queue
any number more.

- per tenant: its ``max_queued_requests`` in the tenants file, else ``--max-queued-requests`` (0: no bound);
- the scheduler: ``--max-queued-total`` requests of every tenant together (0: no bound).

Past either, a new request is refused with RESOURCE_EXHAUSTED before it is queued; the message starts with
``QUEUE_FULL_PREFIX`` and names the bound. Requests already queued stay.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedkv.grpc_common import QUEUE_FULL_PREFIX
from pagedkv.tenancy import Tenant

DEFAULT_MAX_QUEUED_REQUESTS = 1024  # per tenant
DEFAULT_MAX_QUEUED_TOTAL = 4096


class QueueFull(Exception):
    """``bound`` is tenant or total (a metrics label); the message starts with QUEUE_FULL_PREFIX."""

    def __init__(self, message: str, bound: str) -> None:
        super().__init__(message)
        self.bound = bound


@dataclass(frozen=True, slots=True)
class QueueBounds:
    per_tenant: int = DEFAULT_MAX_QUEUED_REQUESTS  # a tenant's unless its max_queued_requests says; 0: none
    total: int = DEFAULT_MAX_QUEUED_TOTAL  # 0: none

    def for_tenant(self, tenant: Tenant) -> int:
        """The most requests of the tenant that may wait to start (0: no bound)."""
        return self.per_tenant if tenant.max_queued_requests is None else tenant.max_queued_requests

    def check(self, tenant: Tenant, queued: int, queued_total: int) -> None:
        """Raises QueueFull when one more request of the tenant would pass a bound: ``queued`` of its requests
        and ``queued_total`` of everyone's wait to start now. The message names the bound, never another
        tenant's figures."""
        limit = self.for_tenant(tenant)
        if limit and queued >= limit:
            raise QueueFull(f"{QUEUE_FULL_PREFIX}tenant {tenant.id} has {queued} requests waiting to start; its "
                            f"max_queued_requests is {limit} (retry once some have started)", "tenant")
        if self.total and queued_total >= self.total:
            raise QueueFull(f"{QUEUE_FULL_PREFIX}the scheduler holds its limit of {self.total} requests waiting to "
                            "start (--max-queued-total); retry later or on another scheduler", "total")
