"""``pagedkv.kvevents.v1.KvEvents``: the scheduler's KV event stream (kv_events.py) over its gRPC port, for the
Dynamo sidecar (pagedkv/dynamo_kv_relay.py), which relays it to Dynamo's KV router.

``Watch`` resumes where a watcher left off while the batches it missed are still buffered; otherwise it starts with
a snapshot: one batch (``snapshot``) of Cleared and a Stored for every page findable, numbered as the last batch it
stands for, then the live batches. A watcher that falls more than the buffer behind ends with RESOURCE_EXHAUSTED.

The stream carries every tenant's prompt tokens: only an internal caller may watch it. That is a call with the
executor secret (``authorization: Bearer <secret>``) or the trusted-hop secret (``x-pagedkv-hop``), or an API key of
an admin tenant (on a server without a tenants file every caller is the one trust domain's, as for ModelInfo's
cluster view). Anyone else gets UNAUTHENTICATED (no or a bad credential) or PERMISSION_DENIED (a tenant's key).
"""

from __future__ import annotations

import hmac
import time
from collections.abc import Callable

import grpc

from pagedkv import security
from pagedkv.kvevents.v1 import kv_events_pb2 as kv
from pagedkv.kvevents.v1 import kv_events_pb2_grpc as kv_grpc
from pagedkv.tenancy import Tenants, Unauthenticated
from pagedkv.trusted_hop import HOP_HEADER, HOP_SECRET_FLAG
from scheduler_svc.kv_events import Batch, Cleared, KvEventLog, Removed, Stored, SubscriberLagged

SERVICE = kv.DESCRIPTOR.services_by_name["KvEvents"].full_name
WATCH = f"/{SERVICE}/Watch"


def encode(batch: Batch, block_size: int, snapshot: bool = False) -> kv.EventBatch:
    out = kv.EventBatch(seq=batch.seq, ts=batch.ts, snapshot=snapshot, block_size=block_size)
    for ev in batch.events:
        if isinstance(ev, Stored):
            out.events.add().stored.CopyFrom(kv.Stored(
                hashes=ev.hashes, parent=ev.parent or 0, has_parent=ev.parent is not None, token_ids=ev.token_ids,
                medium=ev.medium, salt=ev.salt, lora_name=ev.lora_name))
        elif isinstance(ev, Removed):
            out.events.add().removed.CopyFrom(kv.Removed(hashes=ev.hashes, medium=ev.medium))
        else:
            out.events.add().cleared.SetInParent()
    return out


class InternalCallers:
    """Who may watch: the bearer of the executor secret, the trusted hop, an admin tenant (see the module)."""

    def __init__(self, tenants: Callable[[], Tenants], executor_secret: str = "", hop_secret: str = "") -> None:
        self._tenants = tenants  # (read at every call: the tenants file may be reloaded)
        self._secrets: list[tuple[str, bytes]] = []  # (metadata key, the value that lets a call in)
        if executor_secret:
            self._secrets.append(("authorization", f"Bearer {executor_secret}".encode()))
        if hop_secret:
            self._secrets.append((HOP_HEADER, hop_secret.encode()))

    def refusal(self, metadata) -> tuple[grpc.StatusCode, str] | None:
        """None when the call may watch, else (status, why)."""
        for key, expected in self._secrets:
            sent = [v for k, v in metadata or () if k == key and isinstance(v, str)]
            if len(sent) == 1 and hmac.compare_digest(sent[0].encode("utf-8", "surrogateescape"), expected):
                return None
        who = (f"the executor secret ('authorization: Bearer <secret>', the scheduler's {security.SECRET_FILE_FLAG}), "
               f"the trusted-hop secret ({HOP_HEADER}, its {HOP_SECRET_FLAG}) or an admin tenant's API key")
        tenants = self._tenants()
        try:
            tenant = tenants.authenticate(metadata)
        except Unauthenticated as err:
            return grpc.StatusCode.UNAUTHENTICATED, f"KvEvents.Watch: {err}; the stream is for {who}"
        if tenants.sees_cluster(tenant):
            return None
        return (grpc.StatusCode.PERMISSION_DENIED, f"KvEvents.Watch carries every tenant's prompt tokens: tenant "
                f"{tenant.id} is not an admin (admin = true in the tenants file); watch with {who}")


class KvEventsService(kv_grpc.KvEventsServicer):
    def __init__(self, events: KvEventLog, callers: InternalCallers, log) -> None:
        self._events = events
        self._callers = callers
        self._log = log

    async def Watch(self, request: kv.WatchRequest, context):  # noqa: N802
        refused = self._callers.refusal(context.invocation_metadata())
        if refused is not None:
            self._log.warning("kv_events_watch_refused", peer=context.peer(), code=refused[0].name)
            await context.abort(*refused)
        events, bs = self._events, self._events.block_size
        # NOTE: no await from the backlog to the subscription: no batch is cut between them.
        backlog = events.replay(request.from_seq) if request.has_from_seq else None
        if backlog is None:
            seq, stored = events.snapshot()
            first = [encode(Batch(seq, time.time(), (Cleared(), *stored)), bs, snapshot=True)]
        else:
            first = [encode(b, bs) for b in backlog]
        subscription = events.subscribe()
        self._log.info("kv_events_watch", peer=context.peer(), from_seq=request.from_seq if backlog is not None
                       else None, snapshot=backlog is None, replayed=len(first) if backlog is not None else 0)
        try:
            for message in first:
                yield message
            async for batch in subscription:
                yield encode(batch, bs)
        except SubscriberLagged as err:
            self._log.warning("kv_events_watcher_behind", peer=context.peer(), error=str(err))
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"KvEvents.Watch: {err}")
        finally:
            subscription.close()


def add_kv_events(server: grpc.aio.Server, events: KvEventLog, callers: InternalCallers, log) -> str:
    """Serves ``events`` on ``server``; returns the service's name (for health and reflection)."""
    kv_grpc.add_KvEventsServicer_to_server(KvEventsService(events, callers, log), server)
    return SERVICE
