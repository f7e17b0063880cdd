"""How ``pagedkv dynamo-worker``'s failures reach Dynamo: which Dynamo exception each scheduler error becomes, and the
resume policy that leaves a full queue to Dynamo's migration.

- Overload: the scheduler's ``RESOURCE_EXHAUSTED "queue full: ..."`` is raised as Dynamo's ``Disconnected``: its
  frontend migrates such a request to another worker (``--migration-limit`` >= 1) and keeps this one in rotation.
  Measured on Dynamo 1.6.1 (tests/e2e/test_dynamo_fleet.py checks it): with two workers, one raising, round robin,
  6 requests, --migration-limit 3: Disconnected, CannotConnect and ConnectionTimeout 6/6 served (0: 3/6), the
  raising worker still chosen afterwards; StreamIncomplete and EngineShutdown 6/6 but the worker is taken out of
  routing after the first; WorkerUnavailable, Unknown, Cancelled and HttpError 503/429 are not migrated (3/6, HTTP
  500 or their code).
- Refusals (the request itself is wrong, or this worker's credentials): ``InvalidArgument``, HTTP 400, never retried
  on another worker.
- A stream the scheduler ends with UNAVAILABLE after the client gave up resuming: ``EngineShutdown`` (migrated; the
  router takes the worker out). Anything else: ``Unknown``.
"""

from __future__ import annotations

from dataclasses import replace

import grpc
from dynamo.llm.exceptions import Disconnected, EngineShutdown, InvalidArgument, Unknown

from pagedkv.grpc_common import QUEUE_FULL_PREFIX
from pagedkv.resume_policy import DEFAULT_RESUME

# A full queue goes back to Dynamo at once (it migrates the request to another worker); a broken stream is resumed.
SIDECAR_RESUME = replace(DEFAULT_RESUME, queue_full_at_start=False)
# Codes that say the request itself is wrong (or this worker's credentials): HTTP 400, never retried elsewhere.
REFUSALS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.FAILED_PRECONDITION,
            grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED,
            grpc.StatusCode.RESOURCE_EXHAUSTED}


def dynamo_error(err: grpc.aio.AioRpcError) -> Exception:
    """The Dynamo exception for a scheduler's error (see the module doc for why each)."""
    code, details = err.code(), err.details() or ""
    said = f"pagedkv scheduler: {code.name}: {details}"
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and details.startswith(QUEUE_FULL_PREFIX):
        return Disconnected(said)
    if code in REFUSALS:
        return InvalidArgument(said)
    if code == grpc.StatusCode.UNAVAILABLE:
        return EngineShutdown(said)
    return Unknown(said)
