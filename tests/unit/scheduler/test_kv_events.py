"""KvEventLog's contract beyond what the state machine (test_kv_events_stateful.py) checks: how events are cut into
batches and coalesced, the union over pools, replay and its window, subscriptions (live, closed, fallen behind),
snapshots, salts; and who may watch the KvEvents RPC (InternalCallers, on metadata alone)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pagedkv.fleet_salt import cache_salt, hash_id
from pagedkv.tenancy import Tenant, Tenants, hash_key
from pagedkv.trusted_hop import HOP_HEADER
from scheduler_svc import engine as engine_mod
from scheduler_svc.detokenizer import IncrementalDetokenizer
from scheduler_svc.kv_events import (
    Cleared,
    KvEventLog,
    Removed,
    Stored,
    SubscriberLagged,
    missing_secret_problem,
)
from scheduler_svc.kv_events_rpc import InternalCallers, encode
from scheduler_svc.kv_manager import KVManager
from scheduler_svc.pages import tier_pools
from scheduler_svc.prefix_cache import page_hash, tenant_root
from scheduler_svc.request import Request, Sampling
from tests.support.fake_cluster import BS as CLUSTER_BS
from tests.support.fake_cluster import Box, collect, until, up_cluster
from tests.support.fake_executor import NullTokenizer, make_request

pytestmark = pytest.mark.unit

BS = 2
SECRET = b"unit-test-fleet-secret-0123456789"


def request(tokens: list[int], tenant: str = "default", window: tuple[int, int] = (0, 0)) -> Request:
    root = tenant_root(tenant) if not window[1] else tenant_root(f"{tenant}\x00window:{window[0]}:{window[1]}")
    return Request(request_id="r", prompt_ids=list(tokens), sampling=Sampling(max_tokens=1), arrival=0,
                   detokenizer=IncrementalDetokenizer(NullTokenizer(), tokens, [], False), tenant=tenant,
                   hash_root=root, sink_tokens=window[0], window_tokens=window[1])


def published(log: KvEventLog, kv: KVManager, req: Request) -> list[int]:
    """Publishes every full page of req as if the executor confirmed them; returns their hash ids."""
    kv.admit(req, [], req.num_tokens)
    req.num_computed = req.num_tokens
    kv.publish(req)
    return [hash_id(h) for h in req.page_hashes]


def test_first_batch_clears_and_a_step_is_one_batch_of_coalesced_runs():
    log = KvEventLog(BS, salt_secret=SECRET)
    assert log.last_seq == 0 and log.replay(0)[0].events == (Cleared(),)
    pool, _ = tier_pools(8, BS, 0, log)
    kv = KVManager(pool)
    req = request([1, 2, 3, 4, 5, 6, 7], tenant="t1")
    ids = published(log, kv, req)
    assert log.flush() is not None and log.flush() is None, "nothing noted: no batch"
    (batch,) = log.replay(1)
    assert batch.seq == 1 and batch.events == (
        Stored(tuple(ids), None, (1, 2, 3, 4, 5, 6), BS, "GPU", cache_salt(SECRET, "t1")),), \
        "three pages of one sequence: one Stored (the last, partial page is not findable)"


def test_union_over_pools_and_a_clear_only_when_nothing_is_left():
    log = KvEventLog(BS)
    kvs = [KVManager(tier_pools(4, BS, 0, log)[0]) for _ in range(2)]
    first = published(log, kvs[0], request([1, 2, 3, 4]))
    again = published(log, kvs[1], request([1, 2, 3, 4]))
    other = published(log, kvs[1], request([9, 9]))
    assert first == again
    log.flush()
    stored = [h for ev in log.replay(1)[0].events for h in ev.hashes]
    assert stored == first + other, "a page both executors hold is announced once"
    kvs[1].forget_cached()  # the second executor is lost: only what it alone held goes
    assert log.flush().events == (Removed(tuple(other), "GPU"),)
    kvs[0].forget_cached()  # the last one: nothing is left
    assert log.flush().events == (Cleared(),)
    assert log.findable() == set() and log.snapshot() == (log.last_seq, [])


def test_eviction_spill_and_snapshot_parents_first():
    log = KvEventLog(BS)
    pool, host = tier_pools(2, BS, 4, log)
    kv = KVManager(pool, host=host)
    a = request([1, 2, 3, 4])
    ids = published(log, kv, a)
    log.flush()
    kv.release(a)  # free but findable
    kv.admit(request([7, 7, 7, 7]), [], 4)  # reuses both pages: evicted from the device, spilled to the host
    log.flush()
    events = log.replay(2)[0].events
    assert events == (Removed((ids[1],), "GPU"), Stored((ids[1],), ids[0], (3, 4), BS, "CPU", ""),
                      Removed((ids[0],), "GPU"), Stored((ids[0],), None, (1, 2), BS, "CPU", "")), \
        "freed tail-first: the suffix goes first"
    _, snap = log.snapshot()
    assert [ev.hashes for ev in snap] == [(ids[0],), (ids[1],)], "a snapshot lists parents before children"


def test_replay_window_and_subscriptions():
    log = KvEventLog(BS, buffer_batches=3)
    pool, _ = tier_pools(16, BS, 0, log)
    kv = KVManager(pool)
    sub = log.subscribe()
    for k in range(4):
        published(log, kv, request([10 + k, 20]))
        log.flush()
    assert log.last_seq == 4
    assert log.replay(5) == [] and [b.seq for b in log.replay(2)] == [2, 3, 4]
    assert log.replay(1) is None, "batch 1 left the buffer"
    assert log.replay(6) is None, "a number from another process"

    async def read():
        with pytest.raises(SubscriberLagged, match="fell more than 3 batches behind"):
            await sub.__anext__()
        late = log.subscribe()
        waiting = asyncio.ensure_future(late.__anext__())
        await asyncio.sleep(0)
        assert not waiting.done()
        published(log, kv, request([99, 98]))  # (inside a loop the batch is cut at the end of this callback)
        batch = await asyncio.wait_for(waiting, 5)
        late.close()
        with pytest.raises(StopAsyncIteration):
            await late.__anext__()
        return batch

    assert asyncio.run(read()).seq == 5


def test_salts():
    log = KvEventLog(BS, salt_secret=SECRET)
    assert log.salt("default", None) == ""
    assert log.salt("t1", None) == cache_salt(SECRET, "t1")
    assert log.salt("t1", (4, 8)) == cache_salt(SECRET, "t1", (4, 8)) != log.salt("t1", None)
    keyless = KvEventLog(BS)
    assert keyless.salt("default", (4, 8)) not in ("", keyless.salt("default", (4, 16))), \
        "one trust domain: its windowed requests still get a namespace of their own"
    with pytest.raises(ValueError, match="--fleet-secret-file"):
        keyless.salt("t1", None)
    assert "--fleet-secret-file" in missing_secret_problem(True, b"") and not missing_secret_problem(True, SECRET)
    assert not missing_secret_problem(False, b"")


def test_encoded_batch():
    log = KvEventLog(BS)
    pool, _ = tier_pools(4, BS, 0, log)
    ids = published(log, KVManager(pool), request([1, 2, 3, 4]))
    message = encode(log.flush(), BS)
    (ev,) = message.events
    assert list(ev.stored.hashes) == ids and not ev.stored.has_parent and list(ev.stored.token_ids) == [1, 2, 3, 4]
    assert message.block_size == BS and not message.snapshot and message.seq == 1


def test_who_may_watch():
    tenants = Tenants([Tenant("alpha", key_hashes=(bytes.fromhex(hash_key("ka")[7:]),)),
                       Tenant("ops", admin=True, key_hashes=(bytes.fromhex(hash_key("ko")[7:]),))])
    callers = InternalCallers(lambda: tenants, executor_secret="exec-secret", hop_secret="hop-secret")
    assert callers.refusal((("authorization", "Bearer exec-secret"),)) is None
    assert callers.refusal(((HOP_HEADER, "hop-secret"),)) is None
    assert callers.refusal((("authorization", "Bearer ko"),)) is None
    code, why = callers.refusal((("authorization", "Bearer ka"),))
    assert code == grpc.StatusCode.PERMISSION_DENIED and "tenant alpha is not an admin" in why
    for metadata in ((), (("authorization", "Bearer exec-secretx"),), ((HOP_HEADER, "hop"),),
                     (("authorization", "Bearer exec-secret"), ("authorization", "Bearer exec-secret"))):
        code, why = callers.refusal(metadata)
        assert code == grpc.StatusCode.UNAUTHENTICATED and "KvEvents.Watch" in why, metadata
    assert InternalCallers(lambda: Tenants()).refusal(()) is None, "one trust domain (no tenants file): its caller"


def test_an_executor_removed_while_down_takes_its_own_pages_out_of_the_stream(boxes):
    """Engines and a Cluster over stand-in executors: an executor whose Run stream was lost keeps its pages findable
    for its return; once it is no longer configured they go, those only it held Removed, those another executor
    holds too still announced."""
    prompt = list(range(3, 3 + 2 * CLUSTER_BS + 8))  # 2 full pages
    nudge_prompt = prompt[:CLUSTER_BS] + list(range(100, 100 + CLUSTER_BS + 4))  # shares page 0 only

    async def scenario():
        log = KvEventLog(CLUSTER_BS)
        boxes.update({"a:1": Box(64), "b:1": Box(64)})
        c = await up_cluster({"a:1", "b:1"}, events=log)
        first = make_request(1, 0, 4, prompt=prompt)
        c.add_request(first)
        assert (await collect(first))[1] is None
        holder = next(a for a, e in c.engines.items() if e.scheduler.kv.pool.num_cached)
        other = next(a for a in c.engines if a != holder)
        boxes[holder].alive = False
        nudge = make_request(2, 0, 4, prompt=nudge_prompt)  # placed on the holder (a prefix hit): moves on
        c.add_request(nudge)
        assert (await collect(nudge))[1] is None
        await until(lambda: c.engines[holder].state is engine_mod.State.DOWN)
        kept = log.findable()
        c.set_addresses({other})
        await until(lambda: c.engines[holder].stopped)
        c.set_addresses({other})  # (drops the stopped engine)
        log.flush()
        left = findable(c.engines[other].scheduler.kv.pool)
        await c.stop()
        return kept, left, log

    kept, left, log = asyncio.run(scenario())
    ids = [hash_id(h) for h in chain_of(prompt)]
    assert {(ids[0], "GPU"), (ids[1], "GPU")} <= kept, "a lost executor's pages stay findable for its return"
    assert log.findable() == left and (ids[0], "GPU") in left and (ids[1], "GPU") not in left
    assert replayed(log) == left


def chain_of(tokens: list[int]) -> list[bytes]:
    out, parent = [], tenant_root("default")
    for i in range(len(tokens) // CLUSTER_BS):
        parent = page_hash(parent, tokens[i * CLUSTER_BS:(i + 1) * CLUSTER_BS])
        out.append(parent)
    return out


def findable(pool) -> set[tuple[int, str]]:
    return {(hash_id(h), pool.medium) for p in range(pool.num_pages) if (h := pool.hash_of(p)) is not None}


def replayed(log: KvEventLog) -> set[tuple[int, str]]:
    """What a consumer that read every batch from the first believes is findable."""
    state: set[tuple[int, str]] = set()
    for batch in log.replay(0):
        for ev in batch.events:
            if isinstance(ev, Cleared):
                state.clear()
            elif isinstance(ev, Stored):
                state.update((h, ev.medium) for h in ev.hashes)
            else:
                state.difference_update((h, ev.medium) for h in ev.hashes)
    return state


def test_the_default_window_takes_the_tenants_plain_salt():
    """Every request on a model with its own sliding window is windowed: its pages take the tenant's plain salt (the
    one the edge gateway sets in nvext.cache_salt), and only a window a request or its tenant chose gets its own."""
    log = KvEventLog(BS, salt_secret=SECRET, default_window=(0, 8))
    kv = KVManager(tier_pools(16, BS, 0, log)[0])
    salts = {}
    for name, window in {"model's": (0, 8), "chosen": (2, 8)}.items():
        published(log, kv, request([1, 2, 3, 4, 5], "t1", window))
        log.flush()
        salts[name] = {e.salt for e in log.batch_at(log.last_seq).events if isinstance(e, Stored)}
    assert salts["model's"] == {cache_salt(SECRET, "t1")}
    assert salts["chosen"] == {cache_salt(SECRET, "t1", (2, 8))}
