"""One executor's LoRA device slots, as its planner decides them (#52): which adapter each slot holds, which were
used last, and the loads the next plan carries (StepPlan.adapter_loads).

An executor holds every adapter in host memory and has ``count`` device slots of ``pages`` pages each (Describe's
lora_slots, lora_slot_pages): the pool's last pages, outside the KV pages. A request may run only with its adapter
in a slot. Admission (admission.py) asks ``place`` for a slot when it is not: a free one, else the least recently
used whose adapter no running request uses (LRU, as SGLang and vLLM evict adapters); none: the request waits, as
for pages. Paging in costs one copy of ``pages`` pages from pinned host memory, never a recompute, so unlike KV
there is nothing to weigh: a slot is taken whenever one can be.

Pages of a tenant's own adapter (loaded at run time: adapter_registry.py) count against its page quota while the
adapter is in a slot (``pages_of``, which TenantLimits adds to the tenant's KV pages); a public adapter's come from
the shared allowance, the slots themselves. So a tenant's adapters and KV never hold more than its quota together:
paging one in needs the room (``charge``), and an idle one of its own is evicted first when its KV needs the room
(``idle_owned``).
"""

from __future__ import annotations

from collections.abc import Callable

from pagedkv.executor.v1 import executor_pb2 as pb
from scheduler_svc import metrics


class AdapterSlots:
    def __init__(self, count: int, pages: int, owner_of: Callable[[str], str]) -> None:
        """``owner_of``: the tenant that owns an adapter ('' : public; the scheduler's registry)."""
        self.count, self.pages, self.owner_of = count, pages, owner_of
        self.names: list[str | None] = [None] * count
        self.last_used = [0] * count
        self.page_ins: dict[str, int] = {}  # per adapter, since these slots were made
        self._loads: list[tuple[str, int]] = []

    @classmethod
    def of(cls, describe: pb.DescribeResponse, owner_of: Callable[[str], str]) -> AdapterSlots | None:
        """The slots an executor's Describe gives, holding what it says they hold (None: it has none)."""
        if not describe.lora_slots:
            return None
        slots = cls(describe.lora_slots, describe.lora_slot_pages, owner_of)
        slots.reset(describe)
        return slots

    def reset(self, describe: pb.DescribeResponse) -> None:
        """What the executor's slots hold now (it was (re)connected: no request of it runs)."""
        self.names = [None] * self.count
        for a in describe.adapters:
            if 0 <= a.slot < self.count:
                self.names[a.slot] = a.name
        self._loads.clear()

    def slot_of(self, name: str) -> int | None:
        try:
            return self.names.index(name)
        except ValueError:
            return None

    def page_ins_of(self, name: str) -> int:
        return self.page_ins.get(name, 0)

    def resident(self, name: str) -> bool:
        return name in self.names

    def touch(self, name: str, now: int) -> None:
        slot = self.slot_of(name)
        if slot is not None:
            self.last_used[slot] = now

    def place(self, name: str, busy: set[str]) -> int | None:
        """The slot ``name`` would be paged into now: a free one, else the least recently used whose adapter is
        not in ``busy`` (those of running requests); None: every slot is in use."""
        free = [k for k, n in enumerate(self.names) if n is None]
        if free:
            return free[0]
        idle = [k for k, n in enumerate(self.names) if n not in busy]
        return min(idle, key=self.last_used.__getitem__) if idle else None

    def page_in(self, name: str, slot: int, now: int) -> None:
        """``name`` goes into ``slot`` with the next plan (the adapter there is evicted: it stays in host memory)."""
        self.names[slot] = name
        self.last_used[slot] = now
        self._loads.append((name, slot))
        self.page_ins[name] = self.page_ins.get(name, 0) + 1
        metrics.ADAPTER_PAGE_INS.inc()

    def evict(self, name: str) -> None:
        """``name`` leaves its slot (unloaded, or an idle adapter making room in its tenant's quota)."""
        slot = self.slot_of(name)
        if slot is not None:
            self.names[slot] = None

    def apply(self, decision, now: int) -> None:
        """Admission's PageIn or Evict (admission.py)."""
        if hasattr(decision, "slot"):
            self.page_in(decision.adapter, decision.slot, now)
        else:
            self.evict(decision.adapter)

    def step_loads(self, scheduled, now: int) -> list[tuple[str, int]]:
        """The adapters of a step's requests ((request, tokens, samples)) marked used now, and the loads the step
        carries."""
        for req, _, _ in scheduled:
            if req.adapter:
                self.touch(req.adapter, now)
        loads, self._loads = self._loads, []
        return loads

    def all_loads(self) -> list[tuple[str, int]]:
        """Every slot's adapter as a load (a resent plan: the executor's slots may be behind a rejected plan's)."""
        self._loads.clear()
        return [(n, k) for k, n in enumerate(self.names) if n is not None]

    def pages_of(self, tenant: str) -> int:
        """Pages the tenant's own adapters hold in the slots."""
        return sum(self.pages for n in self.names if n is not None and self.owner_of(n) == tenant)

    def charge(self, name: str) -> int:
        """Pages paging ``name`` in would add to its owner's count (0: public, or in a slot already)."""
        return 0 if self.resident(name) or not self.owner_of(name) else self.pages

    def idle_owned(self, tenant: str, busy: set[str]) -> str | None:
        """The least recently used of the tenant's own adapters in a slot that no running request uses."""
        mine = [k for k, n in enumerate(self.names) if n is not None and n not in busy and self.owner_of(n) == tenant]
        return self.names[min(mine, key=self.last_used.__getitem__)] if mine else None
