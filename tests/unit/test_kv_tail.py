"""The exact tail's bookkeeping (executor_svc/kv_tail.py): which pages hold a slab slot after each step and page
operation, and its invariant under random plans: a page with a slot holds in the slab exactly what was last written
to each of its slots since its first one was (rounded to bfloat16), so a page is never read from a stale copy."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from executor_svc.kv_tail import MAX_PAGES, ExactTail, slab_slots, tail_pages

pytestmark = pytest.mark.unit
BS = 4


def make(num_pages=32, pages=2, slots=16) -> ExactTail:
    return ExactTail(num_pages, 2, BS, 1, 2, pages, slots, torch.device("cpu"))


def step(tail: ExactTail, rows: list[tuple[list[int], int, int]], held: list[tuple[list[int], int]] = (),
         value: float = 1.0) -> torch.Tensor:
    """One step: ``rows`` (table, start, count) write ``count`` tokens each; ``held``: other requests held, with
    their lengths. Writes token values (value, position) to every layer's K and V through the slab's views."""
    pages = [t[p // BS] for t, s, c in rows for p in range(s, s + c)]
    offsets = [p % BS for t, s, c in rows for p in range(s, s + c)]
    tail.prepare([(t, s + c) for t, s, c in rows] + list(held), rows, torch.tensor(pages, dtype=torch.long),
                 torch.tensor(offsets, dtype=torch.long))
    x = torch.tensor([[value, p] for t, s, c in rows for p in range(s, s + c)], dtype=torch.float32).view(-1, 1, 2)
    for view in tail.k_views + tail.v_views:
        view.write(x)
    return x


def slotted(tail: ExactTail) -> set[int]:
    got = {p for p in range(tail.slot_of_page.numel()) if tail.slot(p) >= 0}
    assert got == set(torch.nonzero(tail.slot_of_page >= 0).flatten().tolist())  # (the kernels' view agrees)
    return got


def test_a_decoding_request_holds_slots_for_its_last_pages_only():
    tail = make()
    table = [5, 9, 2, 7, 11]
    step(tail, [(table, 0, 6)])  # a prefill over pages 5, 9 (both written from slot 0)
    assert slotted(tail) == {5, 9}
    for pos in range(6, 20):
        step(tail, [(table, pos, 1)])
        last = pos // BS
        assert slotted(tail) == set(table[max(0, last - 1):last + 1]), pos


def test_a_prefill_chunk_reads_its_own_pages_exactly_and_keeps_the_last_two():
    tail = make()
    table = list(range(1, 11))
    step(tail, [(table, 0, 37)])  # 10 pages written in one step: every one has a slot during it
    assert slotted(tail) == set(table)
    step(tail, [(table, 37, 3)])  # the next chunk reads the page before it exactly too
    assert slotted(tail) == {9, 10}
    table += [11, 12, 13]
    step(tail, [(table, 40, 9)])
    assert slotted(tail) == {10, 11, 12, 13}
    step(tail, [(table, 49, 1)])
    assert slotted(tail) == {12, 13}


def test_a_page_found_in_the_prefix_cache_is_read_in_8_bits():
    """A page another request wrote (and left with a slot, as a prefill chunk's page) is not its reader's tail: the
    reader sees it as it would after any other request, in 8 bits."""
    tail = make()
    step(tail, [([1, 2, 3], 0, 10)])  # a request that ends after its prefill: page 1 had a slot for the step
    step(tail, [([1, 7, 8], 4, 6)])  # another prompt with the same first page, from the cache
    assert slotted(tail) == {7, 8}
    chunked = [4, 5, 6, 9, 10, 11]
    step(tail, [(chunked, 0, 8)])  # a prompt in two chunks: the second reads the first's tail exactly
    step(tail, [(chunked, 8, 12)])
    assert slotted(tail) == {5, 6, 9, 10}
    step(tail, [(chunked, 20, 1)])
    assert slotted(tail) == {10, 11}


def test_pages_written_mid_page_without_a_slot_stay_8_bit():
    tail = make(pages=1)
    table = [3, 4]
    step(tail, [([3], 0, 2)], value=1.0)
    tail.wipe()  # (as if the slot were lost) the page goes on from slot 2: no exact copy of slots 0, 1
    step(tail, [(table, 2, 1)])
    assert slotted(tail) == set()
    step(tail, [(table, 3, 2)])  # page 4 starts in this step: it gets one
    assert slotted(tail) == {4}


def test_a_request_no_longer_held_gives_its_slots_back():
    tail = make()
    a, b = [1, 2, 3], [4, 5]
    step(tail, [(a, 0, 9), (b, 0, 5)])
    assert slotted(tail) == {1, 2, 3, 4, 5}
    step(tail, [(a, 9, 1)], held=[(b, 5)])  # b waits this step: its pages stay
    assert slotted(tail) == {2, 3, 4, 5}
    step(tail, [(a, 10, 1)])  # b was forgotten
    assert slotted(tail) == {2, 3}


def test_a_short_slab_serves_the_tails_first_and_reads_the_rest_in_8_bits():
    tail = make(slots=3)
    table = list(range(1, 9))
    step(tail, [(table, 0, 30)])
    assert slotted(tail) == {7, 8, 1}  # the tail's two pages first, then the chunk's first page
    assert tail.take_short() == 5 and tail.take_short() == 0
    step(tail, [(table, 30, 1)])
    assert slotted(tail) == {7, 8}


def test_slots_follow_swaps_and_copies_and_leave_zeroed_pages():
    tail = make(slots=4)
    table = [1, 2]
    step(tail, [(table, 0, 6)], value=3.0)
    k = tail.k_views[0].data
    rows_1 = k[tail.slot(1)].clone()
    tail.page_ops(swap_out=[(1, 40), (2, 41)], zero=[], swap_in=[], copy=[])
    assert slotted(tail) == set() and tail.used()[:2] == (0, 2)
    tail.page_ops(swap_out=[], zero=[], swap_in=[(40, 7), (41, 8)], copy=[])
    assert slotted(tail) == {7, 8} and tail.used()[:2] == (2, 0)
    assert torch.equal(k[tail.slot(7)], rows_1)
    tail.page_ops(swap_out=[], zero=[], swap_in=[], copy=[(7, 12)])  # copy-on-write: a slot of its own
    assert tail.slot(12) not in (-1, tail.slot(7)) and torch.equal(k[tail.slot(12)], rows_1)
    tail.page_ops(swap_out=[], zero=[12], swap_in=[], copy=[])
    assert tail.slot(12) == -1
    tail.page_ops(swap_out=[], zero=[], swap_in=[(99, 8)], copy=[])  # a page swapped in over another's
    assert tail.slot(8) == -1  # (host page 99 had no copy: page 8 is read in 8 bits)


def test_a_swapped_out_copy_is_the_first_slot_taken_back():
    tail = make(slots=2)
    step(tail, [([1, 2], 0, 8)])
    tail.page_ops(swap_out=[(1, 50), (2, 51)], zero=[], swap_in=[], copy=[])
    step(tail, [([3], 0, 2)])
    assert slotted(tail) == {3} and tail.used()[:2] == (1, 1)
    tail.page_ops(swap_out=[], zero=[], swap_in=[(50, 1), (51, 2)], copy=[])
    assert tail.slot(2) >= 0 and tail.slot(1) == -1  # page 1's copy gave its slot to page 3


def test_flags_are_checked():
    assert tail_pages(None, "fp8_e4m3", "torch") == 2
    assert tail_pages(None, "int8", "torch") == 0 and tail_pages(None, "fp8_e4m3", "cuda") == 0
    assert tail_pages(3, "int8", "torch") == 3
    with pytest.raises(ValueError, match="--kv-exact-tail-pages must be in"):
        tail_pages(MAX_PAGES + 1, "fp8_e4m3", "torch")
    with pytest.raises(ValueError, match="8-bit KV pages"):
        tail_pages(2, "float32", "torch")
    with pytest.raises(ValueError, match="cuda attention backend"):
        tail_pages(2, "fp8_e4m3", "cuda")
    for kv, backend, pages in (("int8", "torch", None), ("fp8_e4m3", "cuda", None), ("fp8_e4m3", "torch", 0)):
        with pytest.raises(ValueError, match="--kv-exact-tail-slots 64: there is no exact tail here"):
            tail_pages(pages, kv, backend, slots=64)  # (a setting that would change nothing is refused)
    assert tail_pages(None, "fp8_e4m3", "torch", slots=64) == 2
    with pytest.raises(ValueError, match="--kv-exact-tail-slots must be >= 1"):
        slab_slots(0, 2, 1 << 30, 1000)
    assert slab_slots(None, 2, 1 << 30, 1 << 20) == 128  # an eighth of 1 GiB in 1 MiB slots
    assert slab_slots(None, 2, 1 << 40, 1 << 20) == 512 + 128  # 256 requests' tails and a 2,048-token chunk at most
    assert slab_slots(None, 2, 1 << 20, 1 << 20) == 8  # at least 4 requests' tails


NUM = 20  # device pages of the random plans
ops = st.lists(st.one_of(
    st.tuples(st.just("grow"), st.integers(0, 2), st.integers(1, 9)),
    st.tuples(st.just("swap"), st.integers(0, 2)),
    st.tuples(st.just("fork"), st.integers(0, 2)),
    st.tuples(st.just("drop"), st.integers(0, 2)),
    st.tuples(st.just("zero"), st.integers(0, 19)),
), min_size=15, max_size=60)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops, st.integers(1, 3), st.integers(2, 12), st.randoms(use_true_random=False))
def test_a_slotted_page_always_holds_the_last_values_written_to_it(plan, pages, slots, rng):
    """Random plans over three requests (grow by a chunk, swap out and back in at other pages, fork by
    copy-on-write of the last page, drop, zero a free page): every slotted page's slab rows equal a shadow of what
    was written to the page, and no slot is lost or held twice."""
    tail = make(num_pages=NUM, pages=pages, slots=slots)  # (few pages: freed ones with slots are soon reused)
    free = list(range(NUM - 1, -1, -1))
    reqs: dict[int, tuple[list[int], int]] = {}
    shadow: dict[tuple[int, int], float] = {}  # (page, offset) -> the value last written there
    counter = [0.0]
    forks = [10]  # ids of forked requests (they are held, never grown)

    def check():
        for page in range(NUM):
            slot = tail.slot(page)
            if slot < 0:
                continue
            for off in range(BS):
                if (page, off) in shadow:  # (a slot is given at a page's first slot: every written row is exact)
                    assert float(tail.k_views[1].data[slot, off, 0, 0]) == pytest.approx(shadow[page, off], rel=1e-2)

    for op in plan:
        kind, r = op[0], op[1]
        if kind == "grow":
            table, n = reqs.get(r, ([], 0))
            count = op[2]
            if -(-(n + count) // BS) - len(table) > len(free):
                continue
            while len(table) * BS < n + count:
                table.append(free.pop())
            counter[0] += 1
            held = [(t, c) for k, (t, c) in reqs.items() if k != r]
            step(tail, [(table, n, count)], held, value=counter[0])
            for pos in range(n, n + count):
                page, off = table[pos // BS], pos % BS
                if off == 0:  # a page's first slot: what a former owner left there is not visible
                    for o in range(BS):
                        shadow.pop((page, o), None)
                shadow[page, off] = counter[0]
            reqs[r] = (table, n + count)
        elif kind == "swap" and r in reqs and not any(
                set(reqs[r][0]) & set(t) for k, (t, _) in reqs.items() if k != r):  # (shared pages stay)
            table, n = reqs[r]
            if len(table) > len(free):
                continue
            hosts = [1000 + p for p in table]
            tail.page_ops([(p, h) for p, h in zip(table, hosts)], [], [], [])
            free.extend(table)
            rng.shuffle(free)  # (any free page: one a dropped request left with a slot among them)
            new = [free.pop() for _ in table]
            tail.page_ops([], [], list(zip(hosts, new)), [])
            moved = {(p, off): shadow.pop((old, off)) for old, p in zip(table, new) for off in range(BS)
                     if (old, off) in shadow}  # (all out, then all in: a page may come back to another's id)
            for p in new:  # (a page moves whole: nothing of what the target held is left)
                for off in range(BS):
                    shadow.pop((p, off), None)
            shadow.update(moved)
            reqs[r] = (new, n)
        elif kind == "fork" and r in reqs and reqs[r][0] and free:
            table, n = reqs[r]
            rng.shuffle(free)
            dst = free.pop()
            tail.page_ops([], [], [], [(table[-1], dst)])
            for off in range(BS):
                shadow.pop((dst, off), None)
                if (table[-1], off) in shadow:
                    shadow[dst, off] = shadow[table[-1], off]
            forks[0] += 1
            reqs[forks[0]] = (table[:-1] + [dst], n)
        elif kind == "zero" and all(r not in t for t, _ in reqs.values()):  # (a free page's bytes zeroed)
            tail.page_ops([], [r], [], [])
            for off in range(BS):
                shadow[r, off] = 0.0
        elif kind == "drop" and r in reqs:
            table, _ = reqs.pop(r)
            free.extend(p for p in table if all(p not in t for t, _ in reqs.values()))
        check()
        device, host, unused = tail.used()
        assert device + host + unused == slots  # (no slot lost, none held twice)
    tail.prepare([], [], torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.long))
    assert tail.used()[0] == 0 and slotted(tail) == set()  # nothing held: every device slot back


def test_the_slabs_slots_are_exported_as_metrics():
    from prometheus_client import REGISTRY

    from executor_svc import metrics
    from pagedkv.executor.v1 import executor_pb2 as pb

    tail = make(slots=3)
    step(tail, [([1, 2, 3, 4], 0, 14)])  # 4 pages written, 3 slots: one short
    before = REGISTRY.get_sample_value("pagedkv_executor_kv_exact_tail_short_total") or 0.0
    metrics.observe_step(pb.StepPlan(), pb.StepResult(), 1, tail)
    assert REGISTRY.get_sample_value("pagedkv_executor_kv_exact_tail_slots", {"holder": "device"}) == 3
    assert REGISTRY.get_sample_value("pagedkv_executor_kv_exact_tail_slots", {"holder": "free"}) == 0
    assert REGISTRY.get_sample_value("pagedkv_executor_kv_exact_tail_short_total") == before + 1
