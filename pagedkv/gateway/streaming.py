"""One OpenAI request answered against the scheduler inside the ASGI call (``Generation``): its Generate calls'
messages merged as they come, and written as one JSON body or as SSE chunks."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import AsyncIterator, Callable

import grpc
from starlette.responses import Response

from pagedkv.api.v1 import api_pb2 as api
from pagedkv.gateway import json_pieces
from pagedkv.gateway import openai_responses as answers
from pagedkv.gateway.errors import ApiError, from_grpc
from pagedkv.gateway.fields import IGNORED_FIELDS_HEADER, ignored_header
from pagedkv.gateway.metrics import DISCONNECTS, IN_FLIGHT, RELAY, TTFT
from pagedkv.gateway.openai_requests import Plan
from pagedkv.tool_calls import ToolCallStream

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


def plan_headers(plan: Plan, rid: str) -> list[tuple[bytes, bytes]]:
    """X-Request-Id (the client's, else the answer's id), and the unknown fields the request had."""
    headers = [(b"x-request-id", (plan.client_id or rid).encode())]
    if plan.screened and plan.screened.unknown:
        headers.append((IGNORED_FIELDS_HEADER.encode(), ignored_header(plan.screened.unknown).encode()))
    return headers


def _text_chars(chunk: dict) -> int:
    return len(chunk["choices"][0].get("text", ""))


def _sse(obj) -> bytes:
    return b"data: " + json_pieces.dumps(obj).encode() + b"\n\n"


class Generation(Response):
    """Runs one OpenAI request against the scheduler inside the ASGI call, so that it sees the client go away:
    a disconnect cancels the gRPC calls. The HTTP status waits for every call's first message (or its error),
    so refusals (400/401/429/503) arrive as statuses even when streaming. ``client``: the scheduler's
    (pagedkv.client.Client); ``finished(self)`` is called once it is over, whatever happened."""

    def __init__(self, client, finished: Callable[[Generation], None], plan: Plan, rid: str, model: str, metadata,
                 endpoint: str, started: float, bound: int = 0) -> None:
        """``bound``: the most bytes the answer can take (response_budget.estimate): above json_pieces.INLINE_BYTES
        it is built and encoded off the event loop."""
        self.client, self.finished = client, finished
        self.plan, self.rid, self.model, self.metadata = plan, rid, model, metadata
        self.bound = bound
        self.endpoint, self.started = endpoint, started
        self.status_code = 200
        self.background = None
        self.choices = [answers.Choice() for _ in range(plan.num_choices)]
        self.prompts = [api.Prompt() for _ in plan.requests]  # what each call said of its prompt (GenerateResponse)
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
            self.finished(self)

    async def _run(self, send) -> None:
        # (each a Generate call, resumed on another call if its scheduler goes away: pagedkv.client)
        calls = [self.client.stream(req, metadata=self.metadata) for req in self.plan.requests]
        merged = _merged(calls)
        events = self._noted(merged)
        try:
            first: list[Event] = []
            waiting = set(range(len(calls)))
            async for i, item in events:
                if isinstance(item, grpc.aio.AioRpcError):
                    err = from_grpc(item.code(), item.details() or "", chat=self.plan.chat)
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
                        err = from_grpc(item.code(), item.details() or "", chat=self.plan.chat)
                        return await self._send_error(send, err)
                    first.append((i, item))
                for i, item in first:
                    if item is not None:
                        self._add(i, item)
                _, chunks = await json_pieces.encoded(self._answer, self.bound)
                await self._send_chunks(send, 200, chunks)
        finally:
            await events.aclose()
            await merged.aclose()  # (closing the wrapper leaves the merged streams open)
            for call in calls:
                await call.aclose()  # (a call still open is cancelled)

    def _answer(self) -> dict:
        """The non-streamed answer, once every call has ended (a subclass answers in another shape)."""
        return answers.response_body(self.plan, self.rid, answers.now(), self.model, self.choices, self.prompts,
                                     lazy=True)

    async def _noted(self, events: AsyncIterator[Event]) -> AsyncIterator[Event]:
        """The events, each call's word on its prompt (GenerateResponse.prompt, on its first message and with the
        prompt's log-probabilities) kept as it passes (a resumed call's first message adds its size again only)."""
        async for i, item in events:
            if isinstance(item, api.GenerateResponse) and item.HasField("prompt"):
                self.prompts[i].MergeFrom(item.prompt)
            yield i, item

    def _add(self, i: int, msg: api.GenerateResponse) -> int:
        index = i * self.plan.n + msg.index
        self.choices[index].add(msg)
        return index

    async def _stream(self, send, first: list[Event], events: AsyncIterator[Event]) -> None:
        headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                   (b"x-accel-buffering", b"no"), *plan_headers(self.plan, self.rid)]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        plan, created = self.plan, answers.now()
        if plan.chat:
            for index in range(plan.num_choices):
                usage = answers.choice_usage(self.prompts[index // plan.n], self.choices[index])
                await self._body(send, _sse(answers.chunk_body(plan, self.rid, created, self.model, index, None,
                                                           role=True, usage=usage if plan.continuous_usage else None)))

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
                err = from_grpc(item.code(), item.details() or "", chat=plan.chat)
                self.status_code = err.status
                await self._body(send, _sse(err.body()) + b"data: [DONE]\n\n", more=False)
                return
            index = self._add(i, item)
            choice = self.choices[index]
            finish = choice.finish_reason if item.finish_reason else None
            echo = self.prompts[i] if plan.echo and not choice.echoed and (item.token_ids or finish) else None
            text, calls = item.text, None
            fmt = self.prompts[i].tool_call_format if plan.chat else ""
            if fmt:  # (its text read into tool calls as it comes: content and tool_calls deltas)
                if choice.tools is None:
                    choice.tools = ToolCallStream(fmt, plan.tool_function, plan.parallel_tool_calls)
                text, calls = choice.tools.feed(item.text, final=finish is not None)
                finish = answers.tool_finish(finish, choice.tools.called)
            # A completion's first token gets its chunk even when its text is held back (as vLLM's, which sends a
            # chunk per token): time to first token is the first token's, not the first complete character's.
            # (A chat's role chunk went out with the first token already.)
            first = not plan.chat and item.token_ids and len(choice.token_ids) == len(item.token_ids)
            if not (text or calls or finish or echo or first or (plan.logprobs and item.token_ids)):
                continue  # text may be held back (a stop string may start there, a character is not complete)
            if item.token_ids and not self.streamed_a_token:
                self.streamed_a_token = True
                TTFT.observe(time.perf_counter() - self.started)
            usage = answers.choice_usage(self.prompts[i], choice) if plan.continuous_usage else None
            chars, data = await json_pieces.encoded(functools.partial(  # (an echo may be large: off the loop)
                answers.chunk_body, plan, self.rid, created, self.model, index, text, item.token_ids, item.logprobs,
                finish, tops=item.top_logprobs, echo=echo, offset=choice.streamed_chars, usage=usage,
                tool_call_deltas=calls), self.bound if echo is not None else 0, _text_chars)
            choice.echoed = choice.echoed or echo is not None
            choice.streamed_chars += chars
            await self._body(send, b"data: " + b"".join(data) + b"\n\n")
            RELAY.observe(time.perf_counter() - read_at)
        tail = b""
        if plan.include_usage:
            tail = _sse(answers.usage_chunk(plan, self.rid, created, self.model, self.choices))
        await self._body(send, tail + b"data: [DONE]\n\n", more=False)

    @staticmethod
    async def _body(send, data: bytes, more: bool = True) -> None:
        await send({"type": "http.response.body", "body": data, "more_body": more})

    async def _send_chunks(self, send, status: int, chunks: list[bytes], headers: dict[str, str] | None = None) -> None:
        """A JSON body given as chunks (json_pieces.encode), each dropped once sent."""
        self.status_code = status
        size = sum(len(c) for c in chunks)
        extra = [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(size).encode()),
                                *plan_headers(self.plan, self.rid), *extra]})
        chunks.reverse()
        while chunks:
            await self._body(send, chunks.pop(), more=bool(chunks))

    async def _send_error(self, send, err: ApiError) -> None:
        await self._send_chunks(send, err.status, [json_pieces.dumps(err.body()).encode()], err.headers())
