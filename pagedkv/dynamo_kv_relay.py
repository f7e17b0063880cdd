"""The scheduler's KV events (its internal ``KvEvents/Watch`` stream) relayed into Dynamo's ``KvEventPublisher``.

The scheduler's stream is the union over its pools, per medium (GPU: device pages, CPU: host-tier pages): a
(hash, medium) is stored when the first pool holds it findable and removed when the last drops it. Dynamo's direct
publisher API knows no media and no "cleared", so ``KvRelay`` keeps what it told the router (hash -> media) and
says, per hash: stored when it becomes findable on any medium, removed when it is findable on none. A Cleared is a
removal of every hash it announced. A snapshot batch (the stream's first, on every (re)connect) replaces the whole
view: hashes the scheduler no longer holds are removed, new ones stored, so the router ends up with exactly the
scheduler's findable pages, whether the scheduler restarted meanwhile or not.

Each Stored carries its tenant's salt (``cache_salt``: Dynamo's router namespace, the one the edge gateway sets as
``nvext.cache_salt``), the page tokens and the parent page's id, as Dynamo's router wants them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from pagedkv.kvevents.v1 import kv_events_pb2 as kv
from pagedkv.kvevents.v1 import kv_events_pb2_grpc as kv_grpc


@dataclass(frozen=True, slots=True)
class StoredPages:
    hashes: tuple[int, ...]
    parent: int | None
    token_ids: tuple[int, ...]
    medium: str
    salt: str
    lora_name: str = ""  # the adapter whose KV they hold ("": the base model's); Dynamo hashes blocks with it


@dataclass(frozen=True, slots=True)
class RemovedPages:
    hashes: tuple[int, ...]
    medium: str


@dataclass(frozen=True, slots=True)
class AllCleared:
    pass


Event = StoredPages | RemovedPages | AllCleared


class KvRelay:
    """What this worker told Dynamo's router, and the calls on ``publisher`` that keep it equal to the
    scheduler's findable pages. Runs on one thread (the worker's event loop)."""

    def __init__(self, publisher: Any, block_size: int, log: Any) -> None:
        self.publisher = publisher
        self.block_size = block_size
        self.log = log
        self.held: dict[int, set[str]] = {}  # page id -> media it is findable on
        self.seq: int | None = None  # the last batch applied

    def apply_batch(self, seq: int, events: Sequence[Event], snapshot: bool, block_size: int = 0) -> None:
        if block_size:
            self.block_size = block_size
        if snapshot:
            self._resync(events)
        else:
            if self.seq is not None and seq != self.seq + 1:
                self.log.warning("kv_events_gap", expected=self.seq + 1, got=seq)
            for event in events:
                self.apply(event)
        self.seq = seq

    def apply(self, event: Event) -> None:
        if isinstance(event, StoredPages):
            self._stored(event)
        elif isinstance(event, RemovedPages):
            self._removed(event.hashes, event.medium)
        else:
            self._clear()

    def _stored(self, ev: StoredPages) -> None:
        """Store the pages not yet announced, as runs of consecutive new pages (a run's parent: the page before
        it in the event, or the event's parent)."""
        n = len(ev.hashes)
        if not n:
            return
        size = len(ev.token_ids) // n if len(ev.token_ids) % n == 0 else self.block_size
        run: list[int] = []  # indices of the current run of new pages

        def flush() -> None:
            if not run:
                return
            first, last = run[0], run[-1]
            parent = ev.hashes[first - 1] if first else ev.parent
            self.publisher.publish_stored(
                token_ids=list(ev.token_ids[first * size:(last + 1) * size]), num_block_tokens=[size] * len(run),
                block_hashes=[ev.hashes[i] for i in run], parent_hash=parent, cache_salt=ev.salt or None,
                lora_name=ev.lora_name or None)
            run.clear()

        for i, page in enumerate(ev.hashes):
            media = self.held.setdefault(page, set())
            if not media:
                run.append(i)
            else:
                flush()
            media.add(ev.medium)
        flush()

    def _removed(self, hashes: Iterable[int], medium: str) -> None:
        gone = []
        for page in hashes:
            media = self.held.get(page)
            if media is None:
                continue
            media.discard(medium)
            if not media:
                del self.held[page]
                gone.append(page)
        if gone:
            self.publisher.publish_removed(gone)

    def _clear(self) -> None:
        if self.held:
            self.publisher.publish_removed(list(self.held))
            self.held.clear()

    def _resync(self, events: Sequence[Event]) -> None:
        stored = [e for e in events if isinstance(e, StoredPages)]
        target: dict[int, set[str]] = {}
        for ev in stored:
            for page in ev.hashes:
                target.setdefault(page, set()).add(ev.medium)
        gone = [page for page in self.held if page not in target]
        for page in gone:
            del self.held[page]
        if gone:
            self.publisher.publish_removed(gone)
        for page, media in self.held.items():
            media.intersection_update(target[page])
        for ev in stored:
            self._stored(ev)
        self.log.info("kv_events_snapshot", pages=len(self.held), removed=len(gone))


# ---- the scheduler's Watch stream --------------------------------------------------------------------------------
def events_of(batch: Any) -> list[Event]:
    """A ``pagedkv.kvevents.v1.EventBatch``'s events as the relay's."""
    out: list[Event] = []
    for ev in batch.events:
        kind = ev.WhichOneof("event")
        if kind == "stored":
            s = ev.stored
            out.append(StoredPages(tuple(s.hashes), s.parent if s.has_parent else None, tuple(s.token_ids),
                                   s.medium, s.salt, s.lora_name))
        elif kind == "removed":
            out.append(RemovedPages(tuple(ev.removed.hashes), ev.removed.medium))
        elif kind == "cleared":
            out.append(AllCleared())
    return out


async def watch_events(channel: grpc.aio.Channel, metadata: Sequence[tuple[str, str]], relay: KvRelay,
                       log: Any, backoff_s: float = 0.5, max_backoff_s: float = 5.0) -> None:
    """Relays the scheduler's Watch stream until cancelled: reconnects after a break (from a snapshot), with a
    backoff while the scheduler is away."""
    stub = kv_grpc.KvEventsStub(channel)
    delay = backoff_s
    while True:
        # NOTE: every (re)connect starts from a snapshot, never from relay.seq + 1: batch numbers are per scheduler
        # process and carry no epoch, so after a restart the new process's batch seq + 1 (its seq having passed the
        # old one's) would be replayed without its first batches (its Cleared among them), and the router would keep
        # the dead process's pages. The snapshot is diffed against what the router was told (KvRelay._resync), so
        # the router sees only what changed.
        request = kv.WatchRequest(has_from_seq=False)
        try:
            async for batch in stub.Watch(request, metadata=metadata):
                relay.apply_batch(batch.seq, events_of(batch), batch.snapshot, batch.block_size)
                delay = backoff_s
        except grpc.aio.AioRpcError as err:
            if err.code() == grpc.StatusCode.UNIMPLEMENTED:
                log.error("kv_events_unavailable", details=err.details(), hint="start the scheduler (or pagedkv "
                          "serve) with --kv-events-rpc; until then Dynamo's router has no KV events from it")
                return
            if err.code() in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED):
                log.error("kv_events_refused", code=err.code().name, details=err.details(),
                          hint="the worker's --trusted-hop-secret-file or an admin --api-key must be the scheduler's")
                return
            log.info("kv_events_reconnect", code=err.code().name, details=err.details(), after_s=delay)
        await asyncio.sleep(delay)
        delay = min(max_backoff_s, delay * 2)
