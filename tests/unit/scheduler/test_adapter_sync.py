"""Run-time LoRA adapters reach executors that join later (#52, scheduler_svc/adapter_api.sync_adapters): an executor
whose Describe lacks a run-time adapter the cluster serves is sent LoadAdapter for it (by its executors' key and
path), one that has it is not, and one that cannot load it is refused with the adapter and the executor's reason;
the registry keeps two tenants' adapters of one name apart and resolves each tenant's own first."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import grpc
import pytest

from pagedkv.executor.v1 import executor_pb2 as pb
from pagedkv.tenancy import Tenant
from scheduler_svc.adapter_api import sync_adapters
from scheduler_svc.adapter_registry import AdapterNotFound, AdapterRegistry

pytestmark = pytest.mark.unit


class FakeError(grpc.aio.AioRpcError):
    def __init__(self, details: str) -> None:
        super().__init__(grpc.StatusCode.INVALID_ARGUMENT, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class Stub:
    def __init__(self, fail: str = "") -> None:
        self.loaded: list[tuple[str, str]] = []
        self.fail = fail

    async def LoadAdapter(self, request, timeout=None, metadata=None):  # noqa: N802
        if self.fail:
            raise FakeError(self.fail)
        self.loaded.append((request.name, request.path))
        return pb.Adapter(name=request.name, rank=8, num_pages=3)


def _registry() -> AdapterRegistry:
    reg = AdapterRegistry(pb.DescribeResponse(adapters=[pb.Adapter(name="boot", rank=8, num_pages=3)]))
    for owner in ("alice", "bob"):
        entry = reg.begin("mine", owner, f"{owner}-dir")
        entry.ready = True
    return reg


def test_a_joining_executor_loads_the_run_time_adapters_it_lacks():
    reg = _registry()
    alice_key, bob_key = reg.key_for("mine", "alice"), reg.key_for("mine", "bob")
    assert alice_key != bob_key and alice_key.startswith("mine.t")
    stub = Stub()
    has_bobs = pb.DescribeResponse(adapters=[pb.Adapter(name="boot"), pb.Adapter(name=bob_key, runtime=True)])
    assert asyncio.run(sync_adapters(reg, SimpleNamespace(stub=stub, metadata=()), has_bobs)) == ""
    assert stub.loaded == [(alice_key, "alice-dir")]  # (the start-up one and bob's are there)
    assert reg.get(alice_key).rank == 8 and reg.get(bob_key).rank == 0  # (loaded while none was up: from this one)
    broken = Stub(fail="path: 'alice-dir' is not a directory under --lora-root")
    why = asyncio.run(sync_adapters(reg, SimpleNamespace(stub=broken, metadata=()), has_bobs))
    assert why == ("cannot load the run-time LoRA adapter 'mine' (alice-dir): path: 'alice-dir' is not a directory "
                   "under --lora-root")


def test_each_tenant_resolves_its_own_adapter_and_a_public_one_it_may_use():
    reg = _registry()
    alice, bob, carol = Tenant("alice"), Tenant("bob"), Tenant("carol", adapters=())
    assert reg.resolve("mine", alice).owner == "alice" and reg.resolve("mine", bob).owner == "bob"
    assert reg.resolve("boot", alice).owner == ""
    for name, tenant in (("mine", Tenant("dave")), ("boot", carol)):
        with pytest.raises(AdapterNotFound, match=rf"adapter: '{name}' is not served;"):
            reg.resolve(name, tenant)
    assert [e.name for e in reg.usable(alice)] == ["boot", "mine"] and reg.owned("bob") == 1
    first, again = reg.get(reg.key_for("mine", "alice")), reg.begin("other", "alice", "x")
    assert again.serial > first.serial and first.cache_key != again.cache_key and not again.ready
    assert reg.loaded() == 3 and reg.owner_of(again.key) == "alice"


class Aborted(Exception):
    pass


class Context:
    async def abort(self, code, details):
        raise Aborted(code, details)


def test_a_load_skips_executors_that_are_down_and_fails_on_one_that_refuses():
    """LoadAdapter goes to every executor: one that is down (UNAVAILABLE, not up) is passed over (it loads the
    adapter when it joins), one that is up and refuses fails the load, which is undone on those that took it."""
    from pagedkv.api.v1 import api_pb2 as api
    from scheduler_svc.adapter_api import AdapterRpc
    from scheduler_svc.engine_types import State

    class Down(Stub):
        async def LoadAdapter(self, request, timeout=None, metadata=None):  # noqa: N802
            raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "down")

    class Unloading(Stub):
        unloaded: list = []

        async def UnloadAdapter(self, request, timeout=None, metadata=None):  # noqa: N802
            self.unloaded.append(request.name)

    def engine(stub, state):
        return SimpleNamespace(client=SimpleNamespace(stub=stub, metadata=()), state=state)

    def rpc(engines):
        svc = AdapterRpc()
        svc.cluster = SimpleNamespace(adapters=_registry(), engines=engines, tenants=SimpleNamespace(multi=True),
                                      reference=pb.DescribeResponse(lora_runtime=True, lora_slot_pages=3))
        svc.live, svc.log = {}, SimpleNamespace(info=lambda *a, **k: None)

        async def tenant(context, method):
            return Tenant("alice", max_adapters=2)
        svc._tenant = tenant
        return svc
    up = Unloading()
    svc = rpc({"a": engine(up, State.UP), "b": engine(Down(), State.DOWN)})
    info = asyncio.run(svc.LoadAdapter(api.LoadAdapterRequest(name="new", path="p"), Context()))
    assert (info.name, info.owner, info.rank) == ("new", "alice", 8) and len(up.loaded) == 1
    svc = rpc({"a": engine(up, State.UP), "b": engine(Stub(fail="r = 99 is outside [1, 16]"), State.UP)})
    with pytest.raises(Aborted) as err:
        asyncio.run(svc.LoadAdapter(api.LoadAdapterRequest(name="new", path="p"), Context()))
    assert err.value.args == (grpc.StatusCode.INVALID_ARGUMENT, "r = 99 is outside [1, 16]")
    assert up.unloaded == [svc.cluster.adapters.key_for("new", "alice")]  # (undone where it was taken)
    assert svc.cluster.adapters.get(svc.cluster.adapters.key_for("new", "alice")) is None
