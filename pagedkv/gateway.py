"""``pagedkv gateway``: an OpenAI-compatible HTTP front (Starlette on uvicorn, SSE streaming) that translates
to a scheduler's gRPC API.

  POST /v1/completions, POST /v1/chat/completions   (stream: SSE chunks, stream_options.include_usage, [DONE])
  GET  /v1/models
  GET  /health        200 while the scheduler answers SERVING, else 503 (readiness)
  GET  /health/live   200 while the gateway's event loop runs (liveness)
  GET  /metrics       Prometheus (no tenant data, no keys)

``Authorization: Bearer <key>`` goes to the scheduler as gRPC metadata: the scheduler authenticates the tenant.
A client that disconnects has its gRPC calls cancelled (the scheduler frees their pages within one step).
Request bodies are bounded (``--max-body-bytes``) before they are parsed; the translation and the error
mapping are in pagedkv/gateway_openai.py.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import sys
import time
import uuid
from collections.abc import AsyncIterator

import grpc
from prometheus_client import CONTENT_TYPE_LATEST, Counter, Gauge, Histogram, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from pagedkv import gateway_openai as oai
from pagedkv.api.v1 import api_pb2 as api
from pagedkv.gateway_openai import ApiError, Choice, Plan

DEFAULT_PORT = 8000
DEFAULT_MAX_BODY_BYTES = 4 << 20
DEFAULT_MAX_STREAMS = 1024
# NOTE: uvicorn's default is 5 s, the same as httpx's (the openai SDK's) pool expiry: a request sent on a
# connection the server was closing that instant failed with a read error (1 of 256 streams in bench/gateway.py).
DEFAULT_KEEP_ALIVE_S = 75.0
MAX_AUTH_HEADER_CHARS = 4096

REQUESTS = Counter("pagedkv_gateway_requests_total", "HTTP requests answered, by endpoint and status",
                   ["endpoint", "status"])
LATENCY = Histogram("pagedkv_gateway_request_seconds", "Time from request to last byte, by endpoint", ["endpoint"],
                    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300))
TTFT = Histogram("pagedkv_gateway_ttft_seconds", "Time from request to the first streamed token",
                 buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
RELAY = Histogram("pagedkv_gateway_relay_seconds", "Time from a scheduler message read to its SSE chunk written",
                  buckets=(1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.1))
IN_FLIGHT = Gauge("pagedkv_gateway_requests_in_flight", "Generation requests being answered")
DISCONNECTS = Counter("pagedkv_gateway_client_disconnects_total",
                      "Clients that went away before their answer ended (their gRPC calls were cancelled)")


# ---- the scheduler side ------------------------------------------------------------------------
class Upstream:
    """The gRPC channel to the scheduler(s) and what the gateway learns from them (the model's name)."""

    def __init__(self, address: str, tls_ca: str = "", tls_server_name: str = "",
                 served_names: tuple[str, ...] = ()) -> None:
        from pagedkv.client import Client

        self.client = Client(address, tls_ca=tls_ca, tls_server_name=tls_server_name)
        self.names: tuple[str, ...] = served_names  # empty: learned from ModelInfo on first use
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
        return info

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
    """The caller's Authorization header, passed to the scheduler as it came (it must be valid metadata)."""
    value = request.headers.get("authorization")
    if value is None:
        return ()
    if len(value) > MAX_AUTH_HEADER_CHARS or not all(0x20 <= ord(c) <= 0x7E for c in value):
        raise ApiError(401, f"Authorization: must be 'Bearer <key>' in printable ASCII, at most "
                       f"{MAX_AUTH_HEADER_CHARS} characters", code="invalid_api_key")
    return (("authorization", value),)


async def read_json(request: Request, limit: int):
    """The body as JSON, refused with 413 once it is longer than ``limit`` bytes (before it is parsed)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"request body: {declared} bytes; at most {limit} (--max-body-bytes)",
                       code="body_too_large")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise ApiError(413, f"request body: more than {limit} bytes (--max-body-bytes)", code="body_too_large")
    try:
        return json.loads(body)
    except ValueError as err:  # UnicodeDecodeError included
        raise ApiError(400, f"request body: not valid JSON ({err})") from None


# ---- generation --------------------------------------------------------------------------------
Event = tuple[int, "api.GenerateResponse | grpc.aio.AioRpcError | None"]  # (prompt index, message | error | end)


async def _one(call) -> AsyncIterator[Event]:
    while True:
        try:
            msg = await call.read()
        except grpc.aio.AioRpcError as err:
            yield 0, err
            return
        if msg is grpc.aio.EOF:
            yield 0, None
            return
        yield 0, msg


async def _merged(calls) -> AsyncIterator[Event]:
    """The calls' messages as they come, tagged with the call's index; each call ends with None or an error."""
    if len(calls) == 1:
        async for event in _one(calls[0]):
            yield event
        return
    queue: asyncio.Queue[Event] = asyncio.Queue()

    async def pump(i: int, call) -> None:
        async for _, item in _one(call):
            queue.put_nowait((i, item))

    tasks = [asyncio.ensure_future(pump(i, c)) for i, c in enumerate(calls)]
    try:
        ended = 0
        while ended < len(calls):
            event = await queue.get()
            if not isinstance(event[1], api.GenerateResponse):
                ended += 1
            yield event
    finally:
        for t in tasks:
            t.cancel()


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
        calls = [self.gw.upstream.client.stub.Generate(req, metadata=self.metadata) for req in self.plan.requests]
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
            for call in calls:
                call.cancel()
            await events.aclose()

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
                continue  # the first message may carry only usage.prompt_tokens; text may be held back
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

    async def _send_json(self, send, status: int, body: dict) -> None:
        self.status_code = status
        data = json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
                                (b"x-request-id", self.rid.encode())]})
        await send({"type": "http.response.body", "body": data})

    async def _send_error(self, send, err: ApiError) -> None:
        await self._send_json(send, err.status, err.body())


# ---- the app -----------------------------------------------------------------------------------
class Gateway:
    def __init__(self, upstream: Upstream, log, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                 max_streams: int = DEFAULT_MAX_STREAMS, token_text=None) -> None:
        self.upstream, self.log, self.token_text = upstream, log, token_text
        self.max_body_bytes, self.max_streams = max_body_bytes, max_streams
        self.active = 0

    def finished(self, gen: Generation) -> None:
        self.active -= 1
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
            body = await read_json(request, self.max_body_bytes)
            rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
            plan = oai.parse_chat(body, rid) if chat else oai.parse_completion(body, rid)
            plan.token_text = self.token_text
            model = await self.upstream.check_model(plan.model, metadata)
            if self.active >= self.max_streams:
                raise ApiError(429, f"this gateway is answering {self.active} requests, its limit "
                               "(--max-streams); retry later", code="too_many_requests")
        except ApiError as err:
            REQUESTS.labels(endpoint, str(err.status)).inc()
            self.log.info("request_refused", endpoint=endpoint, status=err.status, error=err.message)
            return JSONResponse(err.body(), status_code=err.status)
        self.active += 1
        return Generation(self, plan, rid, model, metadata, endpoint, started)

    async def completions(self, request: Request) -> Response:
        return await self.generate(request, chat=False)

    async def chat(self, request: Request) -> Response:
        return await self.generate(request, chat=True)

    async def models(self, request: Request) -> Response:
        try:
            info = await self.upstream.model_info(auth_metadata(request))
        except ApiError as err:
            return JSONResponse(err.body(), status_code=err.status)
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
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)


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
    p.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES, metavar="N",
                   help="longest request body, refused with 413 before it is parsed")
    p.add_argument("--max-streams", type=int, default=DEFAULT_MAX_STREAMS, metavar="N",
                   help="generation requests answered at once; more get 429")
    p.add_argument("--keep-alive-timeout", type=float, default=DEFAULT_KEEP_ALIVE_S, metavar="S",
                   help="seconds an idle HTTP/1.1 connection stays open; longer than clients' and load balancers' "
                   "own idle timeouts, so that they close first (a server closing first races a client reusing it)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM: seconds in-flight requests get to finish (new connections are refused)")
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
    if args.tls_cert:
        ca = os.environ.get("PAGEDKV_TLS_CA", "")
        if not ca:
            raise ValueError("--http-port with --tls-cert: set $PAGEDKV_TLS_CA to the CA certificate that signed "
                             "--tls-cert (pagedkv gen-certs writes it as ca.pem), so the gateway can verify the "
                             "scheduler")
        cmd += ["--tls-cert", args.tls_cert, "--tls-key", args.tls_key, "--tls-ca", ca]
    return cmd


async def serve(args) -> None:
    import uvicorn

    from pagedkv import logs
    from pagedkv.security import server_credentials, warn_if_exposed

    log = logs.configure("gateway", json=logs.wants_json(args.log_format))
    logging.getLogger("uvicorn.error").setLevel(logging.WARNING)  # gateway_ready / gateway_stopped say it
    tls = server_credentials(args.tls_cert, args.tls_key) is not None  # checks the pair now (clear errors)
    if args.max_body_bytes < 1024:
        raise ValueError(f"--max-body-bytes {args.max_body_bytes}: at least 1024")
    upstream = Upstream(args.address, args.tls_ca, args.tls_server_name, tuple(args.served_model_name))
    token_text = await asyncio.to_thread(load_token_text, args.tokenizer) if args.tokenizer else None
    gateway = Gateway(upstream, log, args.max_body_bytes, args.max_streams, token_text)
    app = create_app(gateway, on_shutdown=(upstream.close,))
    config = uvicorn.Config(app, host=args.host, port=args.port, http="httptools", lifespan="on", log_config=None,
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
