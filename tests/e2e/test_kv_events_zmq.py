"""The KV event publisher's sockets on loopback: what a vLLM subscriber receives live, replay from the ROUTER socket
(then vLLM's end marker), the bounded buffer, and CURVE (a client with an allowed key receives, others do not).
The wire format and the config checks alone: tests/unit/test_kv_events_zmq.py."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading

import pytest
import zmq
import zmq.auth

from pagedkv import fleet_salt
from pagedkv.cli import free_port
from pagedkv.client import Client
from pagedkv.local_server import ROOT
from pagedkv.tenancy import hash_key
from scheduler_svc import kv_events_config as kc
from scheduler_svc import kv_events_zmq as kz
from scheduler_svc.kv_events import KvEventLog
from tests.support import vllm_kv_events as vllm
from tests.support.zmq_kv_subscriber import (
    LOG,
    TOPIC,
    batch,
    config,
    first_live,
    local,
    page_request,
    publish,
    receive,
    replay,
    replay_all,
    sent_at_least,
    stored_until,
    subscriber,
    wait_connected,
)

pytestmark = pytest.mark.e2e


@pytest.fixture
def ctx():
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


def test_subscriber_decodes_live_batches(ctx) -> None:
    pub = kz.start(config(), None, LOG)
    try:
        sub = subscriber(ctx, pub.endpoint)
        nxt = first_live(pub, sub)
        for seq in range(nxt, nxt + 5):
            pub.offer(seq, batch(seq))
        for seq in range(nxt, nxt + 5):
            got_seq, got = receive(sub)
            assert got_seq == seq and got.ts == 1000.0 + seq and got.data_parallel_rank == 0
            stored, removed = got.events
            assert isinstance(stored, vllm.BlockStored) and stored.block_hashes == [seq]
            assert stored.token_ids == [seq, seq + 1] and stored.block_size == 2 and stored.medium == "GPU"
            assert isinstance(removed, vllm.BlockRemoved) and removed.block_hashes == [seq - 1]
    finally:
        pub.close()


def test_missed_batch_replayed_then_end_marker(ctx) -> None:
    pub = kz.start(config(), None, LOG)
    try:
        sub = subscriber(ctx, pub.endpoint)
        nxt = first_live(pub, sub)
        for seq in range(nxt, nxt + 6):
            pub.offer(seq, batch(seq))
        seen = [receive(sub)[0] for _ in range(6)]
        missed = seen[2]  # the subscriber lost this one: it sees seq missed + 1 after missed - 1
        replies = replay(ctx, pub.replay_endpoint, missed)
        *batches, end = replies
        assert end == [b"", kz.END_SEQ, b""]  # vLLM's marker: seq -1 and an empty payload
        assert [int.from_bytes(seq, "big") for _, seq, _ in batches] == list(range(missed, nxt + 6))
        for topic, seq, payload in batches:
            decoded = vllm.decoder().decode(payload)
            assert topic == TOPIC.encode() and decoded.events[0].block_hashes == [int.from_bytes(seq, "big")]
        assert replay(ctx, pub.replay_endpoint, nxt + 6) == [[b"", kz.END_SEQ, b""]]  # nothing newer: the marker
    finally:
        pub.close()


def test_replay_buffer_keeps_the_last_buffer_steps(ctx) -> None:
    pub = kz.start(config(buffer_steps=4), None, LOG)
    try:
        sub = subscriber(ctx, pub.endpoint)
        nxt = first_live(pub, sub)
        for seq in range(nxt, nxt + 10):
            pub.offer(seq, batch(seq))
        for _ in range(10):
            receive(sub)
        *batches, _ = replay(ctx, pub.replay_endpoint, 0)
        assert [int.from_bytes(seq, "big") for _, seq, _ in batches] == list(range(nxt + 6, nxt + 10))
    finally:
        pub.close()


def test_bad_replay_request_gets_nothing_and_publishing_goes_on(ctx) -> None:
    pub = kz.start(config(), None, LOG)
    try:
        sub = subscriber(ctx, pub.endpoint)
        nxt = first_live(pub, sub)
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(pub.replay_endpoint)
        dealer.send_multipart([b"", b"\x01"])  # not 8 bytes
        pub.offer(nxt, batch(nxt))
        assert receive(sub)[0] == nxt
        assert [int.from_bytes(s, "big") for _, s, _ in replay(ctx, pub.replay_endpoint, nxt)[:-1]] == [nxt]
        assert not dealer.poll(0)
        dealer.close(linger=0)
    finally:
        pub.close()


def test_port_in_use_is_a_start_up_error() -> None:
    cfg = config()
    first = kz.start(cfg, None, LOG)
    try:
        with pytest.raises(ValueError, match=f"--kv-events-config: endpoint {cfg.endpoint}: .*[Aa]ddress"):
            kz.start(cfg, None, LOG)
    finally:
        first.close()


def test_curve_admits_only_allowed_client_keys(ctx, tmp_path) -> None:
    (tmp_path / "server").mkdir()
    (tmp_path / "clients").mkdir()
    (tmp_path / "strangers").mkdir()
    _, server_secret = zmq.auth.create_certificates(tmp_path / "server", "server")
    _, allowed_secret = zmq.auth.create_certificates(tmp_path / "clients", "allowed")
    _, stranger_secret = zmq.auth.create_certificates(tmp_path / "strangers", "stranger")
    keys = kc.load_curve_keys(server_secret, str(tmp_path / "clients"))
    # every interface: refused without keys (tests/unit), allowed with them
    cfg = config(endpoint=f"tcp://*:{free_port()}", replay_endpoint=f"tcp://*:{free_port()}")
    pub = kz.start(cfg, keys, LOG)
    try:
        allowed_pub, allowed_sec = zmq.auth.load_certificate(allowed_secret)
        stranger_pub, stranger_sec = zmq.auth.load_certificate(stranger_secret)
        allowed = subscriber(ctx, pub.endpoint, (allowed_pub, allowed_sec, keys.public))
        stranger = subscriber(ctx, pub.endpoint, (stranger_pub, stranger_sec, keys.public))
        plain = subscriber(ctx, pub.endpoint)
        nxt = first_live(pub, allowed)
        for seq in range(nxt, nxt + 3):
            pub.offer(seq, batch(seq))
        assert [receive(allowed)[0] for _ in range(3)] == [nxt, nxt + 1, nxt + 2]
        assert not stranger.poll(0) and not plain.poll(0)  # every batch reached the allowed client; none these
        dealer = ctx.socket(zmq.DEALER)
        dealer.curve_publickey, dealer.curve_secretkey, dealer.curve_serverkey = \
            stranger_pub, stranger_sec, keys.public
        dealer.connect(local(pub.replay_endpoint))
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        allowed_replay = ctx.socket(zmq.DEALER)
        allowed_replay.curve_publickey, allowed_replay.curve_secretkey, allowed_replay.curve_serverkey = \
            allowed_pub, allowed_sec, keys.public
        allowed_replay.connect(local(pub.replay_endpoint))
        allowed_replay.send_multipart([b"", nxt.to_bytes(8, "big")])
        frames = []
        while not frames or frames[-1][2] != kz.END_SEQ:
            assert allowed_replay.poll(5000)
            frames.append(allowed_replay.recv_multipart())
        assert len(frames) == 4  # nxt .. nxt + 2, then the marker
        assert not dealer.poll(0)
        dealer.close(linger=0)
        allowed_replay.close(linger=0)
    finally:
        pub.close()


# ---- fed by the scheduler's KvEventLog ---------------------------------------------------------------------------
def test_publishes_the_log_from_its_first_batch(ctx) -> None:
    """run() publishes the log's batches in order from 0 (the Cleared a scheduler starts with), as vLLM events:
    the chain's first page with the tenant's salt, its parent links, removals."""
    secret = b"s" * 32
    req = page_request("acme", list(range(1, 13)), 4)
    salt = fleet_salt.cache_salt(secret, "acme")

    async def main() -> list:
        events = KvEventLog(block_size=4, salt_secret=secret)
        pub = kz.start(config(), None, LOG)
        task = asyncio.create_task(kz.run(pub, events, LOG))
        try:
            publish(events, req, range(2))
            await asyncio.sleep(0)  # (the batch is cut at the end of this callback: one per step)
            publish(events, req, range(2, 3))
            await asyncio.sleep(0)
            events.removed(req.page_hashes[2], "GPU")
            await asyncio.sleep(0)
            return await asyncio.to_thread(replay_all, ctx, pub, events.last_seq)
        finally:
            task.cancel()
            pub.close()

    batches = asyncio.run(main())
    assert [seq for seq, _ in batches] == [0, 1, 2, 3]
    assert [type(e) for e in batches[0][1].events] == [vllm.AllBlocksCleared]
    (first,), (second,), (removed,) = (b.events for _, b in batches[1:])
    ids = [fleet_salt.hash_id(h) for h in req.page_hashes]
    assert (first.block_hashes, first.parent_block_hash, first.token_ids) == (ids[:2], None, list(range(1, 9)))
    assert first.extra_keys == [(salt,), None] and first.medium == "GPU" and first.block_size == 4
    assert (second.block_hashes, second.parent_block_hash, second.token_ids) == (ids[2:], ids[1], [9, 10, 11, 12])
    assert second.extra_keys == [None]
    assert isinstance(removed, vllm.BlockRemoved) and removed.block_hashes == [ids[2]]


def test_lagged_subscription_restarts_from_a_snapshot(ctx) -> None:
    """Batches the log dropped before run() read them are restated: one batch that clears and stores every page
    findable, numbered as the last batch it stands for; publishing goes on after it."""
    req = page_request("default", list(range(1, 25)), 4)

    async def main() -> list:
        events = KvEventLog(block_size=4, buffer_batches=2)
        pub = kz.start(config(), None, LOG)
        task = asyncio.create_task(kz.run(pub, events, LOG))
        try:
            await asyncio.sleep(0)  # run() subscribed
            for j in range(5):  # five batches cut while run() waits: its next one leaves the buffer
                publish(events, req, range(j, j + 1))
                events.flush()
            lagged_at = events.last_seq
            await asyncio.sleep(0.01)
            publish(events, req, range(5, 6))
            await asyncio.sleep(0)
            return lagged_at, await asyncio.to_thread(replay_all, ctx, pub, events.last_seq)
        finally:
            task.cancel()
            pub.close()

    lagged_at, batches = asyncio.run(main())
    ids = [fleet_salt.hash_id(h) for h in req.page_hashes]
    (snap_seq, snapshot), (next_seq, after) = batches[-2:]
    assert (snap_seq, next_seq) == (lagged_at, lagged_at + 1)
    assert isinstance(snapshot.events[0], vllm.AllBlocksCleared)
    assert [e.block_hashes[0] for e in snapshot.events[1:]] == ids[:5]
    assert [e.parent_block_hash for e in snapshot.events[1:]] == [None, *ids[:4]]
    assert after.events[0].block_hashes == [ids[5]] and after.events[0].parent_block_hash == ids[4]


# ---- a real scheduler and executor -------------------------------------------------------------------------------
def test_scheduler_publishes_a_prompts_full_pages(ctx, start_server, tmp_path) -> None:
    """pagedkv serve --kv-events-config: a vLLM subscriber sees BlockStored for a prompt's full pages with their
    token ids, chained to the pages before them across requests, and the tenant's salt, never its name or key."""
    endpoint, replay_endpoint = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint,
           "replay_endpoint": replay_endpoint, "topic": TOPIC}
    secret = "f" * 32
    (tmp_path / "fleet.secret").write_text(secret)
    (tmp_path / "tenants.toml").write_text(f'[tenants.acme]\nkeys = ["{hash_key("key-acme")}"]\n')
    server = start_server("--kv-events-config", json.dumps(cfg), "--num-pages", "64", "--tenants-file",
                          str(tmp_path / "tenants.toml"), "--fleet-secret-file", str(tmp_path / "fleet.secret"))
    sub = subscriber(ctx, endpoint)
    wait_connected(sub)
    prompt = [3 + (i * 7) % 250 for i in range(56)]  # 3 full pages of 16 tokens and 8 more

    async def complete(tokens: list[int]) -> None:
        async with Client(server.address, api_key="key-acme") as client:
            await client.complete(tokens, max_tokens=1, ignore_eos=True)

    asyncio.run(complete(prompt[:40]))
    first = stored_until(sub, 2)
    hashes = [h for e in first for h in e.block_hashes]
    assert len(set(hashes)) == 2 and all(-(2**63) <= h < 2**63 for h in hashes)
    assert first[0].parent_block_hash is None and [t for e in first for t in e.token_ids] == prompt[:32]
    assert all(e.block_size == 16 and e.medium == "GPU" for e in first)
    salt = fleet_salt.cache_salt(secret.encode(), "acme")
    assert [k for e in first for k in e.extra_keys] == [(salt,), None]  # on the chain's first page only
    asyncio.run(complete(prompt))  # the same first 2 pages (a hit), then a third
    (third,) = stored_until(sub, 1)
    assert third.parent_block_hash == hashes[-1] and third.token_ids == prompt[32:48]
    assert third.extra_keys == [None]
    # replay from 0: the same batches, the first the Cleared a scheduler starts with
    *batches, end = replay(ctx, replay_endpoint, 0)
    assert end == [b"", kz.END_SEQ, b""]
    decoded = [vllm.decoder().decode(payload) for _, _, payload in batches]
    assert isinstance(decoded[0].events[0], vllm.AllBlocksCleared)
    assert [h for b in decoded for e in b.events if isinstance(e, vllm.BlockStored) for h in e.block_hashes] == \
        [*hashes, *third.block_hashes]
    wire = b"".join(payload for _, _, payload in batches)
    assert b"acme" not in wire and b"key-acme" not in wire and secret.encode() not in wire


def test_full_queue_drops_then_restates_every_page(ctx, monkeypatch) -> None:
    """A publisher thread that falls behind: the batch its full queue cannot take is dropped, and once it has
    caught up one batch clears and restates every page findable; nothing waited on the loop meanwhile."""
    stuck, release = threading.Event(), threading.Event()
    encode = kz.encode_batch

    def slow_encode(batch):
        if batch.seq == 1:  # the thread stops here until released
            stuck.set()
            release.wait()
        return encode(batch)

    monkeypatch.setattr(kz, "encode_batch", slow_encode)
    req = page_request("default", list(range(1, 17)), 4)

    async def main() -> tuple:
        events = KvEventLog(block_size=4)
        pub = kz.start(config(max_queue_size=1), None, LOG)
        task = asyncio.create_task(kz.run(pub, events, LOG))
        try:
            await asyncio.to_thread(sent_at_least, pub, 1)  # batch 0 (the Cleared) is out: the queue is empty
            publish(events, req, range(1))  # batch 1: the thread takes it and stops
            await asyncio.sleep(0)
            await asyncio.to_thread(stuck.wait)
            for j in range(1, 4):  # batch 2 fills the queue, 3 and 4 are dropped
                publish(events, req, range(j, j + 1))
                await asyncio.sleep(0)
            dropped = pub.dropped
            release.set()
            return dropped, events.last_seq, await asyncio.to_thread(replay_all, ctx, pub, events.last_seq)
        finally:
            release.set()
            task.cancel()
            pub.close()

    dropped, last_seq, batches = asyncio.run(main())
    ids = [fleet_salt.hash_id(h) for h in req.page_hashes]
    assert dropped == 1  # (batch 3: after it run() stops reading until the queue has room)
    assert [seq for seq, _ in batches] == [0, 1, 2, last_seq]
    snapshot = batches[-1][1].events
    assert isinstance(snapshot[0], vllm.AllBlocksCleared)
    assert [e.block_hashes[0] for e in snapshot[1:]] == ids[:4]


@pytest.mark.parametrize(("config_text", "names"), [
    ('{"enable_kv_cache_events": true,', "--kv-events-config: not valid JSON"),
    ('{"enable_kv_cache_events": true, "endpont": "tcp://127.0.0.1:5557"}', "unknown key 'endpont'"),
    ('{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557"}',
     "endpoint tcp://*:5557 is reachable beyond this machine"),
])
def test_scheduler_refuses_to_start(config_text, names) -> None:
    """A bad --kv-events-config stops the scheduler at once (before any executor is tried), naming the key."""
    done = subprocess.run([sys.executable, "-m", "pagedkv", "scheduler", "--executor", f"127.0.0.1:{free_port()}",
                           "--connect-timeout", "60", "--kv-events-config", config_text],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode != 0 and names in done.stderr + done.stdout
