"""Request-level KV memory: prefix-cache hits, page growth with copy-on-write, publishing, release.

The facade between scheduling policy and the page pool. Token regions of a request::

    | cached (hit pages) | computed here | scheduled this step | not yet scheduled |
    0                    hits*bs         num_computed         +n                  compute_target

(num_computed counts the tokens of plans still in flight: ``Request.num_confirmed`` are those confirmed.)

Pages [0, hits) are shared with the cache; a page becomes findable (published) only once the
executor confirmed the step that filled it. Full pages of the prompt that a running request is
still computing are "in flight": another request that needs them waits instead of computing them too.

The host tier (optional) is a second PagePool of the same page size. It holds the pages of swapped-out
requests (``req.host_table``) and, in its free LRU, prefix-cache pages spilled there when the device
evicted them. Both are found by the same hashes, so a hit may come from either tier (tenant roots keep
tenants apart in both). Every page movement is recorded in ``ops`` for the next plan; the executor runs
swap-outs, then swap-ins, then copies, then the forward. Host pages read by a swap-in stay held until the
plan that reads them is confirmed (``ops.host_release``), so no swap-out of the same plan can reuse them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler_svc.pages import PagePool
from scheduler_svc.prefix_cache import extend_chain
from scheduler_svc.request import Request
from scheduler_svc.snapshot import Counters

Hit = tuple[int, bool]  # (page id, on the host tier)
DROPPED = -1  # a page-table entry whose page left (outside the request's attention window)


def held(table: list[int]):
    """The pages a table holds (entries of dropped pages left out)."""
    return (p for p in table if p != DROPPED)


@dataclass(slots=True)
class PageOps:
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, host)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host, device)
    copy: list[tuple[int, int]] = field(default_factory=list)  # (device, device), copy-on-write
    host_release: list[int] = field(default_factory=list)  # host references to drop once the plan ran

    def __bool__(self) -> bool:
        return bool(self.swap_out or self.swap_in or self.copy or self.host_release)


class KVManager:
    def __init__(self, pool: PagePool, enable_prefix_caching: bool = True, host: PagePool | None = None,
                 counters: Counters | None = None) -> None:
        self.pool = pool
        self.host = host if host is not None and host.num_pages else None
        self.caching = enable_prefix_caching
        self.bs = pool.block_size
        self.inflight: dict[bytes, Request] = {}  # prefix pages being computed: hash -> the request computing it
        self.ops = PageOps()
        self.counters = counters if counters is not None else Counters()  # (the owner's: they outlive this)
        if self.host is not None and self.caching:
            pool.on_evict = self._spill

    def take_ops(self) -> PageOps:
        ops, self.ops = self.ops, PageOps()
        return ops

    # ---- admission -----------------------------------------------------------------------------
    def _max_hit_pages(self, req: Request) -> int:
        """Whole pages that may come from the cache: never the one holding the last token to compute."""
        return max(0, (req.compute_target - 1) // self.bs)

    def find_hits(self, req: Request) -> list[Hit]:
        """The longest cached prefix of a request that holds no pages (read-only): each page from the
        device tier if it is there, else from the host tier."""
        if not self.caching or req.page_table:
            return []
        limit = self._max_hit_pages(req)
        extend_chain(req.page_hashes, req.hash_root, req.all_token_ids, self.bs, limit)
        hits = []
        for h in req.page_hashes[:limit]:
            page = self.pool.lookup(h)
            if page is not None:
                hits.append((page, False))
                continue
            page = self.host.lookup(h) if self.host is not None else None
            if page is None:
                break
            hits.append((page, True))
        return hits

    def waits_for_inflight(self, req: Request, num_hits: int) -> bool:
        """True when the next page this request would compute is being computed by another request."""
        if not self.caching or num_hits >= self._max_hit_pages(req):
            return False
        owner = self.inflight.get(req.page_hashes[num_hits])
        return owner is not None and owner is not req

    def pages_to_admit(self, hits: list[Hit], num_tokens: int) -> int:
        """Free device pages that admitting with these hits and num_tokens new tokens would take (a host
        hit takes a device page to be copied into)."""
        taken = sum(1 for p, on_host in hits if on_host or self.pool.refcount(p) == 0)
        return self.pool.pages_for(len(hits) * self.bs + num_tokens) - len(hits) + taken

    def admit(self, req: Request, hits: list[Hit], num_tokens: int) -> None:
        """Takes references on the device hits first (so no allocation evicts them), brings host hits
        back, then allocates the suffix."""
        self.pool.share((p for p, on_host in hits if not on_host), req.tenant)
        host_hits = [p for p, on_host in hits if on_host]
        if host_hits:  # held before any allocation: a spill must not evict one of them
            self.host.share(host_hits)
            self.ops.host_release.extend(host_hits)
            self.counters.spill_hits += len(host_hits)
        table = [p if not on_host else self._bring_back(p, req.page_hashes[j], req.tenant)
                 for j, (p, on_host) in enumerate(hits)]
        cached = len(hits) * self.bs
        need = self.pool.pages_for(cached + num_tokens) - len(hits)
        req.page_table = table + self.pool.allocate(need, req.tenant)
        req.num_computed = cached
        req.num_published = len(hits)
        if (req.num_preemptions == 0 and req.num_migrations == 0 and req.index == 0
                and len(req.output_ids) == req.num_resumed):
            # once per client request (not again after a preemption or move; once more on the scheduler that
            # resumed it), of its prompt only (a resumed request may also hit pages of the tokens it had received)
            prompt_hit = min(cached, len(req.prompt_ids))
            req.num_cached_tokens = prompt_hit
            self.counters.cached_prompt_tokens += prompt_hit
            self.counters.prompt_tokens_queried += len(req.prompt_ids)
        if self.caching:
            self._register_inflight(req, len(hits))

    def _register_inflight(self, req: Request, first: int) -> None:
        full = min(len(req.prompt_ids), req.compute_target) // self.bs
        extend_chain(req.page_hashes, req.hash_root, req.all_token_ids, self.bs, full)
        for h in req.page_hashes[first:full]:
            if h not in self.inflight:
                self.inflight[h] = req
                req.registered.append(h)

    # ---- the host tier ---------------------------------------------------------------------------
    def _bring_back(self, host_page: int, page_hash: bytes | None, owner: str) -> int:
        """A device page that will hold a host page's contents after this plan's swap-ins. The caller holds
        host_page until the plan ran (ops.host_release)."""
        (page,) = self.pool.allocate(1, owner)
        self.ops.swap_in.append((host_page, page))
        self.counters.pages_swapped_in += 1
        if page_hash is not None:
            self.pool.publish(page, page_hash)  # the copy-in runs before anything that could read it
        return page

    def _spill(self, page: int, page_hash: bytes) -> None:
        """The device is about to reuse a cached page: keep its contents in the host tier (LRU) if there
        is a free host page and the tier does not hold them already."""
        if self.host.lookup(page_hash) is not None or not self.host.num_free:
            return
        (hp,) = self.host.allocate(1)
        self.host.publish(hp, page_hash)
        self.host.free([hp])  # free but findable, most recently used
        self.ops.swap_out.append((page, hp))
        self.counters.pages_swapped_out += 1
        self.counters.spilled_pages += 1

    def _swap_out_plan(self, req: Request) -> tuple[int, int]:
        """(pages to copy, free host pages taken) for swapping req out; its filled pages go to the host,
        except those whose contents the host tier already caches (shared there)."""
        copies = taken = 0
        for p in held(req.page_table[: self.pool.pages_for(req.num_computed)]):
            h = self.pool.hash_of(p)
            hp = self.host.lookup(h) if h is not None else None
            if hp is None:
                copies += 1
                taken += 1
            elif self.host.refcount(hp) == 0:
                taken += 1
        return copies, taken

    def shared_cached_tokens(self, req: Request) -> int:
        """Tokens of req in cached pages other requests hold too: a recompute would find them again."""
        n = 0
        for p in req.page_table[: self.pool.pages_for(req.num_computed)]:
            if p == DROPPED or self.pool.refcount(p) < 2 or self.pool.hash_of(p) is None:
                break
            n += 1
        return min(n * self.bs, req.num_computed)

    def swap_out_cost(self, req: Request) -> int | None:
        """Pages that swapping req out would copy, or None when the host tier cannot take it."""
        if self.host is None or req.num_computed == 0:
            return None
        copies, taken = self._swap_out_plan(req)
        return copies if taken <= self.host.num_free else None

    def swap_out(self, req: Request) -> None:
        """Moves req's filled pages to the host tier and frees its device pages; req keeps num_computed."""
        host_table = []
        for p in req.page_table[: self.pool.pages_for(req.num_computed)]:
            if p == DROPPED:
                host_table.append(DROPPED)
                continue
            h = self.pool.hash_of(p)
            hp = self.host.lookup(h) if h is not None else None
            if hp is not None:
                self.host.share([hp])
            else:
                (hp,) = self.host.allocate(1)
                self.ops.swap_out.append((p, hp))
                self.counters.pages_swapped_out += 1
                if h is not None:
                    self.host.publish(hp, h)
            host_table.append(hp)
        num_computed, num_published = req.num_computed, req.num_published
        self.release(req)
        req.host_table = host_table
        req.num_computed, req.num_published = num_computed, num_published

    def pages_to_swap_in(self, req: Request, num_tokens: int) -> int:
        """Free device pages that swapping req in and growing it by num_tokens would take."""
        taken = 0
        for hp in held(req.host_table):
            h = self.host.hash_of(hp)
            page = self.pool.lookup(h) if h is not None else None
            if page is None or self.pool.refcount(page) == 0:
                taken += 1
        return taken + max(0, self.pool.pages_for(req.num_computed + num_tokens) - len(req.host_table))

    def swap_in(self, req: Request, num_tokens: int) -> None:
        """Gives req device pages again: contents still cached on the device are shared, the rest copied in."""
        found = []
        for hp in req.host_table:
            h = self.host.hash_of(hp) if hp != DROPPED else None
            page = self.pool.lookup(h) if h is not None else None
            found.append((DROPPED if hp == DROPPED else page, h))
        self.pool.share((page for page, _ in found if page not in (None, DROPPED)), req.tenant)
        req.page_table = [page if page is not None else self._bring_back(hp, h, req.tenant)
                          for hp, (page, h) in zip(req.host_table, found)]
        # Pages copied in are read by this plan: their references drop once it ran; the others now.
        self.ops.host_release.extend(hp for hp, (page, _) in zip(req.host_table, found) if page is None)
        self.host.free(hp for hp, (page, _) in zip(req.host_table, found) if page not in (None, DROPPED))
        req.host_table = []
        if self.caching:
            self._register_inflight(req, req.num_published)
        self.grow(req, num_tokens)

    def confirm(self, ops: PageOps) -> None:
        """The plan that carried ops ran: the host pages its swap-ins read may be reused."""
        if self.host is not None:
            self.host.free(ops.host_release)

    # ---- attention window (sink + the most recent tokens) ----------------------------------------
    def sink_pages(self, req: Request) -> int:
        return -(-req.sink_tokens // self.bs)

    def window_chunk_limit(self, req: Request, num_tokens: int) -> int:
        """The most of num_tokens the request may compute this step without holding more than its page
        budget: the earliest query of the step decides which pages stay visible."""
        limit = req.page_budget or req.page_limit
        if not limit:
            return num_tokens
        p0 = req.num_computed
        sink = self.sink_pages(req)
        first_visible_page = max(0, p0 - req.window_tokens + 1) // self.bs if req.window_tokens else 0
        pages = limit - sink + max(sink, first_visible_page)
        return max(1, min(num_tokens, pages * self.bs - p0))

    def drop_outside_window(self, req: Request) -> list[int]:
        """Frees the pages no query from num_computed on can see (wholly between the sink and the window);
        returns their indices (the executor is told)."""
        if not req.window_tokens:
            return []
        # a swapped-out request drops host pages (before they would be copied back)
        table, pool = (req.host_table, self.host) if req.host_table else (req.page_table, self.pool)
        first_visible = req.num_computed - req.window_tokens + 1
        end = min(max(0, first_visible) // self.bs, len(table))
        dropped = [i for i in range(self.sink_pages(req), end) if table[i] != DROPPED]
        if dropped:
            pool.free(table[i] for i in dropped)
            for i in dropped:
                table[i] = DROPPED
        return dropped

    # ---- growth --------------------------------------------------------------------------------
    def decodes_in_place(self, req: Request) -> bool:
        """The steady decode: one token into the request's own last page (not shared, not full), no window.
        Nothing to allocate, copy or drop for it."""
        computed = req.num_computed
        return bool(computed % self.bs and not req.window_tokens and req.num_uncomputed == 1
                    and self.pool.refcounts[req.page_table[computed // self.bs]] == 1)

    def _shared_write_page(self, req: Request) -> int | None:
        """Index of the page the next token goes into, if other tables hold it too (copy-on-write)."""
        idx = req.num_computed // self.bs
        if req.num_computed % self.bs and idx < len(req.page_table) and self.pool.refcount(req.page_table[idx]) > 1:
            return idx
        return None

    def writes_shared_page(self, req: Request) -> bool:
        """The next token goes into a page other tables hold: growing copies it (the table changes in place)."""
        return self._shared_write_page(req) is not None

    def pages_to_grow(self, req: Request, num_tokens: int) -> int:
        cow = 1 if self._shared_write_page(req) is not None else 0
        return max(0, self.pool.pages_for(req.num_computed + num_tokens) - len(req.page_table)) + cow

    def grow(self, req: Request, num_tokens: int) -> bool:
        """Makes the table cover num_computed + num_tokens (a shared page about to be written is copied
        first, recorded in ops.copy); True when a page of the table changed in place."""
        idx = self._shared_write_page(req)
        if idx is not None:
            src = req.page_table[idx]
            (dst,) = self.pool.allocate(1, req.tenant)
            self.pool.free([src])
            req.page_table[idx] = dst
            self.ops.copy.append((src, dst))
        need = self.pool.pages_for(req.num_computed + num_tokens) - len(req.page_table)
        if need > 0:
            req.page_table.extend(self.pool.allocate(need, req.tenant))
        return idx is not None

    def fork(self, parent: Request, child: Request) -> None:
        """The child points at every page of the parent (one more reference each)."""
        self.pool.share(held(parent.page_table), parent.tenant)
        child.page_table = list(parent.page_table)
        child.num_computed = parent.num_computed
        child.page_hashes = list(parent.page_hashes)
        child.num_published = parent.num_published

    # ---- confirmation and release --------------------------------------------------------------
    def publish(self, req: Request) -> None:
        """After the executor confirmed a step: make the request's newly full pages findable (those the
        confirmed tokens filled; a plan still in flight may be filling the next)."""
        if not self.caching:
            return
        full = min(req.num_confirmed // self.bs, len(req.page_table))
        if full <= req.num_published:
            return
        extend_chain(req.page_hashes, req.hash_root, req.all_token_ids, self.bs, full)
        for j in range(req.num_published, full):
            h = req.page_hashes[j]
            if req.page_table[j] != DROPPED:
                self.pool.publish(req.page_table[j], h)
            if self.inflight.get(h) is req:
                del self.inflight[h]
        req.num_published = full

    def release(self, req: Request) -> None:
        """Frees a request's pages (both tiers) tail-first and drops its in-flight claims; published pages
        stay findable."""
        self.pool.free(held(reversed(req.page_table)))
        if req.host_table:
            self.host.free(held(reversed(req.host_table)))
            req.host_table = []
        req.page_table = []
        req.num_computed = 0
        req.num_published = 0
        for h in req.registered:
            if self.inflight.get(h) is req:
                del self.inflight[h]
        req.registered = []

    # ---- what the executor holds ---------------------------------------------------------------
    def forget_cached(self) -> None:
        """The executor's pages hold nothing any more (another process): no prefix-cache hit may point there."""
        self.pool.forget_hashes()
        if self.host is not None:
            self.host.forget_hashes()
        self.inflight.clear()

    def unpublish_written(self, unconfirmed: list[PageOps]) -> None:
        """Page operations whose running is unknown (a lost stream): the pages they write into are no longer
        findable (device pages swapped or copied into, host pages swapped out to)."""
        device, host = set(), set()
        for ops in unconfirmed:
            device.update(dst for _, dst in ops.swap_in)
            device.update(dst for _, dst in ops.copy)
            host.update(dst for _, dst in ops.swap_out)
        self.inflight.clear()
        self.pool.unpublish(device)
        if self.host is not None:
            self.host.unpublish(host)

    def slots_filled(self, running: list[Request]) -> int:
        """Token slots of the device pages in use that hold KV (each page once, however many share it)."""
        bs = self.bs
        fill: dict[int, int] = {}
        for r in running:
            full, rest = divmod(r.num_computed, bs)
            for j, page in enumerate(r.page_table):
                if page == DROPPED:
                    continue
                n = bs if j < full else (rest if j == full else 0)
                if n > fill.get(page, 0):
                    fill[page] = n
        return sum(fill.values())

    def release_preview(self) -> ReleasePreview:
        return ReleasePreview(self.pool)


class ReleasePreview:
    """What preempting some requests would give back, on paper: free device pages, and pages per tenant
    (a page other requests still hold stays used)."""

    def __init__(self, pool: PagePool) -> None:
        self.pool = pool
        self.free = pool.num_free
        self.used = pool.used_by.copy()
        self._holders: dict[int, int] = {}

    def add(self, victim: Request) -> None:
        for p in held(victim.page_table):
            self._holders[p] = self._holders.get(p, 0) + 1
            if self._holders[p] == self.pool.refcount(p):
                self.free += 1
                self.used[self.pool.owner[p]] -= 1
