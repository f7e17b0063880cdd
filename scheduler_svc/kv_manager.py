"""Request-level KV memory: prefix-cache hits, page growth with copy-on-write, publishing, release.

The facade between scheduling policy and the page pool. Token regions of a request::

    | cached (hit pages) | computed here | scheduled this step | not yet scheduled |
    0                    hits*bs         num_computed         +n                  compute_target

Pages [0, hits) are shared with the cache; a page becomes findable (published) only once the
executor confirmed the step that filled it. Full pages of the prompt that a running request is
still computing are "in flight": another request that needs them waits instead of computing them too.
"""

from __future__ import annotations

from scheduler_svc.pages import PagePool
from scheduler_svc.prefix_cache import extend_chain
from scheduler_svc.request import Request


class KVManager:
    def __init__(self, pool: PagePool, enable_prefix_caching: bool = True) -> None:
        self.pool = pool
        self.caching = enable_prefix_caching
        self.bs = pool.block_size
        self.inflight: dict[bytes, Request] = {}
        self.num_cached_prompt_tokens = 0

    # ---- admission -----------------------------------------------------------------------------
    def _max_hit_pages(self, req: Request) -> int:
        """Whole pages that may come from the cache: never the one holding the last token to compute."""
        return max(0, (req.compute_target - 1) // self.bs)

    def find_hits(self, req: Request) -> list[int]:
        """The longest cached prefix of a request that holds no pages (read-only)."""
        if not self.caching or req.page_table:
            return []
        limit = self._max_hit_pages(req)
        extend_chain(req.page_hashes, req.hash_root, req.all_token_ids, self.bs, limit)
        hits = []
        for h in req.page_hashes[:limit]:
            page = self.pool.lookup(h)
            if page is None:
                break
            hits.append(page)
        return hits

    def waits_for_inflight(self, req: Request, num_hits: int) -> bool:
        """True when the next page this request would compute is being computed by another request."""
        if not self.caching or num_hits >= self._max_hit_pages(req):
            return False
        owner = self.inflight.get(req.page_hashes[num_hits])
        return owner is not None and owner is not req

    def pages_to_admit(self, hits: list[int], num_tokens: int) -> int:
        """Free pages that admitting with these hits and num_tokens new tokens would take."""
        reused_free = sum(1 for p in hits if self.pool.refcount(p) == 0)
        return self.pool.pages_for(len(hits) * self.bs + num_tokens) - len(hits) + reused_free

    def admit(self, req: Request, hits: list[int], num_tokens: int) -> None:
        """Takes references on the hit pages first, then allocates the suffix."""
        self.pool.share(hits)
        cached = len(hits) * self.bs
        need = self.pool.pages_for(cached + num_tokens) - len(hits)
        req.page_table = hits + self.pool.allocate(need)
        req.num_computed = cached
        req.num_published = len(hits)
        if req.num_preemptions == 0 and req.index == 0 and not req.output_ids:
            req.num_cached_tokens = cached
            self.num_cached_prompt_tokens += cached
        if self.caching:
            self._register_inflight(req, len(hits))

    def _register_inflight(self, req: Request, first: int) -> None:
        full = min(len(req.prompt_ids), req.compute_target) // self.bs
        extend_chain(req.page_hashes, req.hash_root, req.all_token_ids, self.bs, full)
        for h in req.page_hashes[first:full]:
            if h not in self.inflight:
                self.inflight[h] = req
                req.registered.append(h)

    # ---- growth --------------------------------------------------------------------------------
    def _shared_write_page(self, req: Request) -> int | None:
        """Index of the page the next token goes into, if other tables hold it too (copy-on-write)."""
        idx = req.num_computed // self.bs
        if req.num_computed % self.bs and idx < len(req.page_table) and self.pool.refcount(req.page_table[idx]) > 1:
            return idx
        return None

    def pages_to_grow(self, req: Request, num_tokens: int) -> int:
        cow = 1 if self._shared_write_page(req) is not None else 0
        return max(0, self.pool.pages_for(req.num_computed + num_tokens) - len(req.page_table)) + cow

    def grow(self, req: Request, num_tokens: int) -> list[tuple[int, int]]:
        """Makes the table cover num_computed + num_tokens; returns page copies (src, dst) to run first."""
        copies = []
        idx = self._shared_write_page(req)
        if idx is not None:
            src = req.page_table[idx]
            (dst,) = self.pool.allocate(1)
            self.pool.free([src])
            req.page_table[idx] = dst
            copies.append((src, dst))
        need = self.pool.pages_for(req.num_computed + num_tokens) - len(req.page_table)
        if need > 0:
            req.page_table.extend(self.pool.allocate(need))
        return copies

    def fork(self, parent: Request, child: Request) -> None:
        """The child points at every page of the parent (one more reference each)."""
        self.pool.share(parent.page_table)
        child.page_table = list(parent.page_table)
        child.num_computed = parent.num_computed
        child.page_hashes = list(parent.page_hashes)
        child.num_published = parent.num_published

    # ---- confirmation and release --------------------------------------------------------------
    def publish(self, req: Request) -> None:
        """After the executor confirmed a step: make the request's newly full pages findable."""
        if not self.caching:
            return
        full = min(req.num_computed // self.bs, len(req.page_table))
        if full <= req.num_published:
            return
        extend_chain(req.page_hashes, req.hash_root, req.all_token_ids, self.bs, full)
        for j in range(req.num_published, full):
            h = req.page_hashes[j]
            self.pool.publish(req.page_table[j], h)
            if self.inflight.get(h) is req:
                del self.inflight[h]
        req.num_published = full

    def release(self, req: Request) -> None:
        """Frees a request's pages tail-first and drops its in-flight claims; published pages stay findable."""
        self.pool.free(reversed(req.page_table))
        req.page_table = []
        req.num_computed = 0
        req.num_published = 0
        for h in req.registered:
            if self.inflight.get(h) is req:
                del self.inflight[h]
        req.registered = []
