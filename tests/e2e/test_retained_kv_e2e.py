"""Retained KV (GenerateRequest.retain_kv, ReleaseKv) through a real ``pagedkv serve`` on loopback: a conversation
kept for its tenant survives traffic that fills the KV pool, and its follow-up gets the pages as cached tokens; the
same traffic evicts a conversation not kept. Another tenant neither hits nor releases it; retain_kv's bounds answer
INVALID_ARGUMENT naming the field and the limit; a TTL ends the retention on its own."""

from __future__ import annotations

import asyncio
import random
import time

import grpc
import pytest

from pagedkv.client import Client
from pagedkv.tenancy import hash_key
from tests.conftest import Server

pytestmark = pytest.mark.e2e

BS = 16
MAX_TTL = 600
TENANTS = ("alice", "bob")


@pytest.fixture(scope="module")
def server(model_cache, tmp_path_factory):
    path = tmp_path_factory.mktemp("tenants") / "tenants.toml"
    path.write_text("".join(f'[tenants.{t}]\nkeys = ["{hash_key("key-" + t)}"]\n' for t in TENANTS))
    # 48 pages of 16 tokens: the churn below fills the pool several times over
    s = Server("--num-pages", "48", "--block-size", str(BS), "--max-model-len", "512", "--check-integrity",
               "--tenants-file", str(path), "--kv-retention-max-ttl", str(MAX_TTL))
    yield s
    s.stop()


def ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [1] + [rng.randrange(3, 259) for _ in range(n - 1)]


GREEDY = dict(max_tokens=8, ignore_eos=True, temperature=0)


async def conversation(client: Client, seed: int, retain: tuple[str, int] | None) -> tuple[int, int]:
    """Turn 1 (kept or not), churn that fills the pool, then the follow-up: (pages kept, follow-up's cached tokens)."""
    first_prompt = ids(200, seed)
    first = await client.complete(first_prompt, retain_kv=retain, **GREEDY)
    kept = (await client.model_info()).tenant.retained_pages
    for j in range(8):  # 8 x 300 tokens through a 768-token pool
        await client.complete(ids(300, seed * 100 + j), max_tokens=2, ignore_eos=True)
    follow = await client.complete(first_prompt + first.token_ids + ids(20, seed + 1)[1:], **GREEDY)
    return kept, follow.cached_tokens


def test_a_kept_conversation_survives_churn_and_one_not_kept_does_not(server):
    async def scenario():
        async with Client(server.address, api_key="key-alice") as alice:
            with_kv = await conversation(alice, 1, ("conv-1", MAX_TTL))
            without = await conversation(alice, 2, None)
            return with_kv, without

    (kept, cached_with), (not_kept, cached_without) = asyncio.run(scenario())
    assert kept == 12  # 200 + 7 computed tokens: 12 full pages
    assert cached_with == 12 * BS
    assert not_kept == 12 and cached_without == 0  # (12: conv-1's, still kept)


def test_another_tenant_neither_hits_nor_releases_and_the_owner_does(server):
    prompt = ids(120, 7)

    async def scenario():
        async with Client(server.address, api_key="key-alice") as alice, \
                Client(server.address, api_key="key-bob") as bob:
            first = await alice.complete(prompt, retain_kv=("conv-7", MAX_TTL), **GREEDY)
            follow = prompt + first.token_ids + [5, 6, 7]
            bob_follow = await bob.complete(follow, **GREEDY)
            with pytest.raises(grpc.aio.AioRpcError) as bob_release:
                await bob.release_kv("conv-7")
            bob_sees = (await bob.model_info()).tenant.retained_pages
            mine = (await alice.model_info()).tenant
            released = await alice.release_kv("conv-7")
            after = (await alice.model_info()).tenant.retained_pages
            with pytest.raises(grpc.aio.AioRpcError) as again:
                await alice.release_kv("conv-7")
            return bob_follow, bob_release.value, bob_sees, mine, released, after, again.value

    bob_follow, bob_release, bob_sees, mine, released, after, again = asyncio.run(scenario())
    assert bob_follow.cached_tokens == 0
    assert bob_release.code() == grpc.StatusCode.NOT_FOUND and bob_sees == 0
    assert mine.retained_pages >= 7 and mine.max_retained_pages > 0  # (127 tokens: 7 pages; conv-1 may be kept too)
    assert released == 7 and after == mine.retained_pages - 7
    assert again.code() == grpc.StatusCode.NOT_FOUND


@pytest.mark.parametrize(("retain", "names"), [
    (("k", 0), ["retain_kv.ttl_s", f"[1, {MAX_TTL}]", "--kv-retention-max-ttl"]),
    (("k", MAX_TTL + 1), ["retain_kv.ttl_s", f"[1, {MAX_TTL}]"]),
    (("", 10), ["retain_kv.key", "1..128 bytes"]),
    (("x" * 129, 10), ["retain_kv.key", "129 bytes", "1..128"]),
])
def test_retain_kv_bounds_name_the_field_and_the_limit(server, retain, names):
    async def scenario():
        async with Client(server.address, api_key="key-alice") as alice:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await alice.complete([1, 5, 6], retain_kv=retain, max_tokens=1)
            return err.value

    err = asyncio.run(scenario())
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert all(n in err.details() for n in names), err.details()


def test_the_ttl_ends_the_retention_while_the_server_is_idle(server):
    async def scenario():
        async with Client(server.address, api_key="key-bob") as bob:
            await bob.complete(ids(100, 11), retain_kv=("short", 1), **GREEDY)
            kept = (await bob.model_info()).tenant.retained_pages
            deadline = time.monotonic() + 30  # (it ends within a second of its TTL; this only bounds the wait)
            while (await bob.model_info()).tenant.retained_pages and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
            left = (await bob.model_info()).tenant.retained_pages
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await bob.release_kv("short")
            return kept, left, err.value

    kept, left, err = asyncio.run(scenario())
    assert kept == 6 and left == 0  # 107 computed tokens: 6 pages
    assert err.code() == grpc.StatusCode.NOT_FOUND
