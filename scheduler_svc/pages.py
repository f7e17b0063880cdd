"""Page accounting: the one place that hands out and takes back device page ids.

Every page is either free (refcount 0, in the free queue) or used (refcount >= 1, referenced by
that many page tables). Policy code asks ``can_allocate``/``allocate`` and ``free``; it never
touches the free queue or the refcounts.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable


class OutOfPages(Exception):
    pass


class PagePool:
    def __init__(self, num_pages: int, block_size: int) -> None:
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        self.num_pages = num_pages
        self.block_size = block_size
        self.refcounts = [0] * num_pages
        self.free_queue: deque[int] = deque(range(num_pages))

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self.free_queue)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_pages: int) -> bool:
        return num_pages <= len(self.free_queue)

    def allocate(self, num_pages: int) -> list[int]:
        if num_pages > len(self.free_queue):
            raise OutOfPages(f"need {num_pages} pages, {len(self.free_queue)} free")
        pages = [self.free_queue.popleft() for _ in range(num_pages)]
        for p in pages:
            self.refcounts[p] = 1
        return pages

    def free(self, pages: Iterable[int]) -> None:
        """Drops one reference from each page; pages that reach zero go back to the free queue.

        Callers pass a request's table tail-first, so a request's last pages are reused before
        its first ones (the order the prefix cache will want).
        """
        for p in pages:
            rc = self.refcounts[p]
            if rc <= 0:
                raise AssertionError(f"page {p} freed while free")
            self.refcounts[p] = rc - 1
            if rc == 1:
                self.free_queue.append(p)

    def check_integrity(self, tables: Iterable[list[int]]) -> None:
        """free + used == all pages, and every refcount equals the number of tables holding the page."""
        expected = [0] * self.num_pages
        for table in tables:
            for p in table:
                expected[p] += 1
        free = set(self.free_queue)
        assert len(free) == len(self.free_queue), "a page is twice in the free queue"
        for p in range(self.num_pages):
            assert self.refcounts[p] == expected[p], (
                f"page {p}: refcount {self.refcounts[p]} but {expected[p]} tables hold it")
            assert (p in free) == (expected[p] == 0), f"page {p}: free={p in free} but refcount {expected[p]}"
