"""Generate streams that survive their scheduler: ``resumable_generate`` and what it keeps to resume one.

A stream that breaks before every fork's last message (the scheduler killed or shut down, the connection dropped, a
queue full) is called again with a continuation: ``StreamProgress`` holds the token ids received per fork, the seed
the first message carried and the request id, and builds the next call's request from them, so the caller sees one
stream with no token lost or repeated. ``retryable`` says which errors another call can get past; the bounds
(attempts, backoff, how long an outage is waited out) are ``pagedkv.resume_policy``'s. ``pagedkv.client.Client.stream``
calls it (so the gateway and the Dynamo sidecar, which stream through Client, resume as it does).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc

from pagedkv.api.v1 import api_pb2 as api
from pagedkv.grpc_common import QUEUE_FULL_PREFIX
from pagedkv.resume_policy import ResumePolicy

# Worth another call: the scheduler went away or refused for now (UNAVAILABLE: killed, shutting down, no executor
# up, an executor lost for longer than it waits; CANCELLED: ended by the server; a full queue, which clears).
RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED}


def retryable(err: grpc.aio.AioRpcError, resuming: bool, queue_full: bool = True) -> bool:
    """Whether another call can succeed where ``err`` ended one. Never a refusal of the request itself
    (INVALID_ARGUMENT, FAILED_PRECONDITION, UNAUTHENTICATED, PERMISSION_DENIED, a RESOURCE_EXHAUSTED other than a full
    queue: gRPC's refusal of a message too large), nor ALREADY_EXISTS, except when ``resuming``: then the request_id
    in use may be the broken call's own request, not yet reaped by its scheduler. A full queue when ``queue_full``."""
    code = err.code()
    if code in RETRYABLE:
        return True
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return queue_full and (err.details() or "").startswith(QUEUE_FULL_PREFIX)
    return resuming and code == grpc.StatusCode.ALREADY_EXISTS


class StreamProgress:
    """What the caller received of one Generate stream, fork by fork (a request that resumes one itself starts from
    its continuation): enough to resume it."""

    def __init__(self, request: api.GenerateRequest) -> None:
        self.request = request
        self.n = max(1, request.sampling.n)
        self.token_ids: list[list[int]] = [[] for _ in range(self.n)]
        self.finished = [False] * self.n
        if len(request.continuation.forks) == self.n:
            self.token_ids = [list(f.token_ids) for f in request.continuation.forks]
            self.finished = [f.finished for f in request.continuation.forks]
        self.seed: int | None = request.sampling.seed if request.sampling.HasField("seed") else None
        self.request_id = request.request_id
        self.prompt_received = request.continuation.prompt_received

    def add(self, msg: api.GenerateResponse) -> None:
        if msg.HasField("seed") and self.seed is None:
            self.seed = msg.seed
        p = msg.prompt
        if p.token_ids or p.text or p.logprobs:  # (the prompt's ids, text or log-probabilities: not again)
            self.prompt_received = True
        if not self.request_id:
            self.request_id = msg.request_id  # (the server's, when the caller gave none: kept over a resume)
        if 0 <= msg.index < self.n:
            self.token_ids[msg.index].extend(msg.token_ids)
            if msg.finish_reason:
                self.finished[msg.index] = True

    @property
    def done(self) -> bool:
        return all(self.finished)

    @property
    def received(self) -> bool:
        return any(self.token_ids) or any(self.finished) or self.prompt_received

    @property
    def resumable(self) -> bool:
        """Nothing received yet (a plain resend), or the seed is known (the first message carries it)."""
        return not self.received or self.seed is not None

    def next_request(self) -> api.GenerateRequest:
        """The request again, for another call: with the seed and request id the stream had, and what it received
        (GenerateRequest.continuation; none when nothing came yet)."""
        req = api.GenerateRequest()
        req.CopyFrom(self.request)
        req.request_id = self.request_id
        if self.seed is not None:
            req.sampling.seed = self.seed
        req.ClearField("continuation")
        if self.received:
            req.continuation.forks.extend(
                api.ForkProgress(token_ids=ids, draw_offset=len(ids), finished=done)
                for ids, done in zip(self.token_ids, self.finished))
            req.continuation.prompt_received = self.prompt_received
        return req


def _gave_up(err: grpc.aio.AioRpcError, note: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(err.code(), err.initial_metadata(), err.trailing_metadata(),
                                f"{err.details() or err.code().name} ({note})", err.debug_error_string())


async def resumable_generate(stub, request: api.GenerateRequest, metadata=(), policy: ResumePolicy | None = None,
                             wait_ready: Callable[[], Awaitable[None]] | None = None,
                             ) -> AsyncIterator[api.GenerateResponse]:
    """``stub.Generate(request)``'s messages, the stream resumed after a break as ``policy`` says (None: never).
    ``wait_ready``: waits until the channel can reach a scheduler (Client: ``channel.channel_ready``), so that a
    scheduler being restarted costs no attempts. Raises the last grpc.aio.AioRpcError when the stream cannot go on
    (after a resume was tried, its details say why it stopped); a stream that ends before every fork's last message
    is an UNAVAILABLE one."""
    progress = StreamProgress(request)
    calls = failures = 0  # calls made; calls in a row that delivered nothing (an outage)
    broke_at = 0.0
    while True:
        call = stub.Generate(progress.next_request() if calls else request, metadata=metadata)
        calls += 1
        try:
            while True:
                msg = await call.read()
                if msg is grpc.aio.EOF:
                    break
                progress.add(msg)
                failures = 0
                yield msg
            if progress.done:
                return
            error = grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                         "the stream ended before the last message of every fork")
        except grpc.aio.AioRpcError as err:
            error = err
        finally:
            call.cancel()
        now = time.monotonic()
        if not failures:
            broke_at = now
        failures += 1
        if policy is None or not retryable(error, resuming=calls > 1,
                                           queue_full=policy.queue_full_at_start or progress.received):
            raise error if failures == 1 else _gave_up(error, f"not resumed: resume attempt {failures - 1} got this")
        if not progress.resumable:
            raise _gave_up(error, "not resumed: the first message carried no seed")
        if failures > policy.attempts:
            raise _gave_up(error, f"not resumed: {policy.attempts} resume attempts failed")
        left = broke_at + policy.timeout_s - now
        await asyncio.sleep(max(0.0, min(policy.backoff(failures), left)))
        left = broke_at + policy.timeout_s - time.monotonic()
        try:
            if left <= 0:
                raise TimeoutError
            if wait_ready is not None:
                await asyncio.wait_for(wait_ready(), left)
        except TimeoutError:
            raise _gave_up(error, f"not resumed within {policy.timeout_s:g}s") from None
