"""The LoRA adapters a scheduler serves, cluster-wide (#52): the public ones every executor loaded at start-up
(--lora-modules), and those loaded at run time (LoadAdapter: adapter_api.py), public or owned by a tenant.

An adapter is known to the executors by its ``key``: its name for a public one; for a tenant's own, its name and a
tag of the tenant (``key_for``), so that two tenants may each load a "my-lora" and neither learns of the other's.
A request selects one by name (``resolve``): the tenant's own first, then a public one its tenants-file
``adapters`` allows; anything else is AdapterNotFound, word for word the same whether it exists or not.

Each load gets a new ``serial``: the prefix cache keys an adapter's pages by key and serial (``cache_key``), so an
adapter unloaded and loaded again under the same name, with other weights, never hits the old one's KV.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from pagedkv.api.v1 import api_pb2 as api
from pagedkv.executor.v1 import executor_pb2 as pb
from pagedkv.tenancy import Tenant

HINT = "ModelInfo lists the adapters this caller's tenant may use"


class AdapterNotFound(LookupError):
    """A request's adapter is not served, or not to its tenant (gRPC NOT_FOUND; the gateway's 404)."""


@dataclass(slots=True)
class Entry:
    key: str  # the executors' name for it
    name: str  # the name its users select it by
    owner: str  # the tenant that loaded it ('' : public)
    rank: int
    num_bytes: int
    pages: int  # of a device slot
    path: str = ""  # its path under the executors' --lora-root ('' : a --lora-modules adapter)
    serial: int = 0
    ready: bool = True  # False while its load runs on the executors

    @property
    def cache_key(self) -> str:
        return self.key if not self.serial else f"{self.key}#{self.serial}"

    def info(self, resident: int = 0, page_ins: int = 0) -> api.AdapterInfo:
        return api.AdapterInfo(name=self.name, rank=self.rank, num_bytes=self.num_bytes, num_pages=self.pages,
                               owner=self.owner, resident=resident, num_page_ins=page_ins)


class AdapterRegistry:
    def __init__(self, reference: pb.DescribeResponse) -> None:
        """The start-up adapters of ``reference`` (the first executor's Describe), public."""
        self.entries: dict[str, Entry] = {
            a.name: Entry(a.name, a.name, "", a.rank, a.num_bytes, a.num_pages)
            for a in reference.adapters if not a.runtime}
        self._serial = 0

    @staticmethod
    def key_for(name: str, owner: str) -> str:
        """The executors' name of ``owner``'s adapter ``name`` (a public one's: its name)."""
        if not owner:
            return name
        return f"{name}.t{hashlib.sha256(owner.encode()).hexdigest()[:10]}"

    def resolve(self, name: str, tenant: Tenant) -> Entry:
        """The adapter ``tenant`` selects by ``name``: its own, else a public one it may use; else AdapterNotFound."""
        own = self.entries.get(self.key_for(name, tenant.id))
        if own is not None and own.ready and own.owner == tenant.id:
            return own
        public = self.entries.get(name)
        if public is not None and public.ready and not public.owner and tenant.may_use(name):
            return public
        shown = name if len(name) <= 64 else name[:61] + "..."
        raise AdapterNotFound(f"adapter: {shown!r} is not served; {HINT} (leave adapter empty for the base model)")

    def usable(self, tenant: Tenant) -> list[Entry]:
        """The adapters ``tenant`` may select, public ones first (in load order), then its own."""
        ready = [e for e in self.entries.values() if e.ready]
        return ([e for e in ready if not e.owner and tenant.may_use(e.name)]
                + [e for e in ready if e.owner == tenant.id])

    def owned(self, tenant_id: str) -> int:
        return sum(e.owner == tenant_id for e in self.entries.values())

    def owner_of(self, key: str) -> str:
        entry = self.entries.get(key)
        return entry.owner if entry is not None else ""

    def get(self, key: str) -> Entry | None:
        return self.entries.get(key)

    def loaded(self) -> int:
        """Adapters served (ready): start-up and run-time ones."""
        return sum(e.ready for e in self.entries.values())

    def has(self, key: str) -> bool:
        entry = self.entries.get(key)
        return entry is not None and entry.ready

    def begin(self, name: str, owner: str, path: str) -> Entry:
        """A run-time load starting (not ready: no request selects it yet; executors that join meanwhile load it)."""
        self._serial += 1
        entry = Entry(self.key_for(name, owner), name, owner, 0, 0, 0, path, self._serial, ready=False)
        self.entries[entry.key] = entry
        return entry

    def runtime(self) -> list[Entry]:
        """The run-time adapters (ready or loading), in load order: what an executor that joins must load."""
        return [e for e in self.entries.values() if e.path]

    def remove(self, key: str) -> None:
        self.entries.pop(key, None)
