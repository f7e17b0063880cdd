"""Page accounting: the one place that hands out and takes back page ids (one PagePool per tier).

Every page is either used (refcount >= 1: that many page tables hold it) or free (refcount 0, in
the free queue). A free page may still carry the hash of the tokens it holds: it stays findable
by the prefix cache until the pool hands it out again ("free is not evicted"). The free queue is
an LRU with O(1) removal from the middle (a cache hit on a free page takes it out of the queue).

Policy code asks ``can_allocate``/``allocate``, ``lookup``/``share``, ``publish`` and ``free``; it never
touches the queue, the refcounts or the hash maps. The same class accounts for the device tier and the
host tier (swap space); ``on_evict`` lets the owner copy a cached page elsewhere before it is reused. With
``events`` (the process's KvEventLog) every change of what is findable is reported to it, as ``medium``.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable

from pagedkv.wire import DROPPED_PAGE
from scheduler_svc.kv_events import DEVICE_MEDIUM, HOST_MEDIUM, KvEventLog


def held(table: list[int]):
    """The pages a page table holds (entries of dropped pages left out)."""
    return (p for p in table if p != DROPPED_PAGE)


def tier_pools(num_pages: int, block_size: int, num_host_pages: int, events: KvEventLog | None = None,
               ) -> tuple[PagePool, PagePool | None]:
    """One executor's pools: its device pages and its host pages (None: no swap space), both reporting to
    ``events``."""
    host = (PagePool(num_host_pages, block_size, min_pages=0, events=events, medium=HOST_MEDIUM)
            if num_host_pages else None)
    return PagePool(num_pages, block_size, events=events), host


class OutOfPages(Exception):
    pass


class PagePool:
    def __init__(self, num_pages: int, block_size: int, min_pages: int = 1,
                 on_evict: Callable[[int, bytes], None] | None = None, events: KvEventLog | None = None,
                 medium: str = DEVICE_MEDIUM) -> None:
        if num_pages < min_pages:
            raise ValueError(f"num_pages must be >= {min_pages}, got {num_pages}")
        self._on_evict = on_evict  # called with (page, hash) when a cached free page is handed out again
        self._events = events  # (None: no one listens; the hot paths check only that)
        self._medium = medium
        self._num_pages = num_pages
        self._block_size = block_size
        self._refcounts = [0] * num_pages
        # The tenant a used page counts against (pages are shared only within a tenant: prefix-cache hits
        # are per tenant, forks belong to their parent's).
        self._owner: list[str | None] = [None] * num_pages
        self._used_by: Counter[str] = Counter()
        self._free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_pages))  # front = next out
        self._hash_of_page: dict[int, bytes] = {}
        self._page_of_hash: dict[bytes, int] = {}

    # ---- reads (the containers themselves: read them, never change them) ---------------------------
    @property
    def num_pages(self) -> int:
        return self._num_pages

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def refcounts(self) -> list[int]:
        """Each page's reference count (a hot loop may keep this list: the pool changes it in place)."""
        return self._refcounts

    @property
    def used_by(self) -> Counter[str]:
        """Pages in use per tenant."""
        return self._used_by

    @property
    def free_queue(self) -> OrderedDict[int, None]:
        """The free pages, next out first."""
        return self._free_queue

    @property
    def events(self) -> KvEventLog | None:
        """The KV event log this pool reports to (None: KV events are off)."""
        return self._events

    @property
    def medium(self) -> str:
        return self._medium

    def owner_of(self, page: int) -> str | None:
        """The tenant a used page counts against (None: free)."""
        return self._owner[page]

    def on_evict(self, callback: Callable[[int, bytes], None] | None) -> None:
        """``callback(page, hash)`` runs when a cached free page is handed out again (its contents are lost)."""
        self._on_evict = callback

    @property
    def num_free(self) -> int:
        return len(self._free_queue)

    @property
    def num_used(self) -> int:
        return self._num_pages - len(self._free_queue)

    @property
    def num_cached(self) -> int:
        """Pages findable by hash (used or free)."""
        return len(self._page_of_hash)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self._block_size)

    def can_allocate(self, num_pages: int) -> bool:
        return num_pages <= len(self._free_queue)

    def allocate(self, num_pages: int, owner: str = "") -> list[int]:
        """Takes pages from the front of the free queue for ``owner`` (a tenant); a page that still had a
        hash loses it now."""
        if num_pages > len(self._free_queue):
            raise OutOfPages(f"need {num_pages} pages, {len(self._free_queue)} free")
        pages = []
        for _ in range(num_pages):
            page, _ = self._free_queue.popitem(last=False)
            old = self._hash_of_page.pop(page, None)
            if old is not None:
                del self._page_of_hash[old]
                if self._events is not None:
                    self._events.removed(old, self._medium)
                if self._on_evict is not None:
                    self._on_evict(page, old)
            self._refcounts[page] = 1
            self._owner[page] = owner
            self._used_by[owner] += 1
            pages.append(page)
        return pages

    def share(self, pages: Iterable[int], owner: str = "") -> None:
        """Adds one reference to each page (a cache hit, or a fork); a free page leaves the free queue and
        counts against ``owner`` from now on."""
        for p in pages:
            if self._refcounts[p] == 0:
                del self._free_queue[p]
                self._owner[p] = owner
                self._used_by[owner] += 1
            self._refcounts[p] += 1

    def free(self, pages: Iterable[int]) -> None:
        """Drops one reference from each page; pages that reach zero go to the back of the free queue.

        Callers pass a request's table tail-first, so its last pages are evicted before its first
        ones (which are the ones other requests share).
        """
        for p in pages:
            rc = self._refcounts[p]
            if rc <= 0:
                raise AssertionError(f"page {p} freed while free")
            self._refcounts[p] = rc - 1
            if rc == 1:
                self._free_queue[p] = None
                self._used_by[self._owner[p]] -= 1
                self._owner[p] = None

    # ---- prefix cache index --------------------------------------------------------------------
    def lookup(self, page_hash: bytes) -> int | None:
        return self._page_of_hash.get(page_hash)

    def hash_of(self, page: int) -> bytes | None:
        return self._hash_of_page.get(page)

    def publish(self, page: int, page_hash: bytes) -> bool:
        """Makes a used page findable by the hash of its (confirmed) contents. First publisher wins."""
        if page_hash in self._page_of_hash or page in self._hash_of_page:
            return False
        self._page_of_hash[page_hash] = page
        self._hash_of_page[page] = page_hash
        if self._events is not None:
            self._events.stored(page_hash, self._medium)
        return True

    def unpublish(self, pages: Iterable[int]) -> None:
        """These pages' contents are uncertain (a page operation that may not have run): not findable any more."""
        for p in pages:
            h = self._hash_of_page.pop(p, None)
            if h is not None:
                del self._page_of_hash[h]
                if self._events is not None:
                    self._events.removed(h, self._medium)

    def zeroed(self, pages: Iterable[int]) -> None:
        """Free pages whose contents are being zeroed (a KV retention ended): not findable any more, and first out
        of the free queue (they hold nothing worth keeping)."""
        pages = list(pages)
        self.unpublish(pages)
        for p in reversed(pages):
            assert self._refcounts[p] == 0, f"page {p} zeroed while held"
            self._free_queue.move_to_end(p, last=False)

    def forget_hashes(self) -> None:
        """Nothing is findable any more (the executor that held the contents is gone)."""
        if self._events is not None:
            self._events.forgot(list(self._page_of_hash), self._medium)
        self._hash_of_page.clear()
        self._page_of_hash.clear()

    def refcount(self, page: int) -> int:
        return self._refcounts[page]

    def check_integrity(self, tables: Iterable[list[int]]) -> None:
        """free + used == all pages; refcounts equal the number of tables holding each page; the
        hash maps are each other's inverse."""
        expected = [0] * self._num_pages
        for table in tables:
            for p in table:
                expected[p] += 1
        for p in range(self._num_pages):
            assert self._refcounts[p] == expected[p], (
                f"page {p}: refcount {self._refcounts[p]} but {expected[p]} tables hold it")
            assert (p in self._free_queue) == (expected[p] == 0), (
                f"page {p}: in free queue={p in self._free_queue} but refcount {expected[p]}")
        owners = Counter(o for p, o in enumerate(self._owner) if self._refcounts[p])
        assert +self._used_by == owners, f"pages per tenant {dict(+self._used_by)} but {dict(owners)} held"
        assert len(self._page_of_hash) == len(self._hash_of_page), "hash maps differ in size"
        for h, p in self._page_of_hash.items():
            assert self._hash_of_page.get(p) == h, f"page {p}: hash maps disagree"
