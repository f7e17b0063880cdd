"""The KV event stream (#47): which pages are findable by hash, as ordered, numbered batches with nothing lost.

Fleet routers (Dynamo's KV router, llm-d's precise-prefix scorer) keep an index of which engine holds which KV
blocks; this is what they are fed. The pools report every change of their hash maps (``PagePool`` calls
``stored``/``removed``/``forgot`` as it publishes, hands a cached free page out again, unpublishes, forgets), and
``KVManager.publish`` describes a page (its tokens, parent, salt) as it first becomes findable. The log keeps the
**union** over every pool of the process, per medium ("GPU": a device tier, "CPU": a host tier): a (hash, medium)
is stored when the first pool holds it findable and removed when the last one drops it, so an executor lost among
several yields Removed for what only it held, and Cleared only when a clear leaves nothing findable.

Events collect until the end of the event loop's current callback (one planning pass, or one step's result), then
go out as one ``Batch``; outside a loop (tests) ``flush`` does it. The first batch of a process is ``Cleared``, so a
consumer drops what a previous incarnation announced. Everything runs on the event loop's thread.

Invariants, checked by tests/unit/scheduler/test_kv_events_stateful.py: applying every batch in order to an empty
set of (hash, medium) gives the union of the pools' findable sets; every Removed matches an earlier Stored.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagedkv.fleet_salt import DEFAULT_TENANT, FLEET_SECRET_ENV, FLEET_SECRET_FLAG, cache_salt, hash_id

if TYPE_CHECKING:
    from scheduler_svc.request import Request

DEVICE_MEDIUM = "GPU"  # (vLLM's names: a device tier is "GPU" whatever the device, a host tier "CPU")
HOST_MEDIUM = "CPU"
MEDIA = (DEVICE_MEDIUM, HOST_MEDIUM)
# NOTE: without a fleet secret only the default tenant is served (the server refuses tenants then): one trust
# domain, so its windowed requests' salts need only differ from the unwindowed namespace, not be unguessable.
_NO_SECRET_KEY = b"pagedkv/kv-events/no-fleet-secret"


@dataclass(frozen=True, slots=True)
class Stored:
    """Pages became findable on ``medium``: consecutive pages of one sequence."""
    hashes: tuple[int, ...]  # hash_id of each page, in sequence order
    parent: int | None  # hash_id of the page before hashes[0] in its sequence (None: the first page)
    token_ids: tuple[int, ...]  # len(hashes) * block_size tokens
    block_size: int
    medium: str
    salt: str  # the router salt of the request's tenant (and window); '' for the default tenant
    lora_name: str = ""  # the LoRA adapter whose KV the pages hold ('': the base model's)
    lora_id: int | None = None  # its number, 1 up in the executors' --lora-modules order (vLLM's lora_int_id)


@dataclass(frozen=True, slots=True)
class Removed:
    hashes: tuple[int, ...]
    medium: str


@dataclass(frozen=True, slots=True)
class Cleared:
    """Nothing is findable any more."""


@dataclass(frozen=True, slots=True)
class Batch:
    seq: int  # 0, 1, 2, ... per scheduler process, no gaps
    ts: float  # time.time() when it was cut
    events: tuple[Stored | Removed | Cleared, ...]


class SubscriberLagged(Exception):
    """A subscriber's next batch left the buffer before it was read: it must start again from a snapshot."""


@dataclass(frozen=True, slots=True)
class _Page:
    """What a Stored event says of one page (a function of its hash, kept while the hash is findable anywhere)."""
    id: int
    parent: int | None
    tokens: tuple[int, ...]
    salt: str
    depth: int  # its index in its sequence (a snapshot lists parents first)
    adapter: str  # the LoRA adapter's ('': the base model's)


_CLEAR = ("C", b"", "")


def missing_secret_problem(multi_tenant: bool, secret: bytes) -> str:
    """Why KV events cannot be salted ('' when they can): tenants without a fleet secret."""
    if multi_tenant and not secret:
        return (f"KV events for several tenants need a fleet secret ({FLEET_SECRET_FLAG} PATH or "
                f"${FLEET_SECRET_ENV}): each tenant's events carry a salt derived from it, the same the edge "
                "gateway sets, so that a router keeps tenants apart and nobody can guess another's salt")
    return ""


class KvEventLog:
    def __init__(self, block_size: int, buffer_batches: int = 10000, salt_secret: bytes = b"",
                 default_window: tuple[int, int] = (0, 0), adapters: tuple[str, ...] = ()) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if buffer_batches < 1:
            raise ValueError(f"buffer_batches must be >= 1, got {buffer_batches}")
        self._bs = block_size
        self._secret = salt_secret
        # NOTE: the (sink, window) every request gets unless it or its tenant asks for another (the server's window,
        # the model's own: fit.attention_window). Its pages take the tenant's plain salt, the one the edge gateway
        # sets: otherwise no request on a model with its own sliding window (Mistral, Gemma 2) would ever match.
        self._default_window = default_window
        self._lora_ids = {name: i + 1 for i, name in enumerate(adapters)}  # (--lora-modules' in order, then others)
        self._salts: dict[tuple[str, tuple[int, int] | None], str] = {}
        self._holders: dict[tuple[bytes, str], int] = {}  # (hash, medium) -> pools holding it findable (>= 1)
        self._pages: dict[bytes, _Page] = {}  # every hash findable somewhere (and, until a flush, some that were)
        self._pending: list[tuple[str, bytes, str]] = []  # ("S"|"R", hash, medium) or _CLEAR, in order
        self._flush_queued = False
        self._buffer: deque[Batch] = deque(maxlen=buffer_batches)
        self._seq = -1
        self._subscriptions: set[Subscription] = set()
        self._pending.append(_CLEAR)  # a consumer drops what an earlier process announced
        self.flush()

    # ---- reads -------------------------------------------------------------------------------------------
    @property
    def block_size(self) -> int:
        return self._bs

    @property
    def last_seq(self) -> int:
        """The newest batch's number (-1 before the first)."""
        return self._seq

    def findable(self) -> set[tuple[int, str]]:
        """(hash_id, medium) of every page findable now in some pool (events not flushed yet included)."""
        return {(hash_id(h), medium) for h, medium in self._holders}

    # ---- what the pools and the KV manager report -------------------------------------------------------------
    def salt(self, tenant: str, window: tuple[int, int] | None) -> str:
        """The router salt of a tenant's (windowed: (sink, window) tokens) pages."""
        key = (tenant, window)
        salt = self._salts.get(key)
        if salt is None:
            secret = self._secret or (_NO_SECRET_KEY if tenant == DEFAULT_TENANT else b"")
            salt = self._salts[key] = cache_salt(secret, tenant, window)
        return salt

    def describe(self, req: Request, j: int) -> None:
        """Page ``j`` of ``req`` (its hash ``req.page_hashes[j]``) became findable: what its Stored event says."""
        h = req.page_hashes[j]
        if h in self._pages:
            return
        bs, prompt = self._bs, req.prompt_ids
        lo, hi = j * bs, (j + 1) * bs
        if hi <= len(prompt):
            tokens = prompt[lo:hi]
        else:
            tokens = prompt[lo:] + req.output_ids[max(0, lo - len(prompt)):hi - len(prompt)]
        window = (req.sink_tokens, req.window_tokens)
        window = window if req.window_tokens and window != self._default_window else None
        self._pages[h] = _Page(hash_id(h), hash_id(req.page_hashes[j - 1]) if j else None, tuple(tokens),
                               self.salt(req.tenant, window), j, req.adapter)

    def stored(self, page_hash: bytes, medium: str) -> None:
        """A pool made ``page_hash`` findable."""
        key = (page_hash, medium)
        held = self._holders.get(key, 0)
        self._holders[key] = held + 1
        if not held:
            self._note(("S", page_hash, medium))

    def removed(self, page_hash: bytes, medium: str) -> None:
        """A pool no longer finds ``page_hash``."""
        key = (page_hash, medium)
        held = self._holders[key]
        if held == 1:
            del self._holders[key]
            self._note(("R", page_hash, medium))
        else:
            self._holders[key] = held - 1

    def forgot(self, hashes: list[bytes], medium: str) -> None:
        """A pool forgot every hash it held (its executor is gone or restarted)."""
        gone = []
        for h in hashes:
            key = (h, medium)
            held = self._holders[key]
            if held == 1:
                del self._holders[key]
                gone.append(h)
            else:
                self._holders[key] = held - 1
        if gone and not self._holders:
            self._note(_CLEAR)
        else:
            for h in gone:
                self._note(("R", h, medium))

    def _note(self, record: tuple[str, bytes, str]) -> None:
        if not self._pending and not self._flush_queued:
            try:
                asyncio.get_running_loop().call_soon(self.flush)
                self._flush_queued = True
            except RuntimeError:  # no loop (tests): flush() by hand
                pass
        self._pending.append(record)

    # ---- batches -----------------------------------------------------------------------------------------
    def flush(self) -> Batch | None:
        """Cuts the events noted since the last batch into the next batch (None: there were none)."""
        self._flush_queued = False
        if not self._pending:
            return None
        pending, self._pending = self._pending, []
        events = self._events(pending)
        holders = self._holders
        if any(kind == "C" for kind, _, _ in pending):  # descriptions of hashes findable nowhere now go
            self._pages = {h: p for h, p in self._pages.items() if (h, DEVICE_MEDIUM) in holders
                           or (h, HOST_MEDIUM) in holders}
        for kind, h, _ in pending:
            if kind == "R" and (h, DEVICE_MEDIUM) not in holders and (h, HOST_MEDIUM) not in holders:
                self._pages.pop(h, None)
        self._seq += 1
        batch = Batch(self._seq, time.time(), tuple(events))
        self._buffer.append(batch)
        for sub in self._subscriptions:
            sub.notify()
        return batch

    def _events(self, pending: list[tuple[str, bytes, str]]) -> list[Stored | Removed | Cleared]:
        """Records -> events: a run of removals on one medium is one Removed, a run of stores that continue each
        other's sequence (same medium and salt; so the same adapter too: its pages chain from a root of their own)
        one Stored."""
        events: list[Stored | Removed | Cleared] = []
        ids: list[int] = []  # the hashes of the run being built (the event goes in once the run ends)
        tokens: list[int] = []
        run: tuple[str, str, str, int | None, str] | None = None  # (kind, medium, salt, parent, adapter) of that run

        def end_run() -> None:
            if run is not None:
                kind, medium, salt, parent, adapter = run
                events.append(Removed(tuple(ids), medium) if kind == "R" else
                              self._stored(tuple(ids), parent, tuple(tokens), medium, salt, adapter))
                ids.clear()
                tokens.clear()

        for kind, h, medium in pending:
            if kind == "C":
                end_run()
                run = None
                events.append(Cleared())
            elif kind == "R":
                if run is None or run[:2] != ("R", medium):
                    end_run()
                    run = ("R", medium, "", None, "")
                ids.append(hash_id(h))
            else:
                page = self._pages[h]
                if run is None or run[:3] != ("S", medium, page.salt) or page.parent != ids[-1]:
                    end_run()
                    run = ("S", medium, page.salt, page.parent, page.adapter)
                ids.append(page.id)
                tokens.extend(page.tokens)
        end_run()
        return events

    def snapshot(self) -> tuple[int, list[Stored]]:
        """(last_seq, a Stored event for each page findable now, on each medium it is findable on; parents before
        their children). Events noted so far are flushed first, so the state is exactly the one after last_seq."""
        self.flush()
        keys = sorted(self._holders, key=lambda k: self._pages[k[0]].depth)
        out = []
        for h, medium in keys:
            p = self._pages[h]
            out.append(self._stored((p.id,), p.parent, p.tokens, medium, p.salt, p.adapter))
        return self._seq, out

    def _stored(self, ids: tuple[int, ...], parent: int | None, tokens: tuple[int, ...], medium: str, salt: str,
                adapter: str) -> Stored:
        lora_id = None
        if adapter:  # (a run-time adapter gets the next number the first time its pages are published)
            lora_id = self._lora_ids.setdefault(adapter, len(self._lora_ids) + 1)
        return Stored(ids, parent, tokens, self._bs, medium, salt, adapter, lora_id)

    def replay(self, from_seq: int) -> list[Batch] | None:
        """The buffered batches numbered from_seq on (empty: from_seq is the next one); None when one of them is no
        longer buffered, or from_seq is not of this process (past the next)."""
        first = self._buffer[0].seq if self._buffer else self._seq + 1
        if not first <= from_seq <= self._seq + 1:
            return None
        return list(self._buffer)[from_seq - first:]

    def batch_at(self, seq: int) -> Batch | None:
        """Batch ``seq`` (None: not cut yet); SubscriberLagged when it has left the buffer."""
        if seq > self._seq:
            return None
        first = self._buffer[0].seq
        if seq < first:
            raise SubscriberLagged(f"fell more than {self._buffer.maxlen} batches behind the KV event stream (its "
                                   f"next batch {seq} is gone; the oldest kept is {first}): reconnect for a "
                                   "snapshot")
        return self._buffer[seq - first]

    def subscribe(self) -> Subscription:
        """The batches from the next one on, as an async iterator (close it when done)."""
        sub = Subscription(self, self._seq + 1)
        self._subscriptions.add(sub)
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        self._subscriptions.discard(sub)


class Subscription:
    """An async iterator of batches, from a given number on, with no gap: it ends with SubscriberLagged when the
    log dropped its next batch before it was read (never skips one)."""

    def __init__(self, log: KvEventLog, next_seq: int) -> None:
        self._log = log
        self._next = next_seq
        self._ready = asyncio.Event()
        self._closed = False

    def __aiter__(self) -> Subscription:
        return self

    async def __anext__(self) -> Batch:
        while not self._closed:
            batch = self._log.batch_at(self._next)
            if batch is not None:
                self._next += 1
                return batch
            self._ready.clear()
            await self._ready.wait()
        raise StopAsyncIteration

    def notify(self) -> None:
        """A batch was cut."""
        self._ready.set()

    def close(self) -> None:
        self._closed = True
        self._log.unsubscribe(self)
        self._ready.set()
