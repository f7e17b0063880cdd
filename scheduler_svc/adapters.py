"""The LoRA adapters a scheduler serves, and which of them a request may select (#52).

Every executor of a scheduler serves the same adapters: the same --lora-modules by name and rank, and device slots of
the same shape (``mismatch``: a join's check, cluster.py); the run-time ones the cluster loads on every executor,
and on one that joins later (cluster.py's ``sync_adapters``). A request selects one by ``GenerateRequest.adapter``
("" : the base model); ``select`` is that stage of its way in (intake.py, right after the bounds): the registry
(adapter_registry.py) resolves the name for the caller's tenant -- its own adapters, then the public ones its
``adapters`` in the tenants file allow -- else ``AdapterNotFound`` (NOT_FOUND), the same answer whether another
tenant has one of that name or nobody does. ``usable`` is what ModelInfo lists to the caller, with the executors
whose slots hold each now and its page-ins so far."""

from __future__ import annotations

from collections.abc import Iterable

from pagedkv.api.v1 import api_pb2 as api
from pagedkv.executor.v1 import executor_pb2 as pb
from pagedkv.tenancy import Tenant
from scheduler_svc.adapter_registry import HINT, AdapterNotFound, AdapterRegistry, Entry

__all__ = ["HINT", "AdapterNotFound", "mismatch", "select", "served", "usable"]


def served(describe: pb.DescribeResponse) -> dict[str, int]:
    """The start-up adapters an executor serves (--lora-modules): name -> rank."""
    return {a.name: a.rank for a in describe.adapters if not a.runtime}


def _slots(d: pb.DescribeResponse) -> tuple:
    return (d.lora_max_rank, tuple(sorted(d.lora_modules)), d.lora_runtime) if d.lora_slots else ()


def mismatch(describe: pb.DescribeResponse, reference: pb.DescribeResponse) -> str:
    """Why an executor's adapters keep it from joining the executors of ``reference`` ('' : the same start-up
    adapters by name and rank, in any order, and slots of the same rank and modules, run-time loads open or not on
    both; the number of slots may differ)."""
    mine, theirs = served(describe), served(reference)
    problems = []
    if missing := sorted(theirs.keys() - mine.keys()):
        problems.append(f"it does not serve {', '.join(missing)}")
    if extra := sorted(mine.keys() - theirs.keys()):
        problems.append(f"it serves {', '.join(extra)}, which the others do not")
    for name in sorted(n for n in mine.keys() & theirs.keys() if mine[n] != theirs[n]):
        problems.append(f"its {name} has rank {mine[name]}, the others' rank {theirs[name]}")
    if not problems and _slots(describe) != _slots(reference):
        problems.append(f"its adapter slots (rank, modules, --lora-root) {_slots(describe) or 'none'} differ from "
                        f"the others' {_slots(reference) or 'none'}")
    if not problems:
        return ""
    return (f"LoRA adapters (--lora-modules, --max-lora-rank, --lora-root) differ from the other executors': "
            f"{'; '.join(problems)} (every executor of a scheduler serves the same adapters)")


def select(name: str, registry: AdapterRegistry, tenant: Tenant) -> Entry | None:
    """The adapter a request of ``tenant`` selects by ``name`` (None: '' , the base model); else AdapterNotFound."""
    return registry.resolve(name, tenant) if name else None


def usable(registry: AdapterRegistry, tenant: Tenant, slots: Iterable) -> list[api.AdapterInfo]:
    """The adapters ``tenant`` may use (ModelInfoResponse.adapters), with the executors whose slots (``slots``: each
    executor's AdapterSlots) hold each now and the page-ins so far."""
    slots = [s for s in slots if s is not None]
    return [e.info(sum(s.resident(e.key) for s in slots), sum(s.page_ins_of(e.key) for s in slots))
            for e in registry.usable(tenant)]
