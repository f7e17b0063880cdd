"""A vLLM-style subscriber of the KV event publisher's sockets (tests/e2e/test_kv_events_zmq.py): batches to offer,
a publisher's config on free loopback ports, SUB and DEALER sockets that receive live batches and ask for a replay,
requests as KvEventLog describes them, and waits for what the publisher's thread has sent."""

from __future__ import annotations

import hashlib
import json
import time
from types import SimpleNamespace

import structlog
import zmq
from zmq.utils import monitor as zmq_monitor

from pagedkv.cli import free_port
from scheduler_svc import kv_events_config as kc
from scheduler_svc import kv_events_zmq as kz
from scheduler_svc.kv_events import Batch, KvEventLog, Removed, Stored
from tests.support import vllm_kv_events as vllm

TOPIC = "kv@test-host@tiny-llama"
LOG = structlog.get_logger("test_kv_events_zmq")
POLL_MS = 100
PROBES = 100  # a SUB's connection is up within this many offered batches (PUB drops what it sends before)


def batch(seq: int) -> Batch:
    return Batch(seq, 1000.0 + seq, (Stored((seq,), None, (seq, seq + 1), 2, "GPU", ""),
                                     Removed((seq - 1,), "GPU")))


def config(**overrides) -> kc.KvEventsConfig:
    cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{free_port()}",
           "replay_endpoint": f"tcp://127.0.0.1:{free_port()}", **overrides}
    return kc.parse_config(json.dumps(cfg)).with_default_topic("tiny-llama", "test-host")


def local(endpoint: str) -> str:
    """Where a client on this machine reaches a bound ``endpoint`` (a wildcard is every interface)."""
    return endpoint.replace("*", "127.0.0.1").replace("0.0.0.0", "127.0.0.1")


def subscriber(ctx: zmq.Context, endpoint: str, keys: tuple[bytes, bytes, bytes] | None = None) -> zmq.Socket:
    sub = ctx.socket(zmq.SUB)
    if keys is not None:
        sub.curve_publickey, sub.curve_secretkey, sub.curve_serverkey = keys
    sub.setsockopt(zmq.SUBSCRIBE, TOPIC.encode())
    sub.connect(local(endpoint))
    return sub


def first_live(pub: kz.ZmqKvEventPublisher, sub: zmq.Socket) -> int:
    """Offers batches 0, 1, ... until ``sub`` receives one (PUB drops what it sends before a SUB's connection is
    up); returns the next sequence number to offer."""
    for seq in range(PROBES):
        pub.offer(seq, batch(seq))
        if sub.poll(POLL_MS):
            sub.recv_multipart()
            return seq + 1
    raise AssertionError(f"no batch reached the subscriber in {PROBES} tries")


def receive(sub: zmq.Socket) -> tuple[int, vllm.KVEventBatch]:
    assert sub.poll(5000), "nothing received"
    topic, seq, payload = sub.recv_multipart()
    assert topic == TOPIC.encode() and len(seq) == 8
    return int.from_bytes(seq, "big"), vllm.decoder().decode(payload)


def replay(ctx: zmq.Context, endpoint: str, start: int) -> list[list[bytes]]:
    """Asks for batches from ``start`` as vLLM's subscribers do (a DEALER here: a REQ reads one reply only); the
    replies up to and including the end marker."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(local(endpoint))
    try:
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        replies = []
        while True:
            assert dealer.poll(5000), f"replay ended without the end marker after {len(replies)} replies"
            empty, *frames = dealer.recv_multipart()
            assert empty == b""
            replies.append(frames)
            if frames[1] == kz.END_SEQ:
                return replies
    finally:
        dealer.close(linger=0)


def page_request(tenant: str, prompt: list[int], block_size: int) -> SimpleNamespace:
    """What ``KvEventLog.describe`` reads of a request: its tokens, tenant, window, adapter and page hashes."""
    hashes = [hashlib.sha256(bytes(prompt[: (j + 1) * block_size])).digest()
              for j in range(len(prompt) // block_size)]
    return SimpleNamespace(tenant=tenant, prompt_ids=prompt, output_ids=[], sink_tokens=0, window_tokens=0,
                           page_hashes=hashes, adapter="")


def publish(events: KvEventLog, req: SimpleNamespace, pages: range) -> None:
    for j in pages:
        events.describe(req, j)
        events.stored(req.page_hashes[j], "GPU")


def replay_all(ctx: zmq.Context, pub: kz.ZmqKvEventPublisher, last_seq: int) -> list[tuple[int, object]]:
    """Every buffered batch, once the publisher's thread has sent batch ``last_seq``."""
    for _ in range(PROBES):
        *batches, _ = replay(ctx, pub.replay_endpoint, 0)
        if batches and int.from_bytes(batches[-1][1], "big") == last_seq:
            return [(int.from_bytes(seq, "big"), vllm.decoder().decode(payload)) for _, seq, payload in batches]
        time.sleep(POLL_MS / 1000)
    raise AssertionError(f"batch {last_seq} was not published")


def wait_connected(sub: zmq.Socket) -> None:
    """Until ``sub``'s connection is up (a PUB drops what it sends before)."""
    monitor = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    try:
        assert monitor.poll(10_000), "the subscriber never connected"
        assert zmq_monitor.recv_monitor_message(monitor)["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED
    finally:
        sub.disable_monitor()
        monitor.close(linger=0)


def stored_until(sub: zmq.Socket, pages: int) -> list[vllm.BlockStored]:
    """The BlockStored events ``sub`` receives until they hold ``pages`` pages (in sequence order)."""
    stored: list[vllm.BlockStored] = []
    last_seq = None
    while sum(len(e.block_hashes) for e in stored) < pages:
        seq, got = receive(sub)
        assert last_seq is None or seq == last_seq + 1, f"a gap: {last_seq} then {seq}"
        last_seq = seq
        stored += [e for e in got.events if isinstance(e, vllm.BlockStored)]
    return stored


def sent_at_least(pub, n: int, timeout: float = 30.0) -> None:
    """Until the publisher's thread has sent ``n`` batches (on a loaded machine it may lag the loop)."""
    deadline = time.monotonic() + timeout
    while pub.sent < n:
        assert time.monotonic() < deadline, f"the publisher sent {pub.sent} of {n} batches in {timeout} s"
        time.sleep(0.005)
