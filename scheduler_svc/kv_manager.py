"""Request-level KV memory: prefix-cache hits, page growth with copy-on-write, publishing, release.

The facade between scheduling policy and the page pool. Token regions of a request::

    | cached (hit pages) | computed here | scheduled this step | not yet scheduled |
    0                    hits*bs         num_computed         +n                  compute_target

(num_computed counts the tokens of plans still in flight: ``Request.num_confirmed`` are those confirmed.)

Pages [0, hits) are shared with the cache; a page becomes findable (published) only once the executor confirmed the
step that filled it. Full pages of the prompt that a running request is still computing are "in flight": another
request that needs them waits instead of computing them too.

The host tier (optional; host_tier.py) holds the pages of swapped-out requests and, in its free LRU, prefix-cache
pages spilled there when the device evicted them, found by the same hashes: a hit may come from either tier (tenant
roots keep tenants apart in both). ``HostTier`` decides the pages and copies of a move between the tiers; this class
installs the resulting tables and releases, registers and grows the rest. Every page movement is recorded in
``ops`` for the next plan (step.PageOps).
"""

from __future__ import annotations

from collections.abc import Iterable

from pagedkv.wire import DROPPED_PAGE
from scheduler_svc.host_tier import HostTier
from scheduler_svc.pages import PagePool, held
from scheduler_svc.prefix_cache import extend_chain
from scheduler_svc.request import Request, Status
from scheduler_svc.rides import planned_pages
from scheduler_svc.snapshot import Counters
from scheduler_svc.step import PageOps

Hit = tuple[int, bool]  # (page id, on the host tier)


class KVManager:
    def __init__(self, pool: PagePool, enable_prefix_caching: bool = True, host: PagePool | None = None,
                 counters: Counters | None = None, exact_tail_pages: int = 0) -> None:
        self._pool = pool
        self._tail = max(0, exact_tail_pages - 1)  # pages before the last prompt page that are never hits
        self._host = host if host is not None and host.num_pages else None
        self._caching = enable_prefix_caching
        self._bs = pool.block_size
        self._refcounts = pool.refcounts  # (read in the steady decode's check, for every request and step)
        self._inflight: dict[bytes, Request] = {}  # prefix pages being computed: hash -> the request computing it
        self._ops = PageOps()
        self._rides = True  # find_hits adds the prefix pages another running request has planned (rides.py)
        self._counters = counters if counters is not None else Counters()  # (the owner's: they outlive this)
        self._tier = HostTier(pool, self._host, self._counters) if self._host is not None else None
        if self._tier is not None and self._caching:
            pool.on_evict(lambda page, page_hash: self._tier.spill(page, page_hash, self._ops))

    @property
    def pool(self) -> PagePool:
        return self._pool

    @property
    def host(self) -> PagePool | None:  # (None: no swap space)
        return self._host

    @property
    def host_tier(self) -> HostTier | None:  # swap costs (None: no swap space)
        return self._tier

    @property
    def caching(self) -> bool:
        return self._caching

    @property
    def inflight(self) -> dict[bytes, Request]:  # (read only)
        return self._inflight

    @property
    def ops(self) -> PageOps:  # recorded for the next plan, not taken yet
        return self._ops

    def take_ops(self) -> PageOps:
        ops, self._ops = self._ops, PageOps()
        return ops

    # ---- admission -----------------------------------------------------------------------------
    def _max_hit_pages(self, req: Request) -> int:
        """Whole pages that may come from the cache: never the one holding the last token to compute, nor the
        exact tail's pages before it (an executor reads a request's last pages from a bfloat16 copy only where the
        request wrote them itself: executor_svc/kv_tail.py); none for a request that computes its prompt's
        log-probabilities (as vLLM: every prompt position's logits are needed)."""
        return 0 if req.computes_prompt_logprobs else max(0, (req.compute_target - 1) // self._bs - self._tail)

    def find_hits(self, req: Request) -> list[Hit]:
        """The longest cached prefix of a request that holds no pages (read-only): each page from the
        device tier if it is there, else from the host tier; then the pages another request has planned."""
        if not self._caching or req.page_table:
            return []
        limit = self._max_hit_pages(req)
        extend_chain(req.page_hashes, req.hash_root, req.all_token_ids, self._bs, limit)
        hits = []
        for h in req.page_hashes[:limit]:
            page = self._pool.lookup(h)
            if page is not None:
                hits.append((page, False))
                continue
            page = self._host.lookup(h) if self._host is not None else None
            if page is None:
                break
            hits.append((page, True))
        if self._rides:
            hits += [(p, False) for p in planned_pages(self._inflight, req, len(hits), limit, self._bs)]
        return hits

    def set_rides(self, on: bool) -> None:
        """Whether find_hits adds the pages another request's plans compute (off while plans go one at a time)."""
        self._rides = on

    def waits_for_inflight(self, req: Request, num_hits: int) -> bool:
        """True when the next page this request would compute is being computed by another request."""
        if not self._caching or num_hits >= self._max_hit_pages(req):
            return False
        owner = self._inflight.get(req.page_hashes[num_hits])
        return owner is not None and owner is not req

    def pages_to_admit(self, hits: list[Hit], num_tokens: int) -> int:
        """Free device pages that admitting with these hits and num_tokens new tokens would take (a host
        hit takes a device page to be copied into)."""
        taken = sum(1 for p, on_host in hits if on_host or self._pool.refcount(p) == 0)
        return self._pool.pages_for(len(hits) * self._bs + num_tokens) - len(hits) + taken

    def admit(self, req: Request, hits: list[Hit], num_tokens: int) -> None:
        """Takes references on the device hits first (so no allocation evicts them), brings host hits
        back, then allocates the suffix."""
        self._pool.share((p for p, on_host in hits if not on_host), req.tenant)
        host_hits = [p for p, on_host in hits if on_host]
        if host_hits:  # held before any allocation: a spill must not evict one of them
            self._tier.hold_hits(host_hits, self._ops)
        table = [p if not on_host else self._tier.bring_back(p, req.page_hashes[j], req.tenant, self._ops)
                 for j, (p, on_host) in enumerate(hits)]
        cached = len(hits) * self._bs
        need = self._pool.pages_for(cached + num_tokens) - len(hits)
        req.page_table = table + self._pool.allocate(need, req.tenant)
        req.num_computed = cached
        req.num_published = len(hits)
        if (req.num_preemptions == 0 and req.num_migrations == 0 and req.index == 0
                and len(req.output_ids) == req.num_resumed):
            # once per client request (not again after a preemption or move; once more on the scheduler that
            # resumed it), of its prompt only (a resumed request may also hit pages of the tokens it had received)
            prompt_hit = min(cached, len(req.prompt_ids))
            req.num_cached_tokens = prompt_hit
            self._counters.cached_prompt_tokens += prompt_hit
            self._counters.prompt_tokens_queried += len(req.prompt_ids)
        if self._caching:
            self._register_inflight(req, len(hits))

    def _register_inflight(self, req: Request, first: int) -> None:
        full = min(len(req.prompt_ids), req.compute_target) // self._bs
        extend_chain(req.page_hashes, req.hash_root, req.all_token_ids, self._bs, full)
        for h in req.page_hashes[first:full]:
            if h not in self._inflight:
                self._inflight[h] = req
                req.registered.append(h)

    # ---- the host tier (host_tier.py decides the pages and copies) ------------------------------
    def swap_out(self, req: Request) -> None:
        """Moves req's filled pages to the host tier and frees its device pages; req keeps num_computed."""
        host_table = self._tier.swap_out(req, self._ops)
        num_computed, num_published = req.num_computed, req.num_published
        self.release(req)
        req.host_table = host_table
        req.num_computed, req.num_published = num_computed, num_published

    def swap_in(self, req: Request, num_tokens: int) -> None:
        """Gives req device pages again (shared where the device still caches them, else copied in) and grows it."""
        req.page_table = self._tier.swap_in(req, self._ops)
        req.host_table = []
        if self._caching:
            self._register_inflight(req, req.num_published)
        self.grow(req, num_tokens)

    def confirm(self, ops: PageOps) -> None:
        """The plan that carried ops ran: the host pages its swap-ins read may be reused."""
        if self._host is not None:
            self._host.free(ops.host_release)

    # ---- attention window (sink + the most recent tokens) ----------------------------------------
    def window_chunk_limit(self, req: Request, num_tokens: int) -> int:
        """The most of num_tokens the request may compute this step without holding more than its page
        budget: the earliest query of the step decides which pages stay visible."""
        limit = req.page_budget or req.page_limit
        if not limit:
            return num_tokens
        p0 = req.num_computed
        sink = -(-req.sink_tokens // self._bs)  # (its pages)
        first_visible_page = max(0, p0 - req.window_tokens + 1) // self._bs if req.window_tokens else 0
        pages = limit - sink + max(sink, first_visible_page)
        return max(1, min(num_tokens, pages * self._bs - p0))

    def drop_outside_window(self, req: Request) -> list[int]:
        """Frees the pages no query from num_computed on can see (wholly between the sink and the window);
        returns their indices (the executor is told)."""
        if not req.window_tokens:
            return []
        # a swapped-out request drops host pages (before they would be copied back)
        table, pool = (req.host_table, self._host) if req.host_table else (req.page_table, self._pool)
        first_visible = req.num_computed - req.window_tokens + 1
        end = min(max(0, first_visible) // self._bs, len(table))
        dropped = [i for i in range(-(-req.sink_tokens // self._bs), end) if table[i] != DROPPED_PAGE]
        if dropped:
            pool.free(table[i] for i in dropped)
            for i in dropped:
                table[i] = DROPPED_PAGE
        return dropped

    # ---- growth --------------------------------------------------------------------------------
    def decodes_in_place(self, req: Request) -> bool:
        """The steady decode: one token into the request's own last page (not shared, not full), no window.
        Nothing to allocate, copy or drop for it."""
        computed = req.num_computed
        return bool(computed % self._bs and not req.window_tokens and req.num_uncomputed == 1
                    and self._refcounts[req.page_table[computed // self._bs]] == 1)

    def writes_shared_page(self, req: Request) -> bool:
        """The next token goes into a page other tables hold: growing copies it (copy-on-write; the table changes
        in place)."""
        idx = req.num_computed // self._bs
        return bool(req.num_computed % self._bs and idx < len(req.page_table)
                    and self._pool.refcount(req.page_table[idx]) > 1)

    def pages_to_grow(self, req: Request, num_tokens: int) -> int:
        cow = 1 if self.writes_shared_page(req) else 0
        return max(0, self._pool.pages_for(req.num_computed + num_tokens) - len(req.page_table)) + cow

    def grow(self, req: Request, num_tokens: int) -> bool:
        """Makes the table cover num_computed + num_tokens (a shared page about to be written is copied
        first, recorded in ops.copy); True when a page of the table changed in place."""
        cow = self.writes_shared_page(req)
        if cow:
            idx = req.num_computed // self._bs
            src = req.page_table[idx]
            (dst,) = self._pool.allocate(1, req.tenant)
            self._pool.free([src])
            req.page_table[idx] = dst
            self._ops.copy.append((src, dst))
        need = self._pool.pages_for(req.num_computed + num_tokens) - len(req.page_table)
        if need > 0:
            req.page_table.extend(self._pool.allocate(need, req.tenant))
        return cow

    def fork(self, parent: Request, child: Request) -> None:
        """The child points at every page of the parent (one more reference each)."""
        self._pool.share(held(parent.page_table), parent.tenant)
        child.page_table = list(parent.page_table)
        child.num_computed = parent.num_computed
        child.page_hashes = list(parent.page_hashes)
        child.num_published = parent.num_published

    # ---- confirmation and release --------------------------------------------------------------
    def publish(self, req: Request) -> None:
        """After the executor confirmed a step: make the request's newly full pages findable (those the
        confirmed tokens filled; a plan still in flight may be filling the next)."""
        full = min(req.num_confirmed // self._bs, len(req.page_table))
        if not self._caching or full <= req.num_published:
            return
        extend_chain(req.page_hashes, req.hash_root, req.all_token_ids, self._bs, full)
        events = self._pool.events  # (a page findable for the first time is described to the KV event log)
        for j in range(req.num_published, full):
            h = req.page_hashes[j]
            if req.page_table[j] != DROPPED_PAGE and self._pool.publish(req.page_table[j], h) and events is not None:
                events.describe(req, j)
            if self._inflight.get(h) is req:
                del self._inflight[h]
        req.num_published = full

    def release(self, req: Request) -> None:
        """Frees a request's pages (both tiers) tail-first and drops its in-flight claims; published pages
        stay findable."""
        self._pool.free(held(reversed(req.page_table)))
        if req.host_table:
            self._host.free(held(reversed(req.host_table)))
            req.host_table = []
        req.page_table, req.num_computed, req.num_published = [], 0, 0
        for h in req.registered:
            if self._inflight.get(h) is req:
                del self._inflight[h]
        req.registered = []

    # ---- what the executor holds ---------------------------------------------------------------
    def forget_cached(self) -> None:
        """The executor's pages hold nothing any more (another process): no prefix-cache hit may point there."""
        self._pool.forget_hashes()
        if self._host is not None:
            self._host.forget_hashes()
        self._inflight.clear()

    def unpublish_written(self, unconfirmed: list[PageOps]) -> None:
        """Page operations whose running is unknown (a lost stream): the pages they write into are no longer
        findable (device pages swapped or copied into, host pages swapped out to)."""
        device, host = set(), set()
        for ops in unconfirmed:
            device.update(dst for _, dst in ops.swap_in)
            device.update(dst for _, dst in ops.copy)
            host.update(dst for _, dst in ops.swap_out)
        self._inflight.clear()
        self._pool.unpublish(device)
        if self._host is not None:
            self._host.unpublish(host)

    def check_integrity(self, running: list[Request], swapped: Iterable[Request], pending: list[PageOps],
                        retained: list[list[int]]) -> None:
        """Both tiers: every page's refcount equals the tables holding it (``pending``: page operations not yet
        confirmed, whose swap-ins hold host pages; ``retained``: the retentions' pages); page budgets hold; in-flight
        prefix claims are running requests'; a swapped request's host table covers what it computed."""
        self._pool.check_integrity([*(list(held(r.page_table)) for r in running), *retained])
        for r in running:
            if r.page_budget:
                pages = sum(1 for _ in held(r.page_table))
                assert pages <= r.page_budget, f"{r.request_id} holds {pages} pages, budget {r.page_budget}"
        if self._host is not None:
            self._host.check_integrity([*(list(held(r.host_table)) for r in swapped),
                                        *(ops.host_release for ops in pending)])
        for h, owner in self._inflight.items():
            assert owner.status is Status.RUNNING and h in owner.registered, "stale in-flight page claim"
        for r in swapped:
            assert len(r.host_table) == self._pool.pages_for(r.num_computed), f"{r.request_id}: host table size"
