"""The gateway's guards on what a client sends, before any work is done: the HTTP request head and the time to send
it and the body (``bounded_protocol``, in the HTTP protocol, before the parser), and the body's size and JSON
nesting before it is parsed (``read_json``)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from http import HTTPStatus

from starlette.requests import ClientDisconnect, Request

from pagedkv.gateway.errors import ApiError
from pagedkv.gateway.metrics import HTTP_BOUNDS
from pagedkv.gateway.request_limits import RequestLimits
from pagedkv.json_bounds import nests_deeper_than

DEFAULT_MAX_HEADER_BYTES = 64 << 10
DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_BODY_TIMEOUT_S = 30.0
MAX_JSON_DEPTH = 64  # arrays and objects in a request body; OpenAI's bodies nest 4 deep


def _body_too_large(size: str, limits: RequestLimits, param: str) -> ApiError:
    return ApiError(413, f"request body: {size} bytes; at most {limits.body_bytes} (--max-body-bytes; by default "
                    f"the scheduler's request limit: {limits.describe()})", param=param, code="body_too_large")


async def read_json(request: Request, limits: RequestLimits, param: str):
    """The body as JSON: refused with 413 once it is longer than ``limits.body_bytes`` (from Content-Length, or
    while reading: before it is parsed), with 400 when it nests deeper than MAX_JSON_DEPTH (before json.loads
    recurses). ``param``: what the body mostly carries (prompt or messages), named in the 413."""
    return await read_bounded_json(request, limits.body_bytes, lambda size: _body_too_large(size, limits, param))


async def read_bounded_json(request: Request, max_bytes: int, too_large: Callable[[str], ApiError]):
    """``read_json``'s reading for any bound: ``too_large`` makes the 413 from the size seen ("N", or "more than
    N" while reading)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise too_large(declared)
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > max_bytes:
                raise too_large(f"more than {max_bytes}")
    except ClientDisconnect:  # gone, or closed by --body-timeout: this answer goes nowhere
        raise ApiError(499, "request body: the connection closed before all of it came") from None
    if nests_deeper_than(body, MAX_JSON_DEPTH):
        raise ApiError(400, f"request body: JSON nested more than {MAX_JSON_DEPTH} levels deep (arrays and "
                       f"objects); at most {MAX_JSON_DEPTH}", code="body_too_deep")
    try:
        return json.loads(body)
    except ValueError as err:  # UnicodeDecodeError included
        raise ApiError(400, f"request body: not valid JSON ({err})") from None


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
