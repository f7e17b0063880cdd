"""One ``POST /v1/responses`` answered (``ResponsesGeneration``): the chat path's ``Generation`` (its Generate call,
disconnects, refusals as statuses), answered as a response object, or streamed as the Responses API's typed SSE
events (``event: <type>`` and ``data: {"type", "sequence_number", ...}``):

  response.created, response.in_progress
  per output item, in order: response.output_item.added, then
    a message:       response.content_part.added, response.output_text.delta ..., response.output_text.done,
                     response.content_part.done
    a function call: response.function_call_arguments.delta ..., response.function_call_arguments.done
  response.output_item.done; and last response.completed (response.incomplete when max_output_tokens or the
  context ran out), or an ``error`` event and response.failed.

The output is read with the chat path's tool-call parser (pagedkv/tool_calls.py) as it streams: text becomes a
message item, each call a function_call item; an item is done when the next begins."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable

import grpc

from pagedkv.gateway import json_pieces
from pagedkv.gateway import openai_responses as answers
from pagedkv.gateway.errors import ApiError, from_grpc
from pagedkv.gateway.metrics import RELAY, TTFT
from pagedkv.gateway.responses_api import (
    STATUS,
    ResponsesRequest,
    call_item,
    message_item,
    new_id,
    output_items,
    renamed,
    response_body,
    text_part,
    usage_of,
)
from pagedkv.gateway.streaming import Event, Generation, plan_headers
from pagedkv.tool_calls import ToolCallStream

FINAL_EVENT = {"completed": "response.completed", "incomplete": "response.incomplete", "failed": "response.failed"}


class EventWriter:
    """The typed events of one streamed response, numbered, and the output items they build."""

    def __init__(self) -> None:
        self.sequence = 0
        self.items: list[dict] = []
        self.open: dict | None = None  # the item being written (the last of items)
        self.calls: dict[int, dict] = {}  # a tool call's index (ToolCallStream's) -> its item

    def event(self, kind: str, **fields) -> bytes:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: ".encode() + json_pieces.dumps(data).encode() + b"\n\n"

    def text(self, delta: str, start: bool = False) -> list[bytes]:
        """A piece of text: a message item opened if none is (``start``: also without text)."""
        if not delta and not start:
            return []
        out = []
        if self.open is None or self.open["type"] != "message":
            out += self.close()
            self.open = message_item(new_id("msg"), "", "in_progress")
            self.open["content"] = [text_part("")]
            self.items.append(self.open)
            index = len(self.items) - 1
            out.append(self.event("response.output_item.added", output_index=index,
                                  item={**self.open, "content": []}))
            out.append(self.event("response.content_part.added", item_id=self.open["id"], output_index=index,
                                  content_index=0, part=text_part("")))
        if not delta:
            return out
        self.open["content"][0]["text"] += delta
        out.append(self.event("response.output_text.delta", item_id=self.open["id"], output_index=len(self.items) - 1,
                              content_index=0, delta=delta, logprobs=[]))
        return out

    def tool_calls(self, deltas: list[dict]) -> list[bytes]:
        """ToolCallStream's deltas: a new call (its id, name and first arguments), or more of a call's arguments."""
        out = []
        for d in deltas:
            index, piece = d["index"], d["function"].get("arguments", "")
            if "id" in d:
                out += self.close()
                hex_id = d["id"].rsplit("-", 1)[-1]
                item = call_item(f"fc_{hex_id}", f"call_{hex_id}", d["function"]["name"], "", "in_progress")
                self.items.append(item)
                self.open = self.calls[index] = item
                out.append(self.event("response.output_item.added", output_index=len(self.items) - 1, item=dict(item)))
            item = self.calls[index]
            if piece:
                item["arguments"] += piece
                out.append(self.event("response.function_call_arguments.delta", item_id=item["id"],
                                      output_index=self.items.index(item), delta=piece))
        return out

    def close(self, status: str = "completed") -> list[bytes]:
        """The open item's done events."""
        item, self.open = self.open, None
        if item is None:
            return []
        index = self.items.index(item)
        item["status"] = status
        if item["type"] == "message":
            part = item["content"][0]
            out = [self.event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                              text=part["text"], logprobs=[]),
                   self.event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                              part=part)]
        else:
            out = [self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                              name=item["name"], arguments=item["arguments"])]
        return out + [self.event("response.output_item.done", output_index=index, item=item)]


class ResponsesGeneration(Generation):
    """A Responses request against the scheduler (one Generate call, the chat path's); ``keep(response)`` stores a
    finished response and says whether it did (None: the request asked store: false)."""

    def __init__(self, client, finished: Callable[[Generation], None], req: ResponsesRequest, rid: str, model: str,
                 metadata, started: float, bound: int, keep: Callable[[dict], bool] | None) -> None:
        super().__init__(client, finished, req.plan, rid, model, metadata, "responses", started, bound)
        self.req, self.keep = req, keep
        self.created = answers.now()
        self.result: dict | None = None

    def _final(self, output: list[dict]) -> dict:
        c = self.choices[0]
        status = STATUS.get(c.finish_reason or "stop", "completed")
        error = {"code": "server_error", "message": "the request was aborted"} if status == "failed" else None
        return response_body(self.rid, self.created, self.model, self.req.echo, output, status,
                             usage_of(c.prompt_tokens, c.completion_tokens, c.cached_tokens), error, answers.now())

    def _stored(self, response: dict) -> dict:
        """``response`` after the store took it (or could not: store false)."""
        if self.keep is not None and response["status"] != "failed" and not self.keep(response):
            response["store"] = False
        return response

    def _answer(self) -> dict:
        message, _ = answers.chat_message(self.plan, self.choices[0], self.prompts[0].tool_call_format)
        self.result = self._final(output_items(message["content"], message["tool_calls"]))
        return self.result

    async def _send_chunks(self, send, status: int, chunks: list[bytes], headers: dict[str, str] | None = None) -> None:
        if status == 200 and self.result is not None:
            stored = self._stored(self.result)
            if stored["store"] is not self.req.echo["store"]:  # (not stored after all: said so)
                chunks = [json_pieces.dumps(stored).encode()]
        await super()._send_chunks(send, status, chunks, headers)

    async def _send_error(self, send, err: ApiError) -> None:
        await super()._send_error(send, renamed(err))

    async def _stream(self, send, first: list[Event], events: AsyncIterator[Event]) -> None:
        headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                   (b"x-accel-buffering", b"no"), *plan_headers(self.plan, self.rid)]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        out = EventWriter()
        progress = response_body(self.rid, self.created, self.model, self.req.echo, [], "in_progress")
        await self._body(send, out.event("response.created", response=progress)
                         + out.event("response.in_progress", response=progress))
        tools: ToolCallStream | None = None
        data: list[bytes] = []

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
                err = renamed(from_grpc(item.code(), item.details() or "", chat=True))
                self.status_code = err.status
                failed = response_body(self.rid, self.created, self.model, self.req.echo, out.items, "failed",
                                       error={"code": err.code or "server_error", "message": err.message})
                await self._body(send, out.event("error", code=err.code, message=err.message, param=err.param)
                                 + out.event("response.failed", response=failed), more=False)
                return
            self._add(i, item)
            final = bool(item.finish_reason)
            fmt = self.prompts[0].tool_call_format
            if fmt:
                if tools is None:
                    tools = ToolCallStream(fmt, self.plan.tool_function, self.plan.parallel_tool_calls)
                text, calls = tools.feed(item.text, final=final)
            else:
                text, calls = item.text, []
            data = out.text(text) + out.tool_calls(calls)
            if item.token_ids and not self.streamed_a_token:
                self.streamed_a_token = True
                TTFT.observe(time.perf_counter() - self.started)
            if final:
                break
            if data:
                await self._body(send, b"".join(data))
                RELAY.observe(time.perf_counter() - read_at)
        status = STATUS.get(self.choices[0].finish_reason or "stop", "completed")
        if not out.items:  # (nothing written: an empty message, as the non-streamed answer has)
            data += out.text("", start=True)
        data += out.close("incomplete" if status == "incomplete" else "completed")
        response = self._stored(self._final(out.items))
        await self._body(send, b"".join(data) + out.event(FINAL_EVENT[response["status"]], response=response),
                         more=False)
