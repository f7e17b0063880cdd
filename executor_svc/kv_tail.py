"""A request's most recent pages held exactly beside an 8-bit pool: the exact tail (#50 item 1).

E4M3 keys carry 3 mantissa bits, and on SmolLM2 that alone keeps FP8 KV at ~96% top-1 agreement with float32 KV
whatever the scale layout. Most of what a decode loses is in the tokens just before it: with each request's last
two pages read in full precision (the open page and the sealed one before it: KIVI's full-precision residual),
FP8 KV reaches +0.10% perplexity and 98.6% top-1 (bench/NOTES.md, session 30; bench/kv_quant_tail.py).

Every token is still written to its 8-bit page (the page stays complete: swap, spill, migration and prefix caching
move it unchanged). Besides, a page written from its first slot is given a slot of the **slab**: bfloat16 K and V
of one page for every layer, ``slab[slots, layers, 2, block, kv_heads, head_dim]``, and its rows are written there
too. Attention reads a page that has a slot from the slab instead of its bytes (the CPU kernels' ``exact_slots``
arguments, executor_svc/attention/paged_attention_q8_cpu.cpp; the gather path's dequantizers). A page keeps its
slot while it is among the last ``pages`` pages of a request the executor holds, or is read by a prefill chunk of
the step (its own pages, and the ``pages - 1`` before its first where they were its request's tail: not a page it
found in the prefix cache, whose slot is left from a request that ended), and gives it back at the next step
otherwise. So
a decode reads its request's last ``pages`` pages exactly and the rest in 8 bits, and every token of a prefill
chunk reads at least its own page and the ``pages - 1`` before it exactly, as a decode at its position would:
the prompt's K/V are computed at the same precision as the outputs' (SmolLM2, 128-token chunks: top-1 96.6% if
the chunks read only the final tail exactly, 98.7% so). A page that was cached by another request is read in 8
bits: the scheduler takes no prefix-cache hit on a prompt's last ``pages`` pages (scheduler_svc/kv_manager.py), so
that the decodes read pages the request wrote itself.

The slab is fixed at start-up (``--kv-exact-tail-slots``; by default an eighth of the KV budget, taken out of
it). Where it is short, a page gets no slot and is read from its 8-bit bytes, as without the tail. A page's slot
follows it through the plan's page operations: a swap-out hands it to the host page (kept while the slab has room:
a swapped-out page's slot is the first to be taken back), a swap-in to the device page, a copy-on-write copies it;
a zeroed page or the target of a swap-in loses its own. A page whose K/V arrive otherwise (from another executor,
or a swap-out whose slot was taken back) is read in 8 bits until it leaves the tail.

Invariant (tests/unit/test_kv_tail.py): a page with a slot holds in the slab, for every slot of the page written
since the page's first slot was, the values last written there, rounded to bfloat16.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

MAX_PAGES = 4  # --kv-exact-tail-pages at most (4 pages: 98.9% top-1; more buys little: bench/NOTES.md)
DEFAULT_PAGES = {"fp8_e4m3": 2}  # the default where the format needs it (INT8 meets its target without)
SLAB_SHARE = 8  # by default the slab takes at most 1/SLAB_SHARE of the KV budget
DTYPE = torch.bfloat16


def slot_bytes(num_layers: int, block_size: int, kv_heads: int, head_dim: int) -> int:
    """Bytes of one slab slot: K and V of a page, every layer, in bfloat16."""
    return num_layers * 2 * block_size * kv_heads * head_dim * 2


class TailView:
    """One layer's K (or V) of the slab: ``data`` [slots, block, kv_heads, head_dim] bfloat16, and the tail it
    belongs to (its slots and the step's write index)."""

    __slots__ = ("data", "tail")

    def __init__(self, data: torch.Tensor, tail: ExactTail) -> None:
        self.data = data
        self.tail = tail

    @property
    def slots(self) -> torch.Tensor:
        """int32 [num_pages]: each page's slot, -1 for none (the kernels' ``exact_slots``)."""
        return self.tail.slot_of_page

    def write(self, x: torch.Tensor) -> None:
        """The step's new K (or V) rows [T, kv_heads, head_dim]: those whose pages have a slot go to the slab."""
        index = self.tail.write_index
        if index is not None:
            rows, slots, offsets = index
            self.data[slots, offsets] = x[rows].to(DTYPE)

    def overlay(self, out: torch.Tensor, page_ids: torch.Tensor) -> torch.Tensor:
        """Dequantized pages ``out`` [n, block, kv_heads, head_dim] of ``page_ids`` with the slab's rows for the
        pages that have a slot (the gather path where the kernel library's dequantizers are not built)."""
        slots = self.tail.slot_of_page[page_ids].long()
        exact = slots >= 0
        if bool(exact.any()):
            out[exact] = self.data[slots[exact]].to(out.dtype)
        return out


class ExactTail:
    """The slab and which page holds which slot. ``pages``: the tail's length in pages (a request's last pages read
    exactly); ``slots``: the slab's size in pages."""

    def __init__(self, num_pages: int, num_layers: int, block_size: int, kv_heads: int, head_dim: int,
                 pages: int, slots: int, device: torch.device) -> None:
        if not 1 <= pages <= MAX_PAGES:
            raise ValueError(f"--kv-exact-tail-pages must be in [0, {MAX_PAGES}], got {pages}")
        if slots < 1:
            raise ValueError(f"--kv-exact-tail-slots must be >= 1, got {slots}")
        self.pages = pages
        self.num_slots = slots
        self.block_size = block_size
        self.slab = torch.zeros((slots, num_layers, 2, block_size, kv_heads, head_dim), dtype=DTYPE, device=device)
        self.k_views = [TailView(self.slab[:, layer, 0], self) for layer in range(num_layers)]
        self.v_views = [TailView(self.slab[:, layer, 1], self) for layer in range(num_layers)]
        self.slot_of_page = torch.full((num_pages,), -1, dtype=torch.int32, device=device)
        self.write_index: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._device: dict[int, int] = {}  # device page -> slot
        self._host: dict[int, int] = {}  # host page -> slot (a swapped-out page's copy), oldest first
        self._free = list(range(slots - 1, -1, -1))
        self._changed: dict[int, int] = {}  # device page -> its new slot (-1: none), not yet in slot_of_page
        self._short = 0  # tail pages that found no free slot, since take_short()
        self._kept: set[int] = set()  # the last step's tails

    @property
    def slab_bytes(self) -> int:
        return self.slab.numel() * self.slab.element_size()

    def used(self) -> tuple[int, int, int]:
        """(slots held by device pages, by host pages, free)."""
        return len(self._device), len(self._host), len(self._free)

    def take_short(self) -> int:
        """Tail pages that found no free slot (read in 8 bits) since the last call."""
        short, self._short = self._short, 0
        return short

    def slot(self, page: int) -> int:
        """The device page's slot, -1 for none."""
        return self._device.get(page, -1)

    # ---- slots --------------------------------------------------------------------------------------
    def _take(self) -> int | None:
        if not self._free and self._host:  # a swapped-out page's copy is the first to go
            self._free.append(self._host.pop(next(iter(self._host))))
        return self._free.pop() if self._free else None

    def _give(self, page: int, slot: int) -> None:
        self._device[page] = slot
        self._changed[page] = slot

    def _release(self, page: int) -> None:
        slot = self._device.pop(page, None)
        if slot is not None:
            self._free.append(slot)
            self._changed[page] = -1

    def _release_host(self, page: int) -> None:
        slot = self._host.pop(page, None)
        if slot is not None:
            self._free.append(slot)

    def _commit(self) -> None:
        if self._changed:
            pages = torch.tensor(list(self._changed), dtype=torch.long)
            slots = torch.tensor(list(self._changed.values()), dtype=torch.int32)
            self.slot_of_page[pages.to(self.slot_of_page.device)] = slots.to(self.slot_of_page.device)
            self._changed.clear()

    # ---- the plan's page operations, in the runner's order ------------------------------------------
    def page_ops(self, swap_out: Iterable[tuple[int, int]], zero: Iterable[int], swap_in: Iterable[tuple[int, int]],
                 copy: Iterable[tuple[int, int]]) -> None:
        """Swap-outs (device -> host: the slot goes with the page), zeroed pages, swap-ins (host -> device), then
        copy-on-write copies (src -> dst: the slot's rows are copied to a slot of its own), as the pool moves them."""
        for dev, host in swap_out:
            self._release_host(host)
            slot = self._device.pop(dev, None)
            if slot is not None:
                self._changed[dev] = -1
                self._host[host] = slot
        for page in zero:
            self._release(page)
        for host, dev in swap_in:
            self._release(dev)
            slot = self._host.pop(host, None)
            if slot is not None:
                self._give(dev, slot)
        copies = [(src, dst, self._device.get(src)) for src, dst in copy]  # (all reads, then all writes)
        rows = [(self.slab[s].clone(), dst) for _, dst, s in copies if s is not None]
        for _, dst, _ in copies:
            self._release(dst)
        for data, dst in rows:
            slot = self._take()
            if slot is None:
                break
            self.slab[slot] = data
            self._give(dst, slot)
        self._commit()

    def wipe(self) -> None:
        """Every slot free (a new Run-stream session; the pool is wiped too)."""
        self._device.clear()
        self._host.clear()
        self._changed.clear()
        self._kept = set()
        self._free = list(range(self.num_slots - 1, -1, -1))
        self.slot_of_page.fill_(-1)
        self.write_index = None

    # ---- a step -------------------------------------------------------------------------------------
    def prepare(self, held: Iterable[tuple[list[int], int]], written: Iterable[tuple[list[int], int, int]],
                slot_pages: torch.Tensor, slot_offsets: torch.Tensor) -> None:
        """Before a step's forward. ``held``: (page table, context length after the step) of every request the
        executor holds; ``written``: (page table, first position, count) of the step's rows; ``slot_pages``,
        ``slot_offsets``: where each of the step's tokens goes (AttentionMetadata's), for the write index."""
        bs, keep = self.block_size, set()
        for table, ctx in held:
            last = min((ctx - 1) // bs, len(table) - 1)
            keep.update(p for p in table[max(0, last - self.pages + 1):last + 1] if p >= 0)
        hold, fresh = set(keep), []
        for table, start, count in written:  # a chunk's pages, and the request's tail before its first
            first, last = start // bs, (start + count - 1) // bs
            hold.update(table[first:last + 1])
            hold.update(p for p in table[max(0, first - self.pages + 1):first] if p in self._kept)
            fresh.extend(table[i] for i in range(-(-start // bs), last + 1))  # (written from their first slot)
        self._kept = keep  # (a page cached by a request that ended is not its reader's tail: never kept for it)
        for page in [p for p in self._device if p not in hold]:
            self._release(page)
        fresh.sort(key=lambda p: p not in keep)  # the tails' pages first, then the chunks' others
        for page in fresh:
            if page not in self._device:
                slot = self._take()
                if slot is None:
                    self._short += 1
                    continue
                self._give(page, slot)
        self._commit()
        if not self._device:
            self.write_index = None
            return
        slots = self.slot_of_page[slot_pages.to(self.slot_of_page.device)]
        rows = torch.nonzero(slots >= 0).squeeze(1)
        self.write_index = ((rows, slots[rows].long(), slot_offsets.to(rows.device)[rows]) if rows.numel()
                            else None)


def tail_pages(requested: int | None, kv_name: str, backend: str, slots: int | None = None) -> int:
    """``--kv-exact-tail-pages``: None takes the format's default where the backend reads a slab (torch), else 0;
    a number is checked, and refused for a format or backend that has no exact tail. ``slots``
    (``--kv-exact-tail-slots``) given where there is no tail is refused too, not ignored."""
    pages = _tail_pages(requested, kv_name, backend)
    if not pages and slots is not None:
        raise ValueError(f"--kv-exact-tail-slots {slots}: there is no exact tail here (--kv-exact-tail-pages 0: "
                         f"KV dtype {kv_name}, {backend} attention backend); leave the flag out")
    return pages


def _tail_pages(requested: int | None, kv_name: str, backend: str) -> int:
    if requested is None:
        return DEFAULT_PAGES.get(kv_name, 0) if backend == "torch" else 0
    if not 0 <= requested <= MAX_PAGES:
        raise ValueError(f"--kv-exact-tail-pages must be in [0, {MAX_PAGES}], got {requested}")
    if requested and kv_name not in ("fp8_e4m3", "int8"):
        raise ValueError(f"--kv-exact-tail-pages {requested}: an exact tail is for 8-bit KV pages "
                         f"(--kv-cache-dtype fp8_e4m3 or int8), not {kv_name}")
    if requested and backend != "torch":
        raise ValueError(f"--kv-exact-tail-pages {requested}: the {backend} attention backend does not read an "
                         "exact tail yet; use --attention-backend torch, or --kv-exact-tail-pages 0")
    return requested


def slab_slots(requested: int | None, pages: int, kv_bytes: int, one_slot: int, block_size: int = 16,
               max_seqs: int = 256, chunk_tokens: int = 2048) -> int:
    """``--kv-exact-tail-slots``, or by default enough for ``max_seqs`` requests' tails and a step's prefill chunks
    of ``chunk_tokens`` (the scheduler's default --max-num-seqs and --max-num-batched-tokens), capped at
    1/SLAB_SHARE of the KV bytes and at least 4 requests' tails."""
    if requested is not None:
        if requested < 1:
            raise ValueError(f"--kv-exact-tail-slots must be >= 1, got {requested}")
        return requested
    want = max_seqs * pages + chunk_tokens // block_size
    return max(4 * pages, min(want, kv_bytes // SLAB_SHARE // one_slot))
