"""The scheduler's KvEvents.Watch stream (#47), through real processes on loopback: a tiny-llama executor and a
scheduler with a tenants file, --fleet-secret-file and --kv-events-rpc. Two prompts of one tenant that share a
prefix are announced as Stored pages with their tokens, their chain (each page's parent, the second prompt's own
page hanging off the shared prefix) and the tenant's salt; a watcher that reconnects with from_seq gets the batches it
missed, one from another process's numbering a snapshot; a caller that is not internal is refused; a scheduler
asked for tenants' events without a fleet secret does not start, naming the flag."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pagedkv.client import Client
from pagedkv.fleet_salt import cache_salt, hash_id
from pagedkv.kvevents.v1 import kv_events_pb2 as kv
from pagedkv.kvevents.v1 import kv_events_pb2_grpc as kv_grpc
from pagedkv.local_server import TEST_EXECUTOR_SECRET
from pagedkv.tenancy import hash_key
from scheduler_svc.prefix_cache import page_hash, tenant_root
from tests.support import procs

pytestmark = pytest.mark.e2e

FLEET_SECRET = b"kv-events-rpc-test-fleet-secret-0123"
KEY_ALPHA, KEY_OPS = "key-kv-alpha", "key-kv-ops"
TENANTS = f"""
[tenants.alpha]
keys = ["{hash_key(KEY_ALPHA)}"]

[tenants.ops]
admin = true
keys = ["{hash_key(KEY_OPS)}"]
"""
BS = 16  # tiny-llama's executor default
SHARED = list(range(5, 5 + 3 * BS))  # 3 pages both prompts start with
PROMPT_A = SHARED + list(range(100, 100 + BS))
PROMPT_B = SHARED + list(range(200, 200 + BS))
ADMIN = (("authorization", f"Bearer {KEY_OPS}"),)


def chain(tenant: str, tokens: list[int]) -> list[bytes]:
    out, parent = [], tenant_root(tenant)
    for i in range(len(tokens) // BS):
        parent = page_hash(parent, tokens[i * BS:(i + 1) * BS])
        out.append(parent)
    return out


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("kvrpc")
    (tmp / "tenants.toml").write_text(TENANTS)
    (tmp / "fleet.secret").write_bytes(FLEET_SECRET)
    executor = procs.executor("--num-pages", "256")
    try:
        scheduler = procs.scheduler(executor.address, args=(
            "--tenants-file", str(tmp / "tenants.toml"), "--fleet-secret-file", str(tmp / "fleet.secret"),
            "--kv-events-rpc"))
    except Exception:
        executor.stop()
        raise
    yield tmp, executor, scheduler
    scheduler.stop()
    executor.stop()


class Watcher:
    """One Watch call, read batch by batch."""

    def __init__(self, address: str, request: kv.WatchRequest, metadata=ADMIN) -> None:
        self.channel = grpc.aio.insecure_channel(address)
        self.call = kv_grpc.KvEventsStub(self.channel).Watch(request, metadata=metadata)

    async def next(self, timeout: float = 60.0) -> kv.EventBatch:
        return await asyncio.wait_for(self.call.read(), timeout)

    async def until(self, done, timeout: float = 120.0) -> list[kv.EventBatch]:
        """Batches until ``done(batches so far)``."""
        batches: list[kv.EventBatch] = []
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not done(batches):
            batches.append(await self.next(max(0.1, deadline - loop.time())))
        return batches

    async def close(self) -> None:
        self.call.cancel()
        await self.channel.close()


def stored_pages(batches: list[kv.EventBatch], medium: str = "GPU") -> dict[int, tuple[int | None, list[int], str]]:
    """hash id -> (parent id, its tokens, salt) of every page the batches store on ``medium``."""
    out = {}
    for b in batches:
        for ev in b.events:
            if ev.WhichOneof("event") != "stored" or ev.stored.medium != medium:
                continue
            s = ev.stored
            parent = s.parent if s.has_parent else None
            for k, h in enumerate(s.hashes):
                out[h] = (parent, list(s.token_ids[k * BS:(k + 1) * BS]), s.salt)
                parent = h
    return out


def test_prompts_sharing_a_prefix_are_announced_with_tokens_chain_and_salt(stack):
    _, _, scheduler = stack
    a, b = [hash_id(h) for h in chain("alpha", PROMPT_A)], [hash_id(h) for h in chain("alpha", PROMPT_B)]
    assert a[:3] == b[:3] and a[3] != b[3]
    salt = cache_salt(FLEET_SECRET, "alpha")

    async def scenario():
        w = Watcher(scheduler.address, kv.WatchRequest())
        try:
            first = await w.next()
            async with Client(scheduler.address, api_key=KEY_ALPHA) as c:
                await c.complete(PROMPT_A, max_tokens=1)
                await c.complete(PROMPT_B, max_tokens=1)
            later = await w.until(lambda bs: b[3] in stored_pages(bs))
        finally:
            await w.close()
        return first, later

    first, later = asyncio.run(scenario())
    assert first.snapshot and first.block_size == BS and first.events[0].WhichOneof("event") == "cleared"
    assert [x.seq for x in later] == list(range(first.seq + 1, first.seq + 1 + len(later))), "a gap in the numbering"
    pages = stored_pages(later)
    for ids, prompt in ((a, PROMPT_A), (b, PROMPT_B)):
        for i, h in enumerate(ids):
            assert h in pages, f"page {i} of a prompt never stored"
            parent, tokens, page_salt = pages[h]
            assert tokens == prompt[i * BS:(i + 1) * BS]
            assert parent == (ids[i - 1] if i else None)
            assert page_salt == salt
    # the second prompt's first three pages were hits: announced once, by the first
    announced = [h for x in later for ev in x.events if ev.WhichOneof("event") == "stored" for h in ev.stored.hashes]
    assert all(announced.count(h) == 1 for h in a + b[3:])


def test_a_watcher_that_comes_back_gets_what_it_missed(stack):
    _, _, scheduler = stack

    async def scenario():
        w = Watcher(scheduler.address, kv.WatchRequest())
        snap = await w.next()
        await w.close()
        async with Client(scheduler.address, api_key=KEY_ALPHA) as c:  # batches cut while nobody watches
            await c.complete(list(range(150, 150 + 2 * BS + 3)), max_tokens=1)
        back = Watcher(scheduler.address, kv.WatchRequest(from_seq=snap.seq + 1, has_from_seq=True))
        try:
            resumed = await back.until(lambda bs: len(stored_pages(bs)) >= 2)
        finally:
            await back.close()
        stranger = Watcher(scheduler.address, kv.WatchRequest(from_seq=10**12, has_from_seq=True))
        try:
            restated = await stranger.next()
        finally:
            await stranger.close()
        return snap, resumed, restated

    snap, resumed, restated = asyncio.run(scenario())
    assert not resumed[0].snapshot and resumed[0].seq == snap.seq + 1, "not resumed at the batch asked for"
    assert [x.seq for x in resumed] == list(range(snap.seq + 1, snap.seq + 1 + len(resumed)))
    missed = stored_pages(resumed)
    assert {hash_id(h) for h in chain("alpha", list(range(150, 150 + 2 * BS)))} <= set(missed)
    assert restated.snapshot and restated.seq >= resumed[-1].seq
    assert set(stored_pages([restated])) >= set(missed), "the snapshot lacks pages still findable"


def test_only_an_internal_caller_may_watch(stack):
    _, _, scheduler = stack

    async def attempt(metadata) -> grpc.StatusCode | kv.EventBatch:
        w = Watcher(scheduler.address, kv.WatchRequest(), metadata=metadata)
        try:
            return await w.next()
        except grpc.aio.AioRpcError as err:
            return err
        finally:
            await w.close()

    no_key = asyncio.run(attempt(()))
    assert no_key.code() == grpc.StatusCode.UNAUTHENTICATED and "KvEvents.Watch" in no_key.details()
    tenant = asyncio.run(attempt((("authorization", f"Bearer {KEY_ALPHA}"),)))
    assert tenant.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "tenant alpha is not an admin" in tenant.details()
    wrong = asyncio.run(attempt((("authorization", f"Bearer {TEST_EXECUTOR_SECRET}x"),)))
    assert wrong.code() == grpc.StatusCode.UNAUTHENTICATED
    internal = asyncio.run(attempt((("authorization", f"Bearer {TEST_EXECUTOR_SECRET}"),)))
    assert isinstance(internal, kv.EventBatch) and internal.snapshot


def test_health_and_reflection_list_the_service(stack):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    _, _, scheduler = stack
    service = kv.DESCRIPTOR.services_by_name["KvEvents"].full_name
    with grpc.insecure_channel(scheduler.address) as channel:
        assert service in ProtoReflectionDescriptorDatabase(channel).get_services()
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service)).status
    assert status == health_pb2.HealthCheckResponse.SERVING


def test_tenants_events_without_a_fleet_secret_do_not_start(stack):
    tmp, executor, _ = stack
    p = procs.Proc("scheduler", "--executor", executor.address, "--tenants-file", str(tmp / "tenants.toml"),
                   "--kv-events-rpc", wait=False)
    try:
        assert p.wait(120) != 0
    finally:
        p.kill()
    assert "KV events for several tenants need a fleet secret (--fleet-secret-file" in p.log()
