"""Run-time LoRA adapters on the public API (#52): LoadAdapter and UnloadAdapter (vLLM's POST
/v1/load_lora_adapter and /v1/unload_lora_adapter through the gateway), and the loads an executor that joins later
gets (``sync_adapters``).

Who may do what (the tenants file, pagedkv/tenancy.py; without one, every load is public, as vLLM's, and open to
the one tenant): a tenant loads adapters it owns, at most its
``max_adapters`` (0: none, PERMISSION_DENIED); they are its alone (adapter_registry.py), and their pages in a device
slot count against its ``page_quota`` (adapter_slots.py), so one larger than the quota is refused at load. An admin
tenant may also load a public one (``public``). Unloading an adapter that a request uses (waiting, running or
swapped, on any executor) is refused with FAILED_PRECONDITION, naming how many: the caller retries once they end
(nothing in flight is cut). The path is checked by the executors, inside their --lora-root.
"""

from __future__ import annotations

import grpc

from pagedkv.api.v1 import api_pb2 as api
from pagedkv.bounds import InvalidRequest, check_load_adapter, check_loaded_name
from pagedkv.executor.v1 import executor_pb2 as pb
from scheduler_svc.adapter_registry import AdapterRegistry, Entry
from scheduler_svc.engine_types import State

METHODS = "/pagedkv.api.v1.Generation/"
LOAD_TIMEOUT_S = 120.0
SERVING = (State.UP, State.DRAINING)


async def _load(client, entry: Entry) -> pb.Adapter:
    return await client.stub.LoadAdapter(pb.LoadAdapterRequest(name=entry.key, path=entry.path),
                                          timeout=LOAD_TIMEOUT_S, metadata=client.metadata)


async def _unload(client, key: str) -> None:
    try:
        await client.stub.UnloadAdapter(pb.UnloadAdapterRequest(name=key), timeout=30.0, metadata=client.metadata)
    except grpc.aio.AioRpcError as err:
        if err.code() not in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAVAILABLE):
            raise


async def sync_adapters(registry: AdapterRegistry, client, describe: pb.DescribeResponse) -> str:
    """Loads on a joining executor the run-time adapters it lacks; returns why it cannot serve them ('' : it can)."""
    held = {a.name for a in describe.adapters}
    for entry in registry.runtime():
        if entry.key in held:
            continue
        try:
            got = await _load(client, entry)
        except grpc.aio.AioRpcError as err:
            return f"cannot load the run-time LoRA adapter {entry.name!r} ({entry.path}): {err.details()}"
        if not entry.rank:  # (loaded while no executor was up: its figures come from the first that loads it)
            entry.rank, entry.num_bytes, entry.pages = got.rank, got.num_bytes, got.num_pages
    return ""


class AdapterRpc:
    """GenerationService's LoadAdapter and UnloadAdapter (a base of it, as retention_api.py's ReleaseKvRpc). Uses
    its ``cluster``, ``live`` and ``_tenant``."""

    async def LoadAdapter(self, request, context):  # noqa: N802
        tenant = await self._tenant(context, METHODS + "LoadAdapter")
        name, path, registry = request.name, request.path, self.cluster.adapters
        try:
            check_load_adapter(request)
        except InvalidRequest as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        single = not self.cluster.tenants.multi  # (no tenants file: every load is public, as vLLM's)
        if request.public and not (tenant.admin or single):
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, "public: only an admin tenant (tenants file: admin "
                                "= true) may load a public adapter")
        owner = "" if request.public or single else tenant.id
        if owner and tenant.max_adapters <= 0:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, f"tenant {tenant.id} may not load adapters (its "
                                "max_adapters in the tenants file is 0)")
        if owner and registry.owned(owner) >= tenant.max_adapters:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"tenant {tenant.id} owns {registry.owned(owner)} "
                                f"adapters, its max_adapters ({tenant.max_adapters}): unload one first")
        ref = self.cluster.reference
        if not ref.lora_runtime:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "the executors load no adapters at run time: "
                                "start them with --lora-root DIR")
        if owner and tenant.page_quota and ref.lora_slot_pages > tenant.page_quota:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"an adapter slot takes {ref.lora_slot_pages} "
                                f"pages, more than tenant {tenant.id}'s page_quota {tenant.page_quota}")
        key = registry.key_for(name, owner)
        if registry.get(key) is not None or any(e.name == name for e in registry.usable(tenant)):
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"name: an adapter {name!r} is already served to "
                                "this tenant (unload it first, or choose another name)")
        entry = registry.begin(name, owner, path)
        done, got = [], pb.Adapter(num_pages=ref.lora_slot_pages)
        for engine in list(self.cluster.engines.values()):
            try:
                got = await _load(engine.client, entry)
                done.append(engine)
            except grpc.aio.AioRpcError as err:
                if err.code() == grpc.StatusCode.UNAVAILABLE and engine.state not in SERVING:
                    continue  # (down or connecting: it loads the adapter when it joins, sync_adapters)
                registry.remove(entry.key)
                for loaded in done:
                    await _unload(loaded.client, entry.key)
                await context.abort(err.code(), (err.details() or "").replace(entry.key, name))
        entry.rank, entry.num_bytes, entry.pages, entry.ready = got.rank, got.num_bytes, got.num_pages, True
        self.log.info("lora_adapter_loaded", adapter=name, tenant=owner or "(public)", rank=got.rank,
                      pages=got.num_pages, executors=len(done))
        return entry.info()

    async def UnloadAdapter(self, request, context):  # noqa: N802
        tenant = await self._tenant(context, METHODS + "UnloadAdapter")
        registry = self.cluster.adapters
        try:
            check_loaded_name(request.name)
        except InvalidRequest as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        entry = registry.get(registry.key_for(request.name, tenant.id))
        admin = tenant.admin or not self.cluster.tenants.multi
        if (entry is None or not entry.ready) and admin:
            entry = registry.get(request.name)
        if entry is None or not entry.ready or (entry.owner and entry.owner != tenant.id) or (
                not entry.owner and not admin):
            await context.abort(grpc.StatusCode.NOT_FOUND, f"name: no adapter {request.name!r} "
                                "of this tenant is loaded")
        if not entry.path:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"adapter {entry.name!r} was loaded at start-up "
                                "(the executors' --lora-modules) and stays")
        users = sum(stream.req.adapter == entry.key for stream in self.live.values())
        if users:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"adapter {entry.name!r} is in use by {users} "
                                "request(s) (waiting, running or swapped): retry when they end")
        registry.remove(entry.key)  # (no request selects it from now on)
        for engine in list(self.cluster.engines.values()):
            if engine.scheduler is not None and engine.scheduler.adapters is not None:
                engine.scheduler.adapters.evict(entry.key)
            await _unload(engine.client, entry.key)
        self.log.info("lora_adapter_unloaded", adapter=entry.name, tenant=entry.owner or "(public)")
        return api.UnloadAdapterResponse()
