"""``pagedkv gateway``: an OpenAI-compatible HTTP front (Starlette on uvicorn, SSE streaming) that translates
to a scheduler's gRPC API.

  POST /v1/completions, POST /v1/chat/completions   (stream: SSE chunks, stream_options.include_usage, [DONE])
  GET  /v1/models
  GET  /health        200 while the scheduler answers SERVING, else 503 (readiness)
  GET  /health/live   200 while the gateway's event loop runs (liveness)
  GET  /metrics       Prometheus (no tenant data, no keys)

``Authorization: Bearer <key>`` goes to the scheduler as gRPC metadata: the scheduler authenticates the tenant.
A client that disconnects has its gRPC calls cancelled (the scheduler frees their pages within one step).
Every size is bounded before work is done: the request head (``--max-header-bytes``, 431) and the time to send
it (``--header-timeout``) and the body (``--body-timeout``) in the HTTP protocol (bounded_protocol); the body
(``--max-body-bytes``, by default the scheduler's request limit) before it is parsed, its JSON nesting before
``json.loads`` recurses, each prompt against the scheduler's limits before it is sent, streams (prompts x n)
against ``--max-streams``. The translation and the error mapping are in pagedkv/gateway_openai.py.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import logging
import os
import re
import sys
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace
from http import HTTPStatus

import grpc
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from pagedkv import gateway_openai as oai
from pagedkv.api.v1 import api_pb2 as api
from pagedkv.client import DEFAULT_RESUME, ResumePolicy, add_resume_args, resume_policy
from pagedkv.gateway_openai import ApiError, Choice, Plan, RequestLimits
from scheduler_svc.validation import MIN_PROMPT_BYTES, PROMPT_BYTES_PER_TOKEN

DEFAULT_PORT = 8000
DEFAULT_MAX_STREAMS = 1024
DEFAULT_MAX_HEADER_BYTES = 64 << 10
DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_BODY_TIMEOUT_S = 30.0
MAX_JSON_DEPTH = 64  # arrays and objects in a request body; OpenAI's bodies nest 4 deep
# NOTE: uvicorn's default is 5 s, the same as httpx's (the openai SDK's) pool expiry: a request sent on a
# connection the server was closing that instant failed with a read error (1 of 256 streams in bench/gateway.py).
DEFAULT_KEEP_ALIVE_S = 75.0
MAX_AUTH_HEADER_CHARS = 4096
CREDENTIAL_HEADERS = ("authorization", "api-key", "x-api-key")  # where clients send keys; only the first is read

# NOTE: a registry of the gateway's own. The CLI that starts it imports the scheduler's modules (to build every
# subcommand's parser), and their module-level series showed, all at 0, on the gateway's /metrics.
REGISTRY = CollectorRegistry()
for _collector in (ProcessCollector, PlatformCollector, GCCollector):
    _collector(registry=REGISTRY)
REQUESTS = Counter("pagedkv_gateway_requests_total", "HTTP requests answered, by endpoint and status",
                   ["endpoint", "status"], registry=REGISTRY)
LATENCY = Histogram("pagedkv_gateway_request_seconds", "Time from request to last byte, by endpoint", ["endpoint"],
                    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
                    registry=REGISTRY)
TTFT = Histogram("pagedkv_gateway_ttft_seconds", "Time from request to the first streamed token",
                 buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30), registry=REGISTRY)
RELAY = Histogram("pagedkv_gateway_relay_seconds", "Time from a scheduler message read to its SSE chunk written",
                  buckets=(1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.1),
                  registry=REGISTRY)
IN_FLIGHT = Gauge("pagedkv_gateway_requests_in_flight", "Generation requests being answered", registry=REGISTRY)
STREAMS = Gauge("pagedkv_gateway_streams_in_flight", "Streams (prompts x n) being answered; --max-streams bounds them",
                registry=REGISTRY)
DISCONNECTS = Counter("pagedkv_gateway_client_disconnects_total",
                      "Clients that went away before their answer ended (their gRPC calls were cancelled)",
                      registry=REGISTRY)
HTTP_BOUNDS = Counter("pagedkv_gateway_http_bounds_total", "Connections the HTTP bounds answered and closed: a "
                      "head over --max-header-bytes, a head or body not in within --header-timeout / --body-timeout",
                      ["reason"], registry=REGISTRY)


# ---- the scheduler side ------------------------------------------------------------------------
# The upstream streams resume as pagedkv.client's do, except that a full queue before anything was sent is passed on
# (429 with Retry-After: the HTTP client decides when to come back) instead of waited out here.
GATEWAY_RESUME = replace(DEFAULT_RESUME, queue_full_at_start=False)


class Upstream:
    """The gRPC channel to the scheduler(s) and what the gateway learns from them (the model's name, its
    max_model_len)."""

    def __init__(self, address: str, tls_ca: str = "", tls_server_name: str = "",
                 served_names: tuple[str, ...] = (), resume: ResumePolicy | None = GATEWAY_RESUME) -> None:
        from pagedkv.client import Client

        # NOTE: the client resumes a Generate stream whose scheduler went away (pagedkv.client), so an HTTP client
        # sees one stream across a scheduler's death or restart.
        self.client = Client(address, tls_ca=tls_ca, tls_server_name=tls_server_name, resume=resume)
        self.names: tuple[str, ...] = served_names  # empty: learned from ModelInfo on first use
        self.max_model_len = 0  # learned from ModelInfo on first use
        self.created = int(time.time())

    async def close(self) -> None:
        await self.client.close()

    async def model_info(self, metadata) -> api.ModelInfoResponse:
        try:
            info = await self.client.stub.ModelInfo(api.ModelInfoRequest(), metadata=metadata, timeout=10)
        except grpc.aio.AioRpcError as err:
            raise oai.from_grpc(err.code(), err.details() or "") from None
        if not self.names:
            self.names = (info.model,)
        self.max_model_len = info.max_model_len
        return info

    async def learned_max_model_len(self, metadata) -> int:
        """The scheduler's max_model_len, asked once (with the caller's credentials: ModelInfo authenticates)."""
        if not self.max_model_len:
            await self.model_info(metadata)
        return self.max_model_len

    async def check_model(self, name: str, metadata) -> str:
        if not self.names:
            await self.model_info(metadata)
        if name not in self.names:
            raise ApiError(404, f"model: {name!r} is not served here; GET /v1/models lists {', '.join(self.names)}",
                           param="model", code="model_not_found")
        return name

    async def serving(self) -> tuple[bool, str]:
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        try:
            r = await health_pb2_grpc.HealthStub(self.client.channel).Check(health_pb2.HealthCheckRequest(),
                                                                            timeout=2.0)
        except grpc.aio.AioRpcError as err:
            return False, f"{err.code().name}: {err.details()}"
        return r.status == health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.ServingStatus.Name(
            r.status)


def auth_metadata(request: Request) -> tuple[tuple[str, str], ...]:
    """The caller's Authorization header, passed to the scheduler as it came (it must be valid metadata). More
    than one credential (two Authorization headers, or one and an api-key header) is refused: which one would
    count is exactly what a client and a proxy in front of us could disagree on."""
    sent = [name for name, _ in request.headers.items() if name in CREDENTIAL_HEADERS]
    if len(sent) > 1:
        raise ApiError(401, f"Authorization: {len(sent)} credentials ({', '.join(sent)} headers); send exactly "
                       "one, as 'Authorization: Bearer <key>'", code="invalid_api_key")
    value = request.headers.get("authorization")
    if value is None:
        return ()
    if len(value) > MAX_AUTH_HEADER_CHARS or not all(0x20 <= ord(c) <= 0x7E for c in value):
        raise ApiError(401, f"Authorization: must be 'Bearer <key>' in printable ASCII, at most "
                       f"{MAX_AUTH_HEADER_CHARS} characters", code="invalid_api_key")
    return (("authorization", value),)


def _body_too_large(size: str, limits: RequestLimits, param: str) -> ApiError:
    return ApiError(413, f"request body: {size} bytes; at most {limits.body_bytes} (--max-body-bytes; by default "
                    f"the scheduler's request limit: {limits.describe()})", param=param, code="body_too_large")


async def read_json(request: Request, limits: RequestLimits, param: str):
    """The body as JSON: refused with 413 once it is longer than ``limits.body_bytes`` (from Content-Length, or
    while reading: before it is parsed), with 400 when it nests deeper than MAX_JSON_DEPTH (before json.loads
    recurses). ``param``: what the body mostly carries (prompt or messages), named in the 413."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limits.body_bytes:
        raise _body_too_large(declared, limits, param)
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > limits.body_bytes:
                raise _body_too_large(f"more than {limits.body_bytes}", limits, param)
    except ClientDisconnect:  # gone, or closed by --body-timeout: this answer goes nowhere
        raise ApiError(499, "request body: the connection closed before all of it came") from None
    if nests_deeper_than(body, MAX_JSON_DEPTH):
        raise ApiError(400, f"request body: JSON nested more than {MAX_JSON_DEPTH} levels deep (arrays and "
                       f"objects); at most {MAX_JSON_DEPTH}", code="body_too_deep")
    try:
        return json.loads(body)
    except ValueError as err:  # UnicodeDecodeError included
        raise ApiError(400, f"request body: not valid JSON ({err})") from None


# A JSON string, or an unterminated one to the end (so that no quote is ever scanned twice), and what is not a
# bracket: nests_deeper_than's regular expressions, both linear.
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"?', re.DOTALL)
_NOT_BRACKET = re.compile(rb"[^\[\]{}]+")
_NESTING_STEP = [0] * 256
for _c in b"[{":
    _NESTING_STEP[_c] = 1
for _c in b"]}":
    _NESTING_STEP[_c] = -1


def nests_deeper_than(body: bytes | bytearray, limit: int) -> bool:
    """Whether arrays and objects nest more than ``limit`` deep in ``body`` (outside strings), found without
    recursion: json.loads recurses once a level, so ``[`` x 100,000 was a RecursionError. The strings skipped are
    the ones json.loads lexes, so it never goes deeper than this counts, valid JSON or not. A body with at most
    ``limit`` brackets is not scanned at all."""
    if body.count(b"[") + body.count(b"{") <= limit:
        return False
    brackets = _NOT_BRACKET.sub(b"", _JSON_STRING.sub(b"", body))
    return max(itertools.accumulate(map(_NESTING_STEP.__getitem__, brackets)), default=0) > limit


# ---- generation --------------------------------------------------------------------------------
Event = tuple[int, "api.GenerateResponse | grpc.aio.AioRpcError | None"]  # (prompt index, message | error | end)


async def _one(stream: AsyncIterator[api.GenerateResponse]) -> AsyncIterator[Event]:
    try:
        async for msg in stream:
            yield 0, msg
    except grpc.aio.AioRpcError as err:
        yield 0, err
        return
    yield 0, None


async def _merged(streams: list[AsyncIterator[api.GenerateResponse]]) -> AsyncIterator[Event]:
    """The streams' messages as they come, tagged with the stream's index; each stream ends with None or an
    error."""
    if len(streams) == 1:
        async for event in _one(streams[0]):
            yield event
        return
    queue: asyncio.Queue[Event] = asyncio.Queue()

    async def pump(i: int, stream) -> None:
        async for _, item in _one(stream):
            queue.put_nowait((i, item))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        ended = 0
        while ended < len(streams):
            event = await queue.get()
            if not isinstance(event[1], api.GenerateResponse):
                ended += 1
            yield event
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)  # (their streams closed: their calls cancelled)


def _sse(obj) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


class Generation(Response):
    """Runs one OpenAI request against the scheduler inside the ASGI call, so that it sees the client go away:
    a disconnect cancels the gRPC calls. The HTTP status waits for every call's first message (or its error),
    so refusals (400/401/429/503) arrive as statuses even when streaming."""

    def __init__(self, gateway: Gateway, plan: Plan, rid: str, model: str, metadata, endpoint: str,
                 started: float) -> None:
        self.gw, self.plan, self.rid, self.model, self.metadata = gateway, plan, rid, model, metadata
        self.endpoint, self.started = endpoint, started
        self.status_code = 200
        self.background = None
        self.choices = [Choice() for _ in range(plan.num_choices)]
        self.disconnected = False
        self.streamed_a_token = False

    async def __call__(self, scope, receive, send) -> None:
        async def client_gone() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass

        watcher = asyncio.ensure_future(client_gone())
        work = asyncio.ensure_future(self._run(send))
        IN_FLIGHT.inc()
        try:
            await asyncio.wait({watcher, work}, return_when=asyncio.FIRST_COMPLETED)
            if not work.done():
                self.disconnected = True
                DISCONNECTS.inc()
                work.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await work
        finally:
            watcher.cancel()
            IN_FLIGHT.dec()
            self.gw.finished(self)

    async def _run(self, send) -> None:
        # (each a Generate call, resumed on another call if its scheduler goes away: pagedkv.client)
        calls = [self.gw.upstream.client.stream(req, metadata=self.metadata) for req in self.plan.requests]
        events = _merged(calls)
        try:
            first: list[Event] = []
            waiting = set(range(len(calls)))
            async for i, item in events:
                if isinstance(item, grpc.aio.AioRpcError):
                    err = oai.from_grpc(item.code(), item.details() or "", chat=self.plan.chat)
                    return await self._send_error(send, err)
                first.append((i, item))
                waiting.discard(i)
                if not waiting:
                    break
            if self.plan.stream:
                await self._stream(send, first, events)
            else:
                async for i, item in events:
                    if isinstance(item, grpc.aio.AioRpcError):
                        err = oai.from_grpc(item.code(), item.details() or "", chat=self.plan.chat)
                        return await self._send_error(send, err)
                    first.append((i, item))
                for i, item in first:
                    if item is not None:
                        self._add(i, item)
                body = oai.response_body(self.plan, self.rid, oai.now(), self.model, self.choices)
                await self._send_json(send, 200, body)
        finally:
            await events.aclose()
            for call in calls:
                await call.aclose()  # (a call still open is cancelled)

    def _add(self, i: int, msg: api.GenerateResponse) -> int:
        index = i * self.plan.n + msg.index
        self.choices[index].add(msg)
        return index

    async def _stream(self, send, first: list[Event], events: AsyncIterator[Event]) -> None:
        headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                   (b"x-accel-buffering", b"no"), (b"x-request-id", self.rid.encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        plan, created = self.plan, oai.now()
        if plan.chat:
            for index in range(plan.num_choices):
                await self._body(send, _sse(oai.chunk_body(plan, self.rid, created, self.model, index, None,
                                                           role=True)))

        async def rest() -> AsyncIterator[Event]:
            for event in first:
                yield event
            async for event in events:
                yield event

        async for i, item in rest():
            read_at = time.perf_counter()
            if item is None:
                continue
            if isinstance(item, grpc.aio.AioRpcError):
                err = oai.from_grpc(item.code(), item.details() or "", chat=plan.chat)
                self.status_code = err.status
                await self._body(send, _sse(err.body()) + b"data: [DONE]\n\n", more=False)
                return
            index = self._add(i, item)
            finish = self.choices[index].finish_reason if item.finish_reason else None
            if not (item.text or finish or (plan.logprobs and item.token_ids)):
                continue  # text may be held back (a stop string may start there, a character is not complete)
            if item.token_ids and not self.streamed_a_token:
                self.streamed_a_token = True
                TTFT.observe(time.perf_counter() - self.started)
            await self._body(send, _sse(oai.chunk_body(plan, self.rid, created, self.model, index, item.text,
                                                       item.token_ids, item.logprobs, finish)))
            RELAY.observe(time.perf_counter() - read_at)
        tail = b""
        if plan.include_usage:
            tail = _sse(oai.usage_chunk(plan, self.rid, created, self.model, self.choices))
        await self._body(send, tail + b"data: [DONE]\n\n", more=False)

    @staticmethod
    async def _body(send, data: bytes, more: bool = True) -> None:
        await send({"type": "http.response.body", "body": data, "more_body": more})

    async def _send_json(self, send, status: int, body: dict, headers: dict[str, str] | None = None) -> None:
        self.status_code = status
        data = json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()
        extra = [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
                                (b"x-request-id", self.rid.encode()), *extra]})
        await send({"type": "http.response.body", "body": data})

    async def _send_error(self, send, err: ApiError) -> None:
        await self._send_json(send, err.status, err.body(), err.headers())


# ---- the app -----------------------------------------------------------------------------------
class Gateway:
    def __init__(self, upstream: Upstream, log, max_body_bytes: int = 0, max_streams: int = DEFAULT_MAX_STREAMS,
                 token_text=None, max_prompt_bytes: int = 0) -> None:
        """``max_body_bytes``, ``max_prompt_bytes``: 0 for the scheduler's own limits (RequestLimits.of)."""
        self.upstream, self.log, self.token_text = upstream, log, token_text
        self.max_body_bytes, self.max_prompt_bytes, self.max_streams = max_body_bytes, max_prompt_bytes, max_streams
        self.limits: RequestLimits | None = None  # once the scheduler's max_model_len is known
        self.active = 0  # streams (prompts x n) being answered

    async def request_limits(self, metadata) -> RequestLimits:
        if self.limits is None:
            max_model_len = await self.upstream.learned_max_model_len(metadata)
            self.limits = RequestLimits.of(max_model_len, self.max_prompt_bytes, self.max_body_bytes)
        return self.limits

    def check_streams(self, plan: Plan) -> None:
        """--max-streams counts streams, each prompt's n forks: one request may be 32 prompts x n=16 = 512."""
        streams = plan.num_choices
        if streams > self.max_streams:
            raise ApiError(400, f"n: {len(plan.requests)} prompt(s) x n={plan.n} = {streams} streams; this gateway "
                           f"answers at most {self.max_streams} at once (--max-streams)", param="n")
        if self.active + streams > self.max_streams:
            raise ApiError(429, f"this gateway is answering {self.active} streams; {streams} more would pass its "
                           f"limit of {self.max_streams} (--max-streams); retry later", code="too_many_requests",
                           retry_after=oai.RETRY_AFTER_S)

    def finished(self, gen: Generation) -> None:
        self.active -= gen.plan.num_choices
        STREAMS.dec(gen.plan.num_choices)
        status = 499 if gen.disconnected else gen.status_code
        elapsed = time.perf_counter() - gen.started
        REQUESTS.labels(gen.endpoint, str(status)).inc()
        LATENCY.labels(gen.endpoint).observe(elapsed)
        self.log.info("request_finished", request_id=gen.rid, endpoint=gen.endpoint, status=status,
                      stream=gen.plan.stream, n=gen.plan.n, prompts=len(gen.plan.requests), user=gen.plan.user or None,
                      completion_tokens=sum(c.completion_tokens for c in gen.choices), seconds=round(elapsed, 4),
                      client_disconnected=gen.disconnected)

    async def generate(self, request: Request, chat: bool) -> Response:
        started = time.perf_counter()
        endpoint = "chat" if chat else "completions"
        try:
            metadata = auth_metadata(request)
            limits = await self.request_limits(metadata)
            body = await read_json(request, limits, "messages" if chat else "prompt")
            rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
            plan = oai.parse_chat(body, rid) if chat else oai.parse_completion(body, rid)
            plan.token_text = self.token_text
            oai.check_sizes(plan, limits)
            model = await self.upstream.check_model(plan.model, metadata)
            self.check_streams(plan)
        except ApiError as err:
            REQUESTS.labels(endpoint, str(err.status)).inc()
            self.log.info("request_refused", endpoint=endpoint, status=err.status, error=err.message)
            return JSONResponse(err.body(), status_code=err.status, headers=err.headers())
        self.active += plan.num_choices
        STREAMS.inc(plan.num_choices)
        return Generation(self, plan, rid, model, metadata, endpoint, started)

    async def completions(self, request: Request) -> Response:
        return await self.generate(request, chat=False)

    async def chat(self, request: Request) -> Response:
        return await self.generate(request, chat=True)

    async def models(self, request: Request) -> Response:
        try:
            info = await self.upstream.model_info(auth_metadata(request))
        except ApiError as err:
            return JSONResponse(err.body(), status_code=err.status, headers=err.headers())
        data = [{"id": name, "object": "model", "created": self.upstream.created, "owned_by": "pagedkv",
                 "root": info.model, "max_model_len": info.max_model_len} for name in self.upstream.names]
        return JSONResponse({"object": "list", "data": data})

    async def health(self, request: Request) -> Response:
        ok, status = await self.upstream.serving()
        if ok:
            return JSONResponse({"status": "ok", "scheduler": status})
        return JSONResponse(ApiError(503, f"the scheduler is not serving ({status})").body(), status_code=503)

    async def live(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def metrics(self, request: Request) -> Response:
        return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)


async def _http_error(request: Request, exc: HTTPException) -> Response:
    status = exc.status_code
    message = {404: f"{request.url.path}: no such endpoint", 405: f"{request.method} is not allowed on "
               f"{request.url.path}"}.get(status, str(exc.detail))
    return JSONResponse(ApiError(status, message).body(), status_code=status, headers=exc.headers)


def create_app(gateway: Gateway, on_shutdown=()) -> Starlette:
    routes = [
        Route("/v1/completions", gateway.completions, methods=["POST"]),
        Route("/v1/chat/completions", gateway.chat, methods=["POST"]),
        Route("/v1/models", gateway.models, methods=["GET"]),
        Route("/health", gateway.health, methods=["GET"]),
        Route("/health/live", gateway.live, methods=["GET"]),
        Route("/metrics", gateway.metrics, methods=["GET"]),
    ]

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        yield
        for close in on_shutdown:
            await close()

    return Starlette(routes=routes, exception_handlers={HTTPException: _http_error}, lifespan=lifespan)


# ---- HTTP bounds --------------------------------------------------------------------------------
# After a 431 the connection ends this long later, and up to REFUSAL_DRAIN_BYTES of what the client still sends is
# read and dropped meanwhile: a client that sends its whole request before it reads (most) sees the answer rather
# than a reset, and one sending 64 MB costs a read of 1 MiB, then waits on a full window.
REFUSAL_LINGER_S = 2.0
REFUSAL_DRAIN_BYTES = 1 << 20
_HEAD_END = b"\r\n\r\n"


def _refusal(status: int, message: str, code: str) -> bytes:
    """A whole HTTP/1.1 answer that ends the connection, written by the protocol: no request reached the app."""
    body = json.dumps(ApiError(status, message, code=code).body(), separators=(",", ":")).encode()
    return (f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode() + body


def bounded_protocol(log, max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES,
                     header_timeout: float = DEFAULT_HEADER_TIMEOUT_S,
                     body_timeout: float = DEFAULT_BODY_TIMEOUT_S) -> type[asyncio.Protocol]:
    """uvicorn's httptools protocol (its fast parser) with the bounds it lacks; httptools takes headers of any
    size, at any pace, and uvicorn times out only idle keep-alive connections:

    - a request head (request line and headers) of at most ``max_header_bytes``, counted as bytes arrive, before
      the parser sees them: past it, 431 and the connection ends (REFUSAL_LINGER_S later, so that the client
      reads the answer rather than a reset);
    - the head complete within ``header_timeout`` s of the connection opening, or of the first byte of a
      keep-alive connection's next request (the wait before it is --keep-alive-timeout's): else 408 and the end,
      so a client trickling header lines (slowloris) holds a connection that long at most;
    - the body complete within ``body_timeout`` s of the head's end: else 408 (or, once answered, just the end).

    NOTE: uvicorn's h11 protocol bounds a head in bytes (h11_max_incomplete_event_size: the head is one event),
    answers it 400, and has no head or body timeout either; and it parses in Python: 160-250 us of CPU a request
    through uvicorn against httptools' 30-45 us, which this guard adds ~2 us to (bench/gateway_attacks.py)."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    too_large = _refusal(431, f"request head (request line and headers): more than {max_header_bytes} bytes; at "
                         f"most {max_header_bytes} (--max-header-bytes)", "headers_too_large")
    late = {"header_timeout": _refusal(408, f"request head: not complete within {header_timeout:g} s "
                                       "(--header-timeout)", "header_timeout"),
            "body_timeout": _refusal(408, f"request body: not complete within {body_timeout:g} s of the head "
                                     "(--body-timeout)", "body_timeout")}

    parse, headers_complete = HttpToolsProtocol.data_received, HttpToolsProtocol.on_headers_complete
    message_complete = HttpToolsProtocol.on_message_complete

    class BoundedHttpToolsProtocol(HttpToolsProtocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self.head_bytes: int | None = 0  # of the request head being read; None while a body is read
            self.head_tail = b""  # the head's last 3 bytes so far: its end may straddle two reads
            self.refused, self.drained = False, 0
            self.bound_timer: asyncio.TimerHandle | None = None
            self._arm(header_timeout, "header_timeout")

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self.refused:  # answered: dropped until the close
                self.drained += len(data)
                if self.drained > REFUSAL_DRAIN_BYTES:
                    self.transport.pause_reading()
                return
            head = self.head_bytes
            if head is not None:
                room = max_header_bytes - head
                if len(data) > room and _HEAD_END not in self.head_tail + data[:room]:
                    return self._refuse(too_large, "header_bytes", linger=True)
                self.head_bytes = head + len(data)
            parse(self, data)
            # NOTE: timers only for what this read left incomplete: a request that comes in one read (most do)
            # arms none, so the guard costs a request a few comparisons.
            head = self.head_bytes
            if head:  # a head still incomplete: the first bytes of a keep-alive connection's next request
                self.head_tail = (self.head_tail + data[-3:])[-3:]
                if self.bound_timer is None and not self.transport.is_closing():
                    self._arm(header_timeout, "header_timeout")
            elif head is None and self.bound_timer is None and not self.transport.is_closing():
                self._arm(body_timeout, "body_timeout")

        def on_headers_complete(self) -> None:
            self.head_bytes = None
            if self.bound_timer is not None:
                self._disarm()
            headers_complete(self)

        def on_message_complete(self) -> None:
            if self.bound_timer is not None:
                self._disarm()
            self.head_bytes, self.head_tail = 0, b""
            message_complete(self)

        def _arm(self, seconds: float, reason: str) -> None:
            self._disarm()
            self.bound_timer = self.loop.call_later(seconds, self._late, reason)

        def _disarm(self) -> None:
            if self.bound_timer is not None:
                self.bound_timer.cancel()
                self.bound_timer = None

        def _late(self, reason: str) -> None:
            self.bound_timer = None
            if reason == "header_timeout" and not self.head_bytes:
                self.transport.close()  # nothing of a request came: closed as an idle keep-alive connection is
                return
            answered = reason == "body_timeout" and self.cycle is not None and self.cycle.response_started
            self._refuse(b"" if answered else late[reason], reason, linger=False)

        def _refuse(self, answer: bytes, reason: str, linger: bool) -> None:
            self.refused = True
            self._disarm()
            HTTP_BOUNDS.labels(reason).inc()
            client = f"{self.client[0]}:{self.client[1]}" if self.client else None
            log.info("http_refused", reason=reason, client=client, head_bytes=self.head_bytes)
            if answer:
                self.transport.write(answer)
            if linger and self.transport.can_write_eof():
                self.transport.write_eof()
                self.bound_timer = self.loop.call_later(REFUSAL_LINGER_S, self.transport.close)
            else:
                self.transport.close()

    return BoundedHttpToolsProtocol


# ---- command line ------------------------------------------------------------------------------
def check_http(url: str, tls_ca: str = "", tls_server_name: str = "", timeout: float = 3.0) -> tuple[bool, str]:
    """``pagedkv health --http URL``: (True, what it said) when GET URL answers 200 (the gateway's /health:
    it and its scheduler serve). https URLs are verified against ``tls_ca`` (else the system's CAs)."""
    import http.client
    import ssl
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"--http {url!r}: give an http:// or https:// URL, e.g. https://127.0.0.1:8000/health")
    if parts.scheme == "https":
        ctx = ssl.create_default_context(cafile=tls_ca or None)
        conn = http.client.HTTPSConnection(parts.hostname, parts.port or 443, timeout=timeout, context=ctx)
        if tls_server_name:  # verify the certificate against this name instead of the URL's host
            conn = _named_https(parts.hostname, parts.port or 443, timeout, ctx, tls_server_name)
    else:
        conn = http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=timeout)
    try:
        conn.request("GET", parts.path or "/")
        r = conn.getresponse()
        body = r.read(4096).decode("utf-8", "replace")
    except (OSError, http.client.HTTPException) as err:
        return False, f"{url}: {err}"
    finally:
        conn.close()
    return r.status == 200, f"{url}: {r.status} {body.strip()}"


def _named_https(host: str, port: int, timeout: float, ctx, server_name: str):
    import http.client
    import socket

    class Conn(http.client.HTTPSConnection):
        def connect(self) -> None:
            sock = socket.create_connection((host, port), timeout)
            self.sock = ctx.wrap_socket(sock, server_hostname=server_name)

    return Conn(host, port, timeout=timeout, context=ctx)


def add_args(p: argparse.ArgumentParser) -> None:
    from pagedkv.security import add_tls_client_args, add_tls_server_args

    p.add_argument("--address", default=os.environ.get("PAGEDKV_ADDRESS", "127.0.0.1:50051"),
                   help="scheduler HOST:PORT; several comma-separated, or dns:///NAME:PORT, for round robin")
    p.add_argument("--host", default="127.0.0.1", help="HTTP listen address")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help="HTTP port")
    p.add_argument("--served-model-name", action="append", default=[], metavar="NAME",
                   help="the model name(s) clients send (repeatable; default: the scheduler's ModelInfo.model)")
    p.add_argument("--tokenizer", default="", metavar="DIR",
                   help="the model's tokenizer directory: logprobs name tokens by their text (default: token_id:N; "
                   "the gateway then loads no tokenizer)")
    p.add_argument("--max-body-bytes", type=int, default=0, metavar="N",
                   help="longest request body, refused with 413 before it is parsed (default: the scheduler's "
                   "request limit, learned from its max_model_len: --max-prompt-bytes, or a full context of token "
                   "ids at 5 bytes each, whichever is more, plus 64 KiB; several prompts in one body share it)")
    p.add_argument("--max-prompt-bytes", type=int, default=0, metavar="N",
                   help="longest prompt text, or chat contents together, in UTF-8 bytes, refused with 400 before "
                   "it is sent; set it to the scheduler's --max-prompt-bytes when that is set (default: the "
                   f"scheduler's default, {PROMPT_BYTES_PER_TOKEN} bytes per token of its max_model_len, at least "
                   f"{MIN_PROMPT_BYTES})")
    p.add_argument("--max-streams", type=int, default=DEFAULT_MAX_STREAMS, metavar="N",
                   help="streams answered at once, each prompt's n forks counted (32 prompts x n=16 are 512): a "
                   "request past it gets 429 with Retry-After, one that alone is over it 400 (default: %(default)s)")
    p.add_argument("--max-header-bytes", type=int, default=DEFAULT_MAX_HEADER_BYTES, metavar="N",
                   help="longest request head (request line and headers, in all): past it the answer is 431 and "
                   "the connection closes (default: %(default)s)")
    p.add_argument("--header-timeout", type=float, default=DEFAULT_HEADER_TIMEOUT_S, metavar="S",
                   help="seconds a client has to send a request's head, from the connection opening or the next "
                   "request's first byte: past it, 408 and the connection closes (slow clients hold no connection "
                   "longer; default: %(default)s)")
    p.add_argument("--body-timeout", type=float, default=DEFAULT_BODY_TIMEOUT_S, metavar="S",
                   help="seconds a client has to send a request's body once its head is in: past it, 408 and the "
                   "connection closes (default: %(default)s)")
    p.add_argument("--keep-alive-timeout", type=float, default=DEFAULT_KEEP_ALIVE_S, metavar="S",
                   help="seconds an idle HTTP/1.1 connection stays open; longer than clients' and load balancers' "
                   "own idle timeouts, so that they close first (a server closing first races a client reusing it)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM: seconds in-flight requests get to finish (new connections are refused)")
    add_resume_args(p, note=" (A full queue before anything was sent is the HTTP client's 429 with Retry-After.)")
    p.add_argument("--log-format", choices=["auto", "json", "console"], default="auto",
                   help="auto: readable on a terminal, JSON lines otherwise")
    add_tls_server_args(p)  # HTTPS on the HTTP side
    add_tls_client_args(p)  # trust the scheduler's certificate


def _server_class():
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            """SIGTERM or Ctrl-C: stop accepting, let in-flight requests finish (--shutdown-timeout), exit 0
            (uvicorn would raise the signal again once drained, so the process would die of it); a second
            signal stops at once."""
            if self.should_exit:
                self.force_exit = True
            self.should_exit = True

        async def shutdown(self, sockets=None) -> None:
            # NOTE: an idle keep-alive connection is dropped at once. uvicorn closes it, which over TLS sends
            # close_notify and waits up to 30 s (asyncio's ssl_shutdown_timeout) for a client that is not reading:
            # every HTTPS shutdown with an idle client in its pool took the whole --shutdown-timeout.
            for connection in list(self.server_state.connections):
                cycle = getattr(connection, "cycle", None)
                if cycle is None or cycle.response_complete:
                    connection.transport.abort()
            await super().shutdown(sockets)

    return Server


def load_token_text(path: str):
    """--tokenizer: a token id -> its text (cached)."""
    import functools

    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as err:
        raise ValueError(f"--tokenizer {path}: cannot load a tokenizer there: {err}") from None
    return functools.lru_cache(maxsize=1 << 16)(lambda token_id: tokenizer.decode([token_id]))


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """``pagedkv serve --http-port P``: the gateway as a third child of serve."""
    p.add_argument("--http-port", type=int, default=0, metavar="P",
                   help="also serve the OpenAI-compatible HTTP API (pagedkv gateway) on --host:P (0: off); with "
                   "--tls-cert it serves HTTPS with the same certificate and verifies the scheduler with "
                   "$PAGEDKV_TLS_CA (the CA that signed --tls-cert)")


def serve_child_command(args) -> list[str] | None:
    """serve's gateway child (None without --http-port): it dials serve's scheduler on loopback."""
    if not args.http_port:
        return None
    host = "127.0.0.1" if args.host in ("0.0.0.0", "::", "") else args.host
    cmd = [sys.executable, "-m", "pagedkv", "gateway", "--address", f"{host}:{args.port}", "--host", args.host,
           "--port", str(args.http_port), "--shutdown-timeout", str(args.shutdown_timeout),
           "--log-format", args.log_format]
    if getattr(args, "max_prompt_bytes", 0):  # the scheduler's, so that the gateway refuses what it would
        cmd += ["--max-prompt-bytes", str(args.max_prompt_bytes)]
    if args.tls_cert:
        ca = os.environ.get("PAGEDKV_TLS_CA", "")
        if not ca:
            raise ValueError("--http-port with --tls-cert: set $PAGEDKV_TLS_CA to the CA certificate that signed "
                             "--tls-cert (pagedkv gen-certs writes it as ca.pem), so the gateway can verify the "
                             "scheduler")
        cmd += ["--tls-cert", args.tls_cert, "--tls-key", args.tls_key, "--tls-ca", ca]
    return cmd


def check_bounds(args) -> None:
    for flag, value, lo in (("--max-body-bytes", args.max_body_bytes, 1024),
                            ("--max-prompt-bytes", args.max_prompt_bytes, 1),
                            ("--max-header-bytes", args.max_header_bytes, 1024)):
        if value < 0 or 0 < value < lo:
            raise ValueError(f"{flag} {value}: at least {lo} (or 0 for the default)")
    if args.max_streams < 1:
        raise ValueError(f"--max-streams {args.max_streams}: at least 1")
    for flag, seconds in (("--header-timeout", args.header_timeout), ("--body-timeout", args.body_timeout)):
        if not seconds > 0:
            raise ValueError(f"{flag} {seconds}: must be > 0")


async def serve(args) -> None:
    import uvicorn

    from pagedkv import logs
    from pagedkv.security import server_credentials, warn_if_exposed

    log = logs.configure("gateway", json=logs.wants_json(args.log_format))
    logging.getLogger("uvicorn.error").setLevel(logging.WARNING)  # gateway_ready / gateway_stopped say it
    tls = server_credentials(args.tls_cert, args.tls_key) is not None  # checks the pair now (clear errors)
    check_bounds(args)
    resume = resume_policy(args)
    resume = replace(resume, queue_full_at_start=False) if resume is not None else None  # (as GATEWAY_RESUME)
    upstream = Upstream(args.address, args.tls_ca, args.tls_server_name, tuple(args.served_model_name), resume)
    token_text = await asyncio.to_thread(load_token_text, args.tokenizer) if args.tokenizer else None
    gateway = Gateway(upstream, log, args.max_body_bytes, args.max_streams, token_text, args.max_prompt_bytes)
    app = create_app(gateway, on_shutdown=(upstream.close,))
    protocol = bounded_protocol(log, args.max_header_bytes, args.header_timeout, args.body_timeout)
    config = uvicorn.Config(app, host=args.host, port=args.port, http=protocol, lifespan="on", log_config=None,
                            access_log=False, timeout_graceful_shutdown=args.shutdown_timeout,
                            timeout_keep_alive=args.keep_alive_timeout,
                            ssl_certfile=args.tls_cert or None, ssl_keyfile=args.tls_key or None,
                            server_header=False)
    server = _server_class()(config)
    warn_if_exposed(log, "gateway", args.host, args.port, tls)

    async def announce() -> None:
        while not server.started:
            if server.should_exit:
                return
            await asyncio.sleep(0.02)
        log.info("gateway_ready", address=f"{args.host}:{args.port}", tls=tls, scheduler=args.address,
                 scheduler_tls=bool(args.tls_ca), models=list(args.served_model_name) or None)

    ready = asyncio.ensure_future(announce())
    try:
        await server.serve()
    finally:
        ready.cancel()
    if not server.started:
        raise OSError(f"--port {args.port}: cannot listen on {args.host}:{args.port} (in use?)")
    log.info("gateway_stopped")


def main(args) -> int:
    import uvloop

    try:
        uvloop.run(serve(args))
    except (ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":  # python -m pagedkv.gateway (pagedkv gateway is the same)
    parser = argparse.ArgumentParser(prog="pagedkv gateway", description=__doc__.split("\n\n")[0])
    add_args(parser)
    sys.exit(main(parser.parse_args()))
