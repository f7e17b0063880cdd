"""The host tier's side of request KV: which host pages a swap-out or a spill takes, which device pages a swap-in or
a host prefix-cache hit needs, and what each costs.

The host tier is a second PagePool of the device pool's page size. It holds the pages of swapped-out requests
(``req.host_table``) and, in its free LRU, prefix-cache pages spilled there when the device evicted them. Both are
found by the same hashes as the device's pages. ``HostTier`` decides the pages of both pools that a move between
the tiers takes and records each copy (``PageOps.swap_out``, ``swap_in``) in the ops it is given (KVManager's, for
the next plan); KVManager installs the tables it returns on the request. Host pages read by a swap-in stay held
until the plan that reads them is confirmed (``ops.host_release``), so no swap-out of the same plan can reuse them.
"""

from __future__ import annotations

from pagedkv.wire import DROPPED_PAGE
from scheduler_svc.pages import PagePool, held
from scheduler_svc.request import Request
from scheduler_svc.snapshot import Counters
from scheduler_svc.step import PageOps


class HostTier:
    def __init__(self, device: PagePool, host: PagePool, counters: Counters) -> None:
        self._device = device
        self._host = host
        self._counters = counters  # (the owner's: pages swapped in and out, spills, spill hits)

    # ---- the prefix cache ----------------------------------------------------------------------
    def spill(self, page: int, page_hash: bytes, ops: PageOps) -> None:
        """The device is about to reuse a cached page: keep its contents in the host tier (LRU) if there
        is a free host page and the tier does not hold them already."""
        if self._host.lookup(page_hash) is not None or not self._host.num_free:
            return
        (hp,) = self._host.allocate(1)
        self._host.publish(hp, page_hash)
        self._host.free([hp])  # free but findable, most recently used
        ops.swap_out.append((page, hp))
        self._counters.pages_swapped_out += 1
        self._counters.spilled_pages += 1

    def hold_hits(self, host_hits: list[int], ops: PageOps) -> None:
        """Prefix-cache hits on the host tier, held until the plan that copies them in ran (ops.host_release)."""
        self._host.share(host_hits)
        ops.host_release.extend(host_hits)
        self._counters.spill_hits += len(host_hits)

    def bring_back(self, host_page: int, page_hash: bytes | None, owner: str, ops: PageOps) -> int:
        """A device page that will hold a host page's contents after this plan's swap-ins. The caller holds
        host_page until the plan ran (ops.host_release)."""
        (page,) = self._device.allocate(1, owner)
        ops.swap_in.append((host_page, page))
        self._counters.pages_swapped_in += 1
        if page_hash is not None:
            self._device.publish(page, page_hash)  # the copy-in runs before anything that could read it
        return page

    # ---- swapping out --------------------------------------------------------------------------
    def _swap_out_plan(self, req: Request) -> tuple[int, int]:
        """(pages to copy, free host pages taken) for swapping req out; its filled pages go to the host,
        except those whose contents the host tier already caches (shared there)."""
        copies = taken = 0
        for p in held(req.page_table[: self._device.pages_for(req.num_computed)]):
            h = self._device.hash_of(p)
            hp = self._host.lookup(h) if h is not None else None
            if hp is None:
                copies += 1
                taken += 1
            elif self._host.refcount(hp) == 0:
                taken += 1
        return copies, taken

    def swap_out_cost(self, req: Request) -> int | None:
        """Pages that swapping req out would copy, or None when the host tier cannot take it."""
        if req.num_computed == 0:
            return None
        copies, taken = self._swap_out_plan(req)
        return copies if taken <= self._host.num_free else None

    def swap_out(self, req: Request, ops: PageOps) -> list[int]:
        """The host table for req's filled pages: contents the host already caches are shared, the rest copied
        out (ops.swap_out). The device pages are still req's (the caller releases them)."""
        host_table = []
        for p in req.page_table[: self._device.pages_for(req.num_computed)]:
            if p == DROPPED_PAGE:
                host_table.append(DROPPED_PAGE)
                continue
            h = self._device.hash_of(p)
            hp = self._host.lookup(h) if h is not None else None
            if hp is not None:
                self._host.share([hp])
            else:
                (hp,) = self._host.allocate(1)
                ops.swap_out.append((p, hp))
                self._counters.pages_swapped_out += 1
                if h is not None:
                    self._host.publish(hp, h)
            host_table.append(hp)
        return host_table

    # ---- swapping in ---------------------------------------------------------------------------
    def pages_to_swap_in(self, req: Request, num_tokens: int) -> int:
        """Free device pages that swapping req in and growing it by num_tokens would take."""
        taken = 0
        for hp in held(req.host_table):
            h = self._host.hash_of(hp)
            page = self._device.lookup(h) if h is not None else None
            if page is None or self._device.refcount(page) == 0:
                taken += 1
        return taken + max(0, self._device.pages_for(req.num_computed + num_tokens) - len(req.host_table))

    def swap_in(self, req: Request, ops: PageOps) -> list[int]:
        """The device table for req's host table: contents still cached on the device are shared, the rest
        copied in (ops.swap_in). Its host pages are let go (the caller empties the host table)."""
        found = []
        for hp in req.host_table:
            h = self._host.hash_of(hp) if hp != DROPPED_PAGE else None
            page = self._device.lookup(h) if h is not None else None
            found.append((DROPPED_PAGE if hp == DROPPED_PAGE else page, h))
        self._device.share((page for page, _ in found if page not in (None, DROPPED_PAGE)), req.tenant)
        table = [page if page is not None else self.bring_back(hp, h, req.tenant, ops)
                 for hp, (page, h) in zip(req.host_table, found)]
        # Pages copied in are read by this plan: their references drop once it ran; the others now.
        ops.host_release.extend(hp for hp, (page, _) in zip(req.host_table, found) if page is None)
        self._host.free(hp for hp, (page, _) in zip(req.host_table, found) if page not in (None, DROPPED_PAGE))
        return table
