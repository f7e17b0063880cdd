"""An upstream answer relayed by the edge (edge.py) inside the ASGI call (``Relay``): its bytes sent as they come,
each waiting for the client to take the one before, at most --max-response-bytes (an SSE stream cut between two
events, with an error event first), the upstream's answer closed and the request counted however it ends (the
client gone: 499)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import TYPE_CHECKING

import httpx
from starlette.responses import Response

from pagedkv.gateway.errors import ApiError

if TYPE_CHECKING:
    from pagedkv.gateway.edge import Edge
    from pagedkv.tenancy import Tenant


class Relay(Response):
    """An upstream answer relayed inside the ASGI call, so that it sees the client go: its bytes sent as they come
    (each waits for the client to take the one before: nothing piles up here), at most --max-response-bytes (past
    it the relay ends; an SSE stream gets an error event first); the upstream's answer closed however it ends."""

    def __init__(self, edge: Edge, answer: httpx.Response, headers: list[tuple[str, str]], endpoint: str,
                 started: float, tenant: Tenant) -> None:
        self.edge, self.answer, self.endpoint, self.started, self.tenant = edge, answer, endpoint, started, tenant
        self.status_code = answer.status_code
        self.raw = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers]
        self.sse = answer.headers.get("content-type", "").startswith("text/event-stream")
        self.background = None
        self.ended = False

    async def _end(self, status: int) -> None:
        """The upstream closed and the relay counted, once (before the client has the last byte: a client's next
        request finds its stream free)."""
        if not self.ended:
            self.ended = True
            await self.answer.aclose()
            self.edge.finished(self.endpoint, status, self.started, self.tenant)

    async def __call__(self, scope, receive, send) -> None:
        async def client_gone() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass

        watcher = asyncio.ensure_future(client_gone())
        work = asyncio.ensure_future(self._pump(send))
        status = self.status_code
        try:
            await asyncio.wait({watcher, work}, return_when=asyncio.FIRST_COMPLETED)
            if not work.done():
                status = 499
                work.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await work
        finally:
            watcher.cancel()
            work.cancel()  # (this call itself cancelled: the server is stopping)
            await self._end(status)

    async def _pump(self, send) -> None:
        """Sends the answer; counted 502 when it was cut (its bound, or the upstream broke off). An SSE answer goes
        event by event (what of an event has come waits for its end, within the bound), so a cut falls between two
        events and its error event reads as one."""
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw})
        edge, sent, cut, pending = self.edge, 0, None, bytearray()
        try:
            async for chunk in self.answer.aiter_raw():
                pending += chunk
                ready = sse_events_end(pending) if self.sse else len(pending)
                if sent + (ready or len(pending)) > edge.max_response_bytes:
                    # the whole events that still fit go first (a chunk may carry many: read late, under load)
                    room = edge.max_response_bytes - sent
                    fits = sse_events_end(pending[:room]) if self.sse else room
                    if fits > 0:
                        await send({"type": "http.response.body", "body": bytes(pending[:fits]), "more_body": True})
                    cut = 502
                    await self._cut(send)
                    break
                if ready:
                    sent += ready
                    await send({"type": "http.response.body", "body": bytes(pending[:ready]), "more_body": True})
                    del pending[:ready]
            else:
                if pending:  # (an SSE answer's last bytes, without the blank line that ends an event)
                    await send({"type": "http.response.body", "body": bytes(pending), "more_body": True})
        except httpx.HTTPError as err:
            cut = 502
            edge.log.warning("edge_upstream_broke", endpoint=self.endpoint, tenant=self.tenant.id,
                             error=type(err).__name__)
        await self._end(cut or self.status_code)
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _cut(self, send) -> None:
        edge = self.edge
        edge.log.warning("edge_answer_cut", endpoint=self.endpoint, tenant=self.tenant.id,
                         max_response_bytes=edge.max_response_bytes)
        if self.sse:
            error = ApiError(502, f"the answer passed this gateway's --max-response-bytes ({edge.max_response_bytes})"
                             "; it was cut here")
            await send({"type": "http.response.body", "more_body": True,
                        "body": b"data: " + json.dumps(error.body()).encode() + b"\n\n"})


def sse_events_end(data: bytearray) -> int:
    """How many of ``data``'s bytes are whole SSE events (up to the last blank line, LF or CRLF); 0: none."""
    lf, crlf = data.rfind(b"\n\n"), data.rfind(b"\r\n\r\n")
    return max(lf + 2 if lf >= 0 else 0, crlf + 4 if crlf >= 0 else 0)
