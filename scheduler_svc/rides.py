"""Riding on another request's prefill: a request whose prompt starts with pages another running request of its
tenant is computing shares those pages as soon as that request's plan covers them, instead of waiting for their
result (#49: the shared-prefix burst, the seeds' scenario).

Without this, the followers of a burst wait until the first request's prefix pages are confirmed and published:
the prefix is computed once, but the first step computes it alone (1,088 of a 2,048-token budget in bench/e2e_peers.py's
shared workload) and every follower's suffix waits one whole step more. A page is safe to read as soon as some
plan computes it, in the same step or an earlier one: the executor runs plans in order, and within a step each
layer writes every row's K/V to its pages before any row attends (executor_svc/model/llama.py), so a follower's
suffix in the same step reads the prefix its owner writes there.

What makes it safe when a plan does not run: a lost stream recomputes every request (their pages go); a plan
rejected with another in flight is a lost stream already; a rejected plan whose requests ride (``Step.rides``) is
treated as one too (engine.py), since its followers would count pages that were never written as computed. While
plans go one at a time after a rejection no request rides (``Scheduler.plan(rides=False)``), so a request the
executor keeps refusing still reaches the resend protocol's limit.
"""

from __future__ import annotations

from pagedkv.wire import DROPPED_PAGE
from scheduler_svc.request import Request, Status


def plain(req: Request) -> bool:
    """Rides are for plain requests only, as riders and as owners: one sequence (no forks), full attention with no
    page budget, nothing retained when it ends (a retention's pages are zeroed when it ends, which assumes no
    other request holds pages that were never published)."""
    return req.n == 1 and not req.page_budget and not req.page_limit and req.retain is None


def planned_pages(inflight: dict[bytes, Request], req: Request, first: int, limit: int, block_size: int) -> list[int]:
    """The pages from page ``first`` of req's prompt (up to ``limit``) that another running request claims (its
    in-flight prefix pages, by hash: the same tokens from the start, the same tenant) and has planned whole."""
    pages: list[int] = []
    if not plain(req):
        return pages
    for j in range(first, limit):
        owner = inflight.get(req.page_hashes[j])
        if (owner is None or owner is req or owner.status is not Status.RUNNING or not plain(owner)
                or j >= len(owner.page_table) or owner.num_computed < (j + 1) * block_size
                or owner.page_table[j] == DROPPED_PAGE):
            break
        pages.append(owner.page_table[j])
    return pages
