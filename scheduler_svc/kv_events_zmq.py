"""The scheduler's KV events on ZMQ in vLLM's wire format, so llm-d's precise-prefix scorer and Dynamo's ZMQ relay
read them unchanged (``--kv-events-config``, with vLLM's own keys).

Wire format: vLLM v0.26.0's ``ZmqEventPublisher`` (``vllm/distributed/kv_events.py``), i.e. after vLLM PR #42892
(each event a msgpack *map* tagged by a ``"type"`` key; the batch stays a positional array) and PR #45177 (replay
replies carry the topic frame). Every message on the PUB socket is three frames::

    topic | seq (8 bytes, big-endian) | msgpack [ts, [event, ...], data_parallel_rank]

    {"type": "BlockStored", "block_hashes": [h, ...], "parent_block_hash": p | None, "token_ids": [...],
     "block_size": n, "lora_id": id | None, "medium": "GPU" | "CPU", "lora_name": name | None,
     "extra_keys": [(salt,) | None, ...]}
    {"type": "BlockRemoved", "block_hashes": [h, ...], "medium": "GPU" | "CPU"}
    {"type": "AllBlocksCleared"}

Fields appear in vLLM's declaration order; those at their default (``None``: ``group_idx`` and the cache-spec
fields, which describe vLLM's hybrid KV groups; pagedkv has one) are left out, as msgspec's ``omit_defaults`` does.
``extra_keys`` has one entry per block, as vLLM's: the tenant's cache salt on the first page of a chain (an event
with no parent), ``None`` on the others, since the chain carries it (vLLM puts ``cache_salt`` on block 0 only).
A LoRA adapter's pages carry its name and number (``lora_name``, ``lora_id``: 1 up in the executors'
``--lora-modules`` order, as vLLM numbers them); the base model's ``None``. Block hashes are pagedkv's SHA-256 chain
cut to a signed 64 bits (``pagedkv.fleet_salt.hash_id``). The sequence number is the scheduler's event-log sequence
(``KvEventLog``: one batch per step, 0, 1, 2, ... with no gaps).

Replay: a ROUTER socket on ``replay_endpoint``. A request ``[start seq, 8 bytes big-endian]`` (from a REQ or
DEALER) is answered with each buffered batch from there, ``[topic, seq, payload]``, then the end marker
``[b"", seq -1 (8 bytes, signed), b""]``. The buffer keeps the last ``buffer_steps`` batches.

The stream carries every tenant's prompt tokens: it is an internal link. A tcp endpoint beyond loopback (``*``
included) needs CURVE keys (``--kv-events-curve-secret-key-file``, ``--kv-events-curve-clients``); the events name
no tenant and no key, only salts.

Publishing runs in a thread of its own that owns the sockets; the event loop only hands it batches. It never
blocks a step: PUB drops at ``hwm`` for a slow subscriber (ZMQ's rule; the replay buffer fills the gap), and a
full hand-off queue (``max_queue_size``) drops the batch with a warning; once there is room again, one batch
(numbered as the last one it stands for) clears and restates every page findable.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import msgpack
import zmq
from zmq.auth.thread import ThreadAuthenticator

from scheduler_svc.kv_events import (
    Batch,
    Cleared,
    KvEventLog,
    Removed,
    Stored,
    SubscriberLagged,
    Subscription,
)
from scheduler_svc.kv_events_config import CONFIG_FLAG, CurveKeys, KvEventsConfig, binds, check_link

END_SEQ = (-1).to_bytes(8, "big", signed=True)  # vLLM's end-of-replay marker
DATA_PARALLEL_RANK = 0  # one scheduler is one rank to a fleet router
MEDIUMS = ("GPU", "CPU")
ROOM_POLL_S = 0.05
CLOSE_LINGER_MS = 500  # what is still queued gets this long to leave at shutdown


# ---- encoding -------------------------------------------------------------------------------------------------
def _stored(event: Stored) -> dict:
    if event.medium not in MEDIUMS:
        raise ValueError(f"Stored.medium must be one of {MEDIUMS}, got {event.medium!r}")
    hashes = list(event.hashes)
    extra: list[tuple[str] | None] = [None] * len(hashes)
    if event.salt and event.parent is None and hashes:
        extra[0] = (event.salt,)  # the first page of a chain carries the salt (vLLM: cache_salt on block 0)
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": event.parent,
            "token_ids": list(event.token_ids), "block_size": event.block_size, "lora_id": event.lora_id,
            "medium": event.medium, "lora_name": event.lora_name or None, "extra_keys": extra}


def _removed(event: Removed) -> dict:
    return {"type": "BlockRemoved", "block_hashes": list(event.hashes), "medium": event.medium}


def _cleared(event: Cleared) -> dict:
    return {"type": "AllBlocksCleared"}


_ENCODERS: dict[type, Callable[[Any], dict]] = {Stored: _stored, Removed: _removed, Cleared: _cleared}


def encode_batch(batch: Batch) -> bytes:
    """One ``KvEventLog`` batch as vLLM's msgpack ``[ts, [events], data_parallel_rank]``."""
    events = []
    for event in batch.events:
        encoder = _ENCODERS.get(type(event))
        if encoder is None:
            raise TypeError(f"not a KV event: {type(event).__name__}")
        events.append(encoder(event))
    return msgpack.packb([float(batch.ts), events, DATA_PARALLEL_RANK], use_bin_type=True)


# ---- the publisher --------------------------------------------------------------------------------------------
class ZmqKvEventPublisher:
    """PUB (and ROUTER for replay) sockets owned by one thread, fed batches by the event loop with ``offer``."""

    def __init__(self, config: KvEventsConfig, keys: CurveKeys | None, log) -> None:
        check_link(config, keys)
        if config.topic is None:
            raise ValueError("the KV events' topic is not resolved: call with_default_topic first")
        self.config, self._log = config, log
        self._topic = config.topic.encode("utf-8")
        self._queue: queue.Queue = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self.dropped = 0  # batches the hand-off queue had no room for
        self.sent = 0
        self._ctx = zmq.Context()
        self._auth: ThreadAuthenticator | None = None
        self._pub = self._replay = None
        try:
            if keys is not None:
                self._auth = ThreadAuthenticator(self._ctx)
                self._auth.start()
                self._auth.configure_curve(domain="*", location=keys.clients_dir)
            self._pub = self._socket(zmq.PUB, keys)
            self._pub.set_hwm(config.hwm)
            self.endpoint = self._attach(self._pub, config.endpoint, "endpoint")
            self.replay_endpoint = None
            if config.replay_endpoint is not None:
                self._replay = self._socket(zmq.ROUTER, keys)
                self.replay_endpoint = self._attach(self._replay, config.replay_endpoint, "replay_endpoint",
                                                    bind=True)
        except BaseException:
            self._close_sockets(linger=0)
            raise
        self._thread = threading.Thread(target=self._run, name="kv-events-zmq", daemon=True)
        self._thread.start()
        log.info("kv_events_publishing", endpoint=self.endpoint, replay_endpoint=self.replay_endpoint,
                 topic=config.topic, curve=keys is not None, buffer_steps=config.buffer_steps, hwm=config.hwm)

    def _socket(self, kind: int, keys: CurveKeys | None) -> zmq.Socket:
        sock = self._ctx.socket(kind)
        if keys is not None:
            sock.curve_secretkey = keys.secret
            sock.curve_publickey = keys.public
            sock.curve_server = True
        return sock

    def _attach(self, sock: zmq.Socket, endpoint: str, key: str, bind: bool | None = None) -> str:
        try:
            if bind if bind is not None else binds(endpoint):
                sock.bind(endpoint)
                return sock.getsockopt_string(zmq.LAST_ENDPOINT)
            sock.connect(endpoint)
            return endpoint
        except zmq.ZMQError as err:
            raise ValueError(f"{CONFIG_FLAG}: {key} {endpoint}: {err}") from None

    # -- the event loop's side --
    def offer(self, seq: int, batch: Batch) -> bool:
        """Hand one batch to the thread; never waits. False: the queue was full and the batch is dropped."""
        try:
            self._queue.put_nowait((seq, batch))
            return True
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 1000 == 0:
                self._log.warning("kv_events_queue_full", dropped=self.dropped, seq=seq,
                                  max_queue_size=self.config.max_queue_size,
                                  hint="the publisher thread falls behind the scheduler: once it catches up, one "
                                  "batch restates every page")
            return False

    async def until_room(self) -> None:
        """Until the hand-off queue is at most half full (without holding the loop)."""
        while self._queue.qsize() > self.config.max_queue_size // 2:
            await asyncio.sleep(ROOM_POLL_S)

    def close(self) -> None:
        """Publish what is queued (up to a short linger), then close the sockets."""
        if self._thread.is_alive():
            while True:
                try:
                    self._queue.put_nowait(None)
                    break
                except queue.Full:
                    self._queue.get_nowait()
            self._thread.join(timeout=5.0)
        self._close_sockets(linger=CLOSE_LINGER_MS)
        self._log.info("kv_events_closed", sent=self.sent, dropped=self.dropped)

    def _close_sockets(self, linger: int) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=linger)
        if self._auth is not None:
            self._auth.stop()
        self._ctx.term()

    # -- the thread's side --
    def _run(self) -> None:
        while True:
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay()
            try:
                item = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if item is None:
                return
            seq, batch = item
            try:
                payload = encode_batch(batch)
            except (TypeError, ValueError) as err:  # a bug upstream: say so, keep publishing
                self._log.error("kv_events_unencodable", seq=seq, error=str(err))
                continue
            self._buffer.append((seq, payload))
            try:
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)
                self.sent += 1
            except zmq.Again:  # (a connected PUB with no peer yet: it is in the replay buffer)
                pass

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            self._log.warning("kv_events_bad_replay_request", frames=len(frames),
                              hint="send the start sequence number as 8 bytes, big-endian (REQ or DEALER)")
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in self._buffer:
            if seq >= start_seq:
                self._replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))


def start(config: KvEventsConfig, keys: CurveKeys | None, log) -> ZmqKvEventPublisher | None:
    """The publisher ``config`` asks for (None when events are off or the publisher is "null")."""
    if not config.enabled:
        return None
    return ZmqKvEventPublisher(config, keys, log)


async def run(publisher: ZmqKvEventPublisher, events: KvEventLog, log) -> None:
    """Publish every batch of ``events``, from its first (the Cleared a process starts with), until cancelled. When
    a batch is lost (the publisher's queue was full, or this task fell out of the log's buffer), publishing starts
    again, once there is room, from a snapshot: one batch that clears and restates every page findable."""
    subscription = _catch_up(publisher, events, 0)
    try:
        while True:
            try:
                async for batch in subscription:
                    if not publisher.offer(batch.seq, batch):
                        raise _Dropped(f"batch {batch.seq} found the publisher's queue full")
                return
            except (SubscriberLagged, _Dropped) as err:
                subscription.close()
                await publisher.until_room()
                subscription = _catch_up(publisher, events, None)
                log.warning("kv_events_resynced", seq=events.last_seq, error=str(err),
                            hint="subscribers see a gap, then a batch that clears and restates every page")
    finally:
        subscription.close()


class _Dropped(Exception):
    pass


class Publishing:
    """A publisher and the task that feeds it the scheduler's KvEventLog."""

    def __init__(self, publisher: ZmqKvEventPublisher, events: KvEventLog, log) -> None:
        self.publisher = publisher
        self._task = asyncio.get_running_loop().create_task(run(publisher, events, log))

    async def stop(self) -> None:
        """The events noted so far published, then the task and the sockets closed."""
        await asyncio.sleep(0)  # (the batch the last callback noted is cut in the next one)
        await asyncio.sleep(0)
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        await asyncio.to_thread(self.publisher.close)  # (its thread sends what is queued: not on the loop)


def start_publishing(config: KvEventsConfig, keys: CurveKeys | None, events: KvEventLog, log) -> Publishing:
    """Bind (or connect) the sockets now and publish ``events`` from the event loop's next turn on."""
    return Publishing(ZmqKvEventPublisher(config, keys, log), events, log)


def _catch_up(publisher: ZmqKvEventPublisher, events: KvEventLog, from_seq: int | None) -> Subscription:
    """Offers the log's batches from ``from_seq`` on, or (None, or no longer buffered) a snapshot as one batch
    [AllBlocksCleared, BlockStored, ...] numbered as the last batch it stands for; then subscribes after them."""
    backlog = None if from_seq is None else events.replay(from_seq)
    if backlog is None:
        seq, stored = events.snapshot()  # (flushes first: exactly the state after batch seq)
        publisher.offer(seq, Batch(seq, time.time(), (Cleared(), *stored)))
    else:
        for batch in backlog:
            publisher.offer(batch.seq, batch)
    return events.subscribe()  # (from the next batch: nothing was cut in between, there was no await)


__all__ = ["END_SEQ", "Publishing", "ZmqKvEventPublisher", "encode_batch", "run", "start", "start_publishing"]
