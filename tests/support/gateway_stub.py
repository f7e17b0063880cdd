"""The HTTP gateway's ASGI app without processes: a scripted scheduler stub (FakeUpstream: each Generate call reads
the next script of messages, errors and pauses), the gateway's kept log lines, one HTTP request through the app
(asgi), and the request and message builders the gateway's unit tests share (tests/unit/test_gateway_*.py)."""

from __future__ import annotations

import asyncio
import json

import grpc

from pagedkv.api.v1 import api_pb2 as api
from pagedkv.gateway.app import Gateway, create_app
from pagedkv.gateway.errors import ApiError
from pagedkv.gateway.openai_requests import parse_chat, parse_completion
from pagedkv.resumable_stream import resumable_generate
from pagedkv.resume_policy import ResumePolicy

BASE = {False: {"model": "m", "prompt": "hi"}, True: {"model": "m", "messages": [{"role": "user", "content": "hi"}]}}


def parse(chat: bool, **extra):
    body = {**BASE[chat], **extra}
    return (parse_chat if chat else parse_completion)(body, "r")


def first_request(plan):
    return plan.requests[0]


def msg(index=0, text="", ids=(), lps=(), finish=0, prompt=0, completion=0, cached=0) -> api.GenerateResponse:
    m = api.GenerateResponse(request_id="r", text=text, token_ids=list(ids), logprobs=list(lps), index=index,
                             finish_reason=finish)
    if finish:
        m.usage.CopyFrom(api.Usage(prompt_tokens=prompt, completion_tokens=completion, cached_tokens=cached))
    return m


def seeded(m: api.GenerateResponse, seed: int) -> api.GenerateResponse:
    m.seed = seed
    return m


# ---- the ASGI app against a scripted stub -------------------------------------------------------
class FakeCall:
    def __init__(self, script) -> None:
        self.script = list(script)  # GenerateResponse | AioRpcError | float (sleep)
        self.cancelled = False

    async def read(self):
        while self.script:
            item = self.script.pop(0)
            if isinstance(item, float):
                await asyncio.sleep(item)
                continue
            if isinstance(item, Exception):
                raise item
            return item
        return grpc.aio.EOF

    def cancel(self) -> bool:
        self.cancelled = True
        return True


class FakeUpstream:
    def __init__(self, *scripts, resume: ResumePolicy | None = None) -> None:
        self.scripts = list(scripts)
        self.calls: list[FakeCall] = []
        self.requests: list[api.GenerateRequest] = []
        self.metadata = []
        self.client = self
        self.stub = self
        self.names = ("m",)
        self.max_logprobs = 20
        self.resume = resume  # (None: each script is the call's whole story)

    def stream(self, req, metadata):
        """As pagedkv.client.Client.stream: the calls' messages, resumed on the next script as ``resume`` says."""
        return resumable_generate(self, req, metadata, self.resume)

    def Generate(self, req, metadata):  # noqa: N802
        self.requests.append(req)
        self.metadata.append(metadata)
        call = FakeCall(self.scripts.pop(0))
        self.calls.append(call)
        return call

    async def check_model(self, name, metadata):
        if name != "m":
            raise ApiError(404, f"model: {name!r}", param="model", code="model_not_found")
        return name

    async def select_model(self, name, metadata):
        """As Upstream.select_model: an adapter's name in ``adapters`` (set by a test) selects it."""
        if name in getattr(self, "adapters", ()):
            return name, name
        return await self.check_model(name, metadata), ""

    async def learned_max_model_len(self, metadata):
        return 2048


class Log:
    """The gateway's structlog logger, kept: (level, event, fields) per line."""

    def __init__(self) -> None:
        self.lines: list[tuple[str, str, dict]] = []

    def info(self, event: str, **kw) -> None:
        self.lines.append(("info", event, kw))

    def warning(self, event: str, **kw) -> None:
        self.lines.append(("warning", event, kw))

    def debug(self, event: str, **kw) -> None:
        self.lines.append(("debug", event, kw))


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


async def asgi(app, path: str, body: bytes, headers=(), disconnect_after: float | None = None, method: str = "POST"):
    """One HTTP request through the app; returns (status, headers, body bytes)."""
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": method, "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
             "root_path": "", "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80),
             "headers": [(b"content-type", b"application/json"), *headers]}
    sent: list[dict] = []
    delivered = False

    async def receive():
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        if disconnect_after is None:
            await asyncio.Event().wait()
        await asyncio.sleep(disconnect_after)
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    await asyncio.wait_for(app(scope, receive, send), 10)
    start = next((m for m in sent if m["type"] == "http.response.start"), {"status": None, "headers": []})
    data = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], dict(start["headers"]), data


def app(upstream, **kw):
    return create_app(Gateway(upstream, Log(), **kw))


def body(**fields) -> bytes:
    return json.dumps({"model": "m", "prompt": "hi", **fields}).encode()
