"""The public side of retained KV (retention.py): GenerateRequest.retain_kv checked, and the ReleaseKv rpc.

A retention lives on the executor whose planner ran the request (a follow-up is placed where its prefix is cached).
ReleaseKv ends the caller's tenant's retention of a key on every executor; another tenant's key, or one that expired,
was pressed out or was never kept, is NOT_FOUND (the same answer: nothing tells one tenant what another keeps).
"""

from __future__ import annotations

from collections.abc import Mapping

import grpc

from pagedkv.api.v1 import api_pb2 as api
from pagedkv.bounds import InvalidRequest
from scheduler_svc.engine import Engine
from scheduler_svc.request import Retain
from scheduler_svc.retention import MAX_KEY_BYTES

METHOD = "/pagedkv.api.v1.Generation/ReleaseKv"


def check_key(key: str, field: str) -> None:
    size = len(key.encode("utf-8"))
    if not 1 <= size <= MAX_KEY_BYTES:
        raise InvalidRequest(f"{field}: {size} bytes; a key is 1..{MAX_KEY_BYTES} bytes (UTF-8)")


def check_retain_kv(request: api.GenerateRequest, max_ttl_s: int) -> Retain | None:
    """The request's retain_kv, checked (None: unset). ``max_ttl_s``: the scheduler's --kv-retention-max-ttl."""
    if not request.HasField("retain_kv"):
        return None
    spec = request.retain_kv
    check_key(spec.key, "retain_kv.key")
    if not 1 <= spec.ttl_s <= max_ttl_s:
        raise InvalidRequest(f"retain_kv.ttl_s: {spec.ttl_s}; must be in [1, {max_ttl_s}] seconds (the scheduler's "
                             f"--kv-retention-max-ttl)")
    return Retain(spec.key, spec.ttl_s)


def release_kv(engines: Mapping[str, Engine], tenant_id: str, key: str) -> int | None:
    """Ends the tenant's retention of ``key`` on every executor (each zeroes the pages with its next plan); returns
    the pages that went back to the free pools (None: no executor held it)."""
    released = None
    for engine in engines.values():
        scheduler = engine.scheduler
        n = scheduler.retained.end(tenant_id, key) if scheduler is not None else None
        if n is not None:
            released = (released or 0) + n
            engine.wake_up()  # (the plan that zeroes them)
    return released


class ReleaseKvRpc:
    """GenerationService's ReleaseKv (a base of it: api.py stays within its size). Uses its ``cluster`` and
    ``_tenant``."""

    async def ReleaseKv(self, request, context):  # noqa: N802
        tenant = await self._tenant(context, METHOD)
        try:
            check_key(request.key, "key")
        except InvalidRequest as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        released = release_kv(self.cluster.engines, tenant.id, request.key)
        if released is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"key: no KV retained under {request.key!r} for this "
                                "tenant (never kept, released, expired or pressed out)")
        return api.ReleaseKvResponse(pages_released=released)
