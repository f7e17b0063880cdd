"""The tenant probes of issue 29 through a real ``pagedkv serve`` (one for the module; the in-process versions,
field by field, are in test_tenant_isolation.py): two credentials on the wire, a queue flood refused by the
scheduler's --max-queued-requests / --max-queued-total, and a SIGHUP reload that revokes the key of an open
stream."""

from __future__ import annotations

import asyncio
import signal

import grpc
import pytest

from pagedkv.api.v1 import api_pb2 as api
from pagedkv.client import Client
from pagedkv.grpc_common import QUEUE_FULL_PREFIX
from pagedkv.tenancy import hash_key
from tests.conftest import Server, wait_until

pytestmark = pytest.mark.e2e

HOLD = {"max_tokens": 1500, "ignore_eos": True}  # a request that runs until it is cancelled
TENANTS = f"""
[tenants.q]
keys = ["{hash_key('key-q')}"]
max_concurrent_requests = 1
[tenants.s]
keys = ["{hash_key('key-s')}"]
max_concurrent_requests = 1
[tenants.v]
keys = ["{hash_key('key-v1')}", "{hash_key('key-v2')}"]
[tenants.ops]
keys = ["{hash_key('key-ops')}"]
admin = true
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("tenants") / "tenants.toml"
    path.write_text(TENANTS)
    s = Server("--num-pages", "512", "--threads", "1", "--tenants-file", str(path), "--max-queued-requests", "2",
               "--max-queued-total", "3")
    s.tenants_path = path
    yield s
    s.stop()


async def waiting(address: str) -> int:
    async with Client(address, api_key="key-ops") as ops:
        return (await ops.model_info()).num_waiting


async def until_waiting(address: str, n: int) -> None:
    for _ in range(600):
        if await waiting(address) == n:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{await waiting(address)} requests waiting, not {n}")


async def refused(client: Client, prompt) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await client.complete(prompt, max_tokens=2)
    return err.value


def test_a_queue_flood_is_refused_by_the_servers_bounds(server):
    """q and s may each run 1 request; --max-queued-requests 2 lets q queue 2 (its third is refused: its bound),
    --max-queued-total 3 lets s queue 1 more (its second is refused: the scheduler's bound)."""
    async def scenario():
        # (resume=None: a full queue is a refusal to see here, not one for the client to wait out)
        async with (Client(server.address, api_key="key-q", resume=None) as q,
                    Client(server.address, api_key="key-s", resume=None) as s):
            streams, pending = [], []

            async def hold(client: Client, first: int, queued: int) -> None:
                """A request that runs (its first token came), then ``queued`` more that wait behind it."""
                streams.append(client.generate([1, first, 7], **HOLD))
                await streams[-1].__anext__()
                streams.extend(client.generate([1, first + 1 + i, 7], **HOLD) for i in range(queued))
                pending.extend(asyncio.ensure_future(st.__anext__()) for st in streams[-queued:])

            await hold(q, 10, 2)
            await until_waiting(server.address, 2)
            q_full = await refused(q, [1, 20, 7])
            await hold(s, 30, 1)
            await until_waiting(server.address, 3)
            s_full = await refused(s, [1, 40, 7])
            for p in pending:
                p.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            for st in streams:
                await st.aclose()
            await until_waiting(server.address, 0)
            return q_full, s_full
    q_full, s_full = asyncio.run(scenario())
    assert q_full.code() == s_full.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert q_full.details() == (f"{QUEUE_FULL_PREFIX}tenant q has 2 requests waiting to start; its "
                                "max_queued_requests is 2 (retry once some have started)")
    assert s_full.details().startswith(f"{QUEUE_FULL_PREFIX}the scheduler holds its limit of 3 requests")


def test_two_authorization_entries_are_refused_on_the_wire(server):
    async def call(*keys: str):
        metadata = tuple(("authorization", f"Bearer {k}") for k in keys)
        async with Client(server.address, metadata=metadata) as client:
            try:
                return len((await client.complete([1, 10, 20], max_tokens=2)).token_ids)
            except grpc.aio.AioRpcError as err:
                return err.code(), err.details()

    assert asyncio.run(call("key-v1")) == 2
    for keys in (("key-v1", "key-q"), ("key-v1", "key-v1")):
        code, details = asyncio.run(call(*keys))
        assert code == grpc.StatusCode.UNAUTHENTICATED and "authorization metadata: sent 2 times" in details


def test_a_sighup_that_revokes_a_key_ends_its_open_stream(server):
    """Tenant v has two keys; the reload revokes key-v1: its open stream ends with UNAUTHENTICATED, the one opened
    with key-v2 goes on."""
    revoked = TENANTS.replace(f'keys = ["{hash_key("key-v1")}", "{hash_key("key-v2")}"]',
                              f'keys = ["{hash_key("key-v2")}"]\nrevoked_keys = ["{hash_key("key-v1")}"]')
    assert revoked != TENANTS

    async def scenario():
        async with Client(server.address, api_key="key-v1") as v1, Client(server.address, api_key="key-v2") as v2:
            gone, kept = v1.generate([1, 50, 7], **HOLD), v2.generate([1, 51, 7], **HOLD)
            await gone.__anext__()
            await kept.__anext__()
            server.tenants_path.write_text(revoked)
            server.proc.send_signal(signal.SIGHUP)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in gone:
                    pass
            still = await kept.__anext__()
            await kept.aclose()
            return err.value, still

    try:
        err, still = asyncio.run(scenario())
    finally:
        server.tenants_path.write_text(TENANTS)
        server.proc.send_signal(signal.SIGHUP)
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED
    assert err.details() == "API key revoked: the tenants file was reloaded and this stream ended"
    assert isinstance(still, api.GenerateResponse) and still.token_ids
    assert wait_until(lambda: "streams_revoked=1" in server.log(), 60), server.log()
