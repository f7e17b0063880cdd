"""LoRA device slots on the planner's side (#52, scheduler_svc/adapter_slots.py): the least recently used idle adapter
makes room; a request runs only with its adapter in a slot, and no load ever takes a slot from under a request that
still runs with it (checked on every plan, as the executor checks it); requests of more adapters than slots all
finish, taking turns; and a tenant's own adapters and KV together never hold more pages than its quota, while
another tenant's pages are untouched by them."""

from __future__ import annotations

from pathlib import Path

import pytest
import tomllib

from pagedkv.executor.v1 import executor_pb2 as pb
from pagedkv.tenancy import Tenants
from scheduler_svc.adapter_slots import AdapterSlots
from scheduler_svc.prefix_cache import request_root
from tests.support.fake_executor import FakeExecutor, drive, make_request, scheduled
from tests.support.scheduler_helpers import BS, assert_empty, new_scheduler

pytestmark = pytest.mark.unit


class SlotChecker(FakeExecutor):
    """A FakeExecutor that keeps the executor's slots and refuses what plan_check.py refuses: a load into a slot a
    request not forgotten runs with, and a request whose adapter is in no slot."""

    def __init__(self, slots: int) -> None:
        super().__init__(BS)
        self.names: list[str | None] = [None] * slots
        self.live: dict[str, str] = {}  # request id -> adapter
        self.loads: list[tuple[str, int]] = []
        self.together: list[set[str]] = []  # the adapters of each plan's requests

    def step(self, plan: pb.StepPlan) -> pb.StepResult:
        for rid in plan.forget:
            self.live.pop(rid, None)
        for load in plan.adapter_loads:
            old = self.names[load.slot]
            assert old == load.name or old not in self.live.values(), (load, self.live)
            self.names[load.slot] = load.name
            self.loads.append((load.name, load.slot))
        for new in plan.new_requests:
            self.live[new.request_id] = new.adapter
        here = {self.live[rid] for rid, _ in scheduled(plan)} - {""}
        assert here <= set(self.names), (here, self.names)
        self.together.append(here)
        return super().step(plan)


def test_lru_picks_the_least_recently_used_idle_slot():
    slots = AdapterSlots(2, 5, owner_of=lambda name: "")
    assert slots.place("a", set()) == 0
    slots.page_in("a", 0, now=1)
    slots.page_in("b", slots.place("b", set()), now=2)
    slots.touch("a", 3)
    assert slots.place("c", set()) == 1  # b was used last at 2, a at 3
    assert slots.place("c", {"b"}) == 0 and slots.place("c", {"a", "b"}) is None
    assert slots.step_loads([], 4) == [("a", 0), ("b", 1)] and slots.step_loads([], 5) == []
    assert slots.page_ins_of("a") == 1 and slots.charge("a") == 0 and slots.charge("c") == 0


def test_requests_of_three_adapters_take_turns_in_two_slots():
    s = new_scheduler(pages=64, seqs=8, budget=64)
    s.scheduler.use_adapters(AdapterSlots(2, 3, owner_of=lambda name: ""))
    reqs = [make_request(i, 6, 5, adapter=a, hash_root=request_root("default", a))
            for i, a in enumerate(["x", "y", "z", "", "x", "z", "y", "x"])]
    for r in reqs:
        s.add(r)
    ex = SlotChecker(2)
    finished = drive(s, executor=ex)
    assert sorted(r.request_id for r in finished) == sorted(r.request_id for r in reqs)
    assert all(len(t) <= 2 for t in ex.together)  # never more adapters at once than slots
    assert {n for n, _ in ex.loads} == {"x", "y", "z"} and len(ex.loads) >= 3
    assert_empty(s)


TENANTS = """
[tenants.t]
keys = ["{k1}"]
page_quota = 12
max_adapters = 1

[tenants.u]
keys = ["{k2}"]
"""


def test_a_tenants_adapter_and_kv_together_stay_within_its_quota():
    """t's own adapter takes 5 pages of its 12-page quota while in a slot. Three base-model requests of t (4 pages
    each at their end) hold up to 12 pages: its adapter requests wait for room (paging the adapter in would pass the
    quota), run, and leave the adapter resident and idle; three more base requests of t then evict it to get the
    whole quota again. u's requests run beside them all, untouched."""
    from pagedkv.tenancy import hash_key

    tenants = Tenants.parse(tomllib.loads(TENANTS.format(k1=hash_key("k1"), k2=hash_key("k2"))), Path("t.toml"), 64)
    s = new_scheduler(pages=64, seqs=8, budget=64, tenants=tenants)
    slots = AdapterSlots(2, 5, owner_of=lambda name: "t" if name == "mine" else "")
    s.scheduler.use_adapters(slots)
    ledger, pool = s.scheduler.ledger, s.pool
    base = [make_request(i, 8, 8, tenant="t", hash_root=request_root("t")) for i in range(3)]
    mine = [make_request(3 + i, 8, 8, tenant="t", adapter="mine", hash_root=request_root("t", "mine"))
            for i in range(2)]
    others = [make_request(10 + i, 8, 8, tenant="u", hash_root=request_root("u")) for i in range(4)]
    for r in base + mine + others:
        s.add(r)
    seen = {"t": 0, "u": 0, "t kv beside the adapter": 0}

    def watch(_s):
        for tenant in ("t", "u"):
            seen[tenant] = max(seen[tenant], ledger.used_pages(tenant))
        assert ledger.used_pages("t") <= 12, (pool.used_by["t"], slots.names)
        if slots.resident("mine"):
            seen["t kv beside the adapter"] = max(seen["t kv beside the adapter"], pool.used_by["t"])
    ex = SlotChecker(2)
    assert len(drive(s, executor=ex, on_step=watch)) == len(base + mine + others)
    print("peaks:", seen)
    assert seen["t"] == 12 and seen["u"] >= 8 and seen["t kv beside the adapter"] <= 7
    assert slots.resident("mine") and ledger.used_pages("t") == 5 and ledger.used_pages("u") == 0
    assert s.scheduler.snapshot(tenants=True).tenants["t"].used_pages == 5  # (ModelInfo's tenant.used_pages)
    again = [make_request(20 + i, 8, 8, tenant="t", hash_root=request_root("t")) for i in range(3)]
    for r in again:
        s.add(r)
    peak = 0

    def kv(_s):
        nonlocal peak
        peak = max(peak, pool.used_by["t"])
        assert ledger.used_pages("t") <= 12
    assert len(drive(s, executor=ex, on_step=kv)) == 3
    print("t KV peak after:", peak)
    assert peak > 7 and not slots.resident("mine")  # more than 12 - 5: the idle adapter made room for t's KV
