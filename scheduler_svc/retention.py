"""Retained KV: the pages of a request that asked for it (GenerateRequest.retain_kv) stay findable by its tenant
for a while after it ends -- the Responses API's stored conversations, whose follow-ups then hit them.

One ``KvRetention`` per executor's device pool (the KV manager's). A retention is a page table of its own: it holds
one reference on each page (``PagePool.share``), so the pool's accounting is unchanged -- a retained page is a used
page, counted against its tenant (quota, fair share), never handed out, and still findable by its hash; a later
request of the tenant that hits it takes a reference as usual. What is kept: the request's full published pages,
prompt then output, up to the first one it no longer holds (a window's dropped page, even one still findable: taking
it back would grow the tenant as the request ends, past its quota). The tenant holds at most ``cap`` retained pages:
its oldest other retentions make room first, then the new one's tail is left out.

A retention ends when its TTL elapses (``expire``), on ReleaseKv (``end``), when another of the same key replaces
it, or under pressure (the planner ends the oldest one that ``reclaimable`` names before it preempts a running
request: retained pages go after the free cached pages, before anything running). Its pages that nothing else
holds then are zeroed: unpublished, first out of the free queue, and listed for the executor (``PageOps.zero``);
a free copy of them in the host tier is unpublished too. Pages a running request holds as well stay that request's.

    page state            refcount           holders[p]   in the free queue
    free (maybe cached)   0                  0            yes
    used by requests      requests           0            no
    retained only         retentions         = refcount   no   (what ``reclaimable`` looks for)
    retained and used     both               < refcount   no
"""

from __future__ import annotations

import math
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass

from pagedkv.wire import DROPPED_PAGE
from scheduler_svc.pages import PagePool
from scheduler_svc.request import Finish, Request

Key = tuple[str, str]  # (tenant, the caller's key)
DEFAULT_MAX_TTL_S = 3600
DEFAULT_MAX_SHARE = 0.5
MAX_KEY_BYTES = 128


@dataclass(slots=True)
class Retained:
    tenant: str
    key: str
    pages: list[int]  # in prompt order (a prefix of the conversation's page chain)
    expires_at: float  # time.monotonic()


def max_retained_pages(share: float, page_quota: int, num_pages: int) -> int:
    """The most pages a tenant's retentions may hold on a pool: ``share`` of its quota (of the pool without one)."""
    return int(share * min(page_quota or num_pages, num_pages))


class KvRetention:
    def __init__(self, pool: PagePool, host: PagePool | None, on_zero: Callable[[list[int]], None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``on_zero(pages)``: device pages the executor must zero (the KV manager adds them to the next plan)."""
        self._pool = pool
        self._host = host
        self._on_zero = on_zero
        self.clock = clock
        self._held: OrderedDict[Key, Retained] = OrderedDict()  # oldest first
        self._holders: Counter[int] = Counter()  # page -> retentions holding it
        self._pages_of: Counter[str] = Counter()  # tenant -> distinct pages its retentions hold
        self._soonest = math.inf  # no retention expires before this (a lower bound: the plan's check is O(1))

    # ---- reads ---------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._held)

    def __iter__(self) -> Iterator[Retained]:
        return iter(list(self._held.values()))

    def get(self, tenant: str, key: str) -> Retained | None:
        return self._held.get((tenant, key))

    def pages_of(self, tenant: str) -> int:
        """Device pages the tenant's retentions hold (each once)."""
        return self._pages_of[tenant]

    @property
    def pages_by_tenant(self) -> Counter[str]:  # (read only)
        return self._pages_of

    def tables(self) -> list[list[int]]:
        """Each retention's pages (the references it holds: for the pool's integrity check)."""
        return [r.pages for r in self._held.values()]

    def next_expiry(self) -> float | None:
        """No retention expires before this (None: none held); ``expire`` then ends those that did."""
        return self._soonest if self._held else None

    def reclaimable(self, tenant: str | None = None, keep: Collection[int] = ()) -> Key | None:
        """The oldest retention (of ``tenant``; None: any) that holds a page only retentions hold and none of
        ``keep`` (pages a request is about to hit): ending it, or it and the ones after, frees pages. None: none."""
        refcounts, holders = self._pool.refcounts, self._holders
        for key, r in self._held.items():
            if tenant is not None and r.tenant != tenant or (keep and not set(keep).isdisjoint(r.pages)):
                continue
            if any(refcounts[p] == holders[p] for p in r.pages):
                return key
        return None

    # ---- changes -------------------------------------------------------------------------------
    def keep(self, req: Request, finish: Finish, cap: int) -> int:
        """A request ended: with retain_kv and finish stop or length, its full findable pages are retained under
        (tenant, key) for ttl_s, replacing a retention of that key; returns the pages retained. Call it before the
        request's own pages are released."""
        spec = req.retain
        if spec is None or finish is Finish.ABORT:
            return 0
        pages = []
        table, hash_of = req.page_table, self._pool.hash_of
        for i, h in enumerate(req.page_hashes[: req.num_published]):
            if i >= len(table) or table[i] == DROPPED_PAGE or hash_of(table[i]) != h:
                break
            pages.append(table[i])
        tenant, key = req.tenant, (req.tenant, spec.key)
        self._hold(tenant, pages)  # (first: what the retention it replaces shares stays held)
        old = self._held.pop(key, None)
        self._held[key] = new = Retained(tenant, spec.key, pages, self.clock() + spec.ttl_s)
        self._soonest = min(self._soonest, new.expires_at)
        if old is not None:
            self._release(old)
        for other in [r for r in self._held.values() if r.tenant == tenant and r is not new]:
            if self._pages_of[tenant] <= cap:
                break
            self._release(self._held.pop((tenant, other.key)))
        while self._pages_of[tenant] > cap and new.pages:  # alone over the cap: its tail is left out
            self._unhold(tenant, [new.pages.pop()])
        if not new.pages:
            del self._held[key]
        return len(new.pages)

    def end(self, tenant: str, key: str) -> int | None:
        """Ends a retention (ReleaseKv, pressure): returns the pages that went back to the free pool, zeroed (None:
        the tenant has no retention of that key here)."""
        r = self._held.pop((tenant, key), None)
        return None if r is None else self._release(r)

    def expire(self, now: float | None = None) -> int:
        """Ends every retention whose TTL has elapsed; returns how many ended."""
        now = self.clock() if now is None else now
        if now < self._soonest:
            return 0
        ended = [key for key, r in self._held.items() if r.expires_at <= now]
        for key in ended:
            self._release(self._held.pop(key))
        self._soonest = min((r.expires_at for r in self._held.values()), default=math.inf)
        return len(ended)

    def clear(self) -> None:
        """The executor's pages hold nothing any more (another process, or wiped): every retention ends, nothing
        to zero."""
        for r in self._held.values():
            self._pool.free(reversed(r.pages))
        self._held.clear()
        self._holders.clear()
        self._pages_of.clear()

    def _hold(self, tenant: str, pages: list[int]) -> None:
        self._pool.share(pages, tenant)
        for p in pages:
            self._holders[p] += 1
            if self._holders[p] == 1:
                self._pages_of[tenant] += 1

    def _release(self, r: Retained) -> int:
        return self._unhold(r.tenant, r.pages[::-1])

    def _unhold(self, tenant: str, pages: list[int]) -> int:
        """Drops one retention's references to pages (tail first); those no one holds any more are zeroed."""
        pool, host = self._pool, self._host
        pool.free(pages)
        for p in pages:
            self._holders[p] -= 1
            if not self._holders[p]:
                del self._holders[p]
                self._pages_of[tenant] -= 1
        freed = [p for p in pages if pool.refcount(p) == 0]
        if host is not None:  # a free host copy would keep the KV findable
            copies = (host.lookup(h) for h in map(pool.hash_of, freed) if h is not None)
            host.unpublish(hp for hp in copies if hp is not None and host.refcount(hp) == 0)
        pool.zeroed(freed)
        if freed:
            self._on_zero(freed)
        if tenant in self._pages_of and not self._pages_of[tenant]:
            del self._pages_of[tenant]
        return len(freed)

    def checked_tables(self) -> list[list[int]]:
        """Checks that each page's holder count is the retentions holding it, every retained page is still findable
        and the per-tenant counts are the distinct pages held; returns ``tables`` (the pool checks the references)."""
        holders: Counter[int] = Counter(p for r in self._held.values() for p in r.pages)
        assert holders == self._holders, "retained pages' holder counts disagree"
        owners: Counter[str] = Counter()
        for r in self._held.values():
            assert r.pages, f"retention {r.key!r} holds no page"
            for p in r.pages:
                assert self._pool.hash_of(p) is not None, f"retained page {p} is not findable"
        for p in holders:
            owners[self._pool.owner_of(p)] += 1
        assert +self._pages_of == owners, f"retained pages per tenant {dict(self._pages_of)} but {dict(owners)}"
        return self.tables()
