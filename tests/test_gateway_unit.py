"""The HTTP gateway without processes: OpenAI request -> GenerateRequest translation, refusals that name the
field, gRPC status -> HTTP status, response and chunk bodies, and the ASGI app itself against a scripted
scheduler stub (body bound before parsing, 429 at --max-streams, a disconnect cancels the gRPC call, an error
mid-stream becomes an SSE error event)."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest

from pagedkv import gateway_openai as oai
from pagedkv.api.v1 import api_pb2 as api
from pagedkv.gateway import Gateway, create_app
from pagedkv.gateway_openai import ApiError


# ---- translation -------------------------------------------------------------------------------
def test_completion_fields_map_to_the_generate_request():
    plan = oai.parse_completion({"model": "m", "prompt": "Hi", "max_tokens": 7, "temperature": 0.5, "top_p": 0.9,
                                 "top_k": 40, "seed": 3, "stop": ["\n", "END"], "n": 2, "logprobs": 0,
                                 "user": "u1", "priority": -5, "page_budget": 12, "ignore_eos": True,
                                 "stop_token_ids": [2]}, "cmpl-1")
    (req,) = plan.requests
    s = req.sampling
    assert req.text == "Hi" and req.request_id == "cmpl-1" and req.priority == -5 and req.page_budget == 12
    assert (s.max_tokens, s.top_k, s.seed, s.n, list(s.stop), list(s.stop_token_ids)) == (7, 40, 3, 2, ["\n", "END"],
                                                                                           [2])
    assert s.temperature == pytest.approx(0.5) and s.top_p == pytest.approx(0.9)
    assert s.logprobs and s.ignore_eos and plan.logprobs and plan.user == "u1" and plan.num_choices == 2


def test_unset_sampling_stays_unset_and_completion_defaults_to_16_tokens():
    plan = oai.parse_completion({"model": "m", "prompt": [1, 2, 3]}, "r")
    s = plan.requests[0].sampling
    assert list(plan.requests[0].token_ids.ids) == [1, 2, 3] and s.max_tokens == oai.DEFAULT_COMPLETION_MAX_TOKENS
    assert not any(s.HasField(f) for f in ("temperature", "top_p", "top_k", "seed"))  # the checkpoint's defaults
    assert not s.logprobs and not plan.logprobs
    chat = oai.parse_chat({"model": "m", "messages": [{"role": "user", "content": "x"}]}, "r")
    assert chat.requests[0].sampling.max_tokens == 0  # chat: up to the context


def test_several_prompts_are_several_requests():
    plan = oai.parse_completion({"model": "m", "prompt": ["a", "b", [5, 6]], "n": 2}, "r")
    assert [r.WhichOneof("prompt") for r in plan.requests] == ["text", "text", "token_ids"]
    assert [r.request_id for r in plan.requests] == ["r-0", "r-1", "r-2"] and plan.num_choices == 6


def test_chat_messages_and_max_completion_tokens():
    plan = oai.parse_chat({"model": "m", "max_tokens": 5, "max_completion_tokens": 9, "top_k": -1,
                           "messages": [{"role": "developer", "content": "be brief"},
                                        {"role": "user", "content": [{"type": "text", "text": "a"},
                                                                     {"type": "text", "text": "b"}]}],
                           "logprobs": True, "top_logprobs": 0, "seed": -1}, "chatcmpl-1")
    req = plan.requests[0]
    assert [(m.role, m.content) for m in req.chat.messages] == [("system", "be brief"), ("user", "ab")]
    assert req.sampling.max_tokens == 9 and req.sampling.top_k == 0 and req.sampling.seed == 2**64 - 1
    assert plan.chat and plan.logprobs and not req.chat.HasField("add_generation_prompt")


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x"}, "model"),
    ({"model": "m"}, "prompt"),
    ({"model": "m", "prompt": [[1], "a", {}]}, "prompt"),
    ({"model": "m", "prompt": ["x"] * (oai.MAX_PROMPTS + 1)}, "prompt"),
    ({"model": "m", "prompt": "x", "temperature": 2.5}, "temperature"),
    ({"model": "m", "prompt": "x", "temperature": "hot"}, "temperature"),
    ({"model": "m", "prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"model": "m", "prompt": "x", "n": True}, "n"),
    ({"model": "m", "prompt": "x", "logprobs": 3}, "logprobs"),
    ({"model": "m", "prompt": "x", "presence_penalty": 0.5}, "presence_penalty"),
    ({"model": "m", "prompt": "x", "echo": True}, "echo"),
    ({"model": "m", "prompt": "x", "best_of": 3}, "best_of"),
    ({"model": "m", "prompt": "x", "stop": [1]}, "stop"),
    ({"model": "m", "prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"model": "m", "prompt": "x", "user": "u" * 300}, "user"),
    ({"model": "m", "prompt": "x", "page_budget": -1}, "page_budget"),
])
def test_completion_refusals_name_the_field(body, param):
    with pytest.raises(ApiError) as e:
        oai.parse_completion(body, "r")
    assert e.value.status == 400 and e.value.param == param and e.value.message.startswith(param)


@pytest.mark.parametrize("body, param", [
    ({"model": "m", "messages": []}, "messages"),
    ({"model": "m", "messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0]"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}},
     "response_format"),
])
def test_chat_refusals_name_the_field(body, param):
    with pytest.raises(ApiError) as e:
        oai.parse_chat(body, "r")
    assert e.value.status == 400 and e.value.param == param


@pytest.mark.parametrize("code, status", [
    (grpc.StatusCode.INVALID_ARGUMENT, 400), (grpc.StatusCode.FAILED_PRECONDITION, 400),
    (grpc.StatusCode.UNAUTHENTICATED, 401), (grpc.StatusCode.NOT_FOUND, 404), (grpc.StatusCode.ALREADY_EXISTS, 409),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, 429), (grpc.StatusCode.UNAVAILABLE, 503),
    (grpc.StatusCode.DEADLINE_EXCEEDED, 504), (grpc.StatusCode.INTERNAL, 500), (grpc.StatusCode.UNKNOWN, 500),
])
def test_grpc_status_maps_to_http(code, status):
    err = oai.from_grpc(code, "details")
    assert err.status == status and err.body()["error"]["message"] == "details"
    assert set(err.body()["error"]) == {"message", "type", "param", "code"}


def test_scheduler_field_names_become_openai_params():
    assert oai.from_grpc(grpc.StatusCode.INVALID_ARGUMENT, "sampling.temperature: -1; must be").param == "temperature"
    assert oai.from_grpc(grpc.StatusCode.INVALID_ARGUMENT, "sampling.n: 20; must be").param == "n"
    assert oai.from_grpc(grpc.StatusCode.INVALID_ARGUMENT, "prompt: 900 tokens; must").param == "prompt"
    assert oai.from_grpc(grpc.StatusCode.INVALID_ARGUMENT, "prompt.chat.messages[0].role: x", chat=True
                         ).param == "messages"
    assert oai.from_grpc(grpc.StatusCode.INVALID_ARGUMENT, "priority: 5000; must").param == "priority"
    assert oai.from_grpc(grpc.StatusCode.INVALID_ARGUMENT, "no field here").param is None


def _msg(index=0, text="", ids=(), lps=(), finish=0, prompt=0, completion=0, cached=0) -> api.GenerateResponse:
    m = api.GenerateResponse(request_id="r", text=text, token_ids=list(ids), logprobs=list(lps), index=index,
                             finish_reason=finish)
    if finish:
        m.usage.CopyFrom(api.Usage(prompt_tokens=prompt, completion_tokens=completion, cached_tokens=cached))
    return m


def test_response_bodies_count_the_prompt_once_per_prompt():
    plan = oai.parse_completion({"model": "m", "prompt": ["a", "b"], "n": 2, "logprobs": 0}, "r")
    choices = [oai.Choice() for _ in range(4)]
    for i, c in enumerate(choices):
        c.add(_msg(text=f"t{i}", ids=[i], lps=[-0.5]))
        c.add(_msg(finish=api.FINISH_REASON_LENGTH if i else api.FINISH_REASON_STOP, prompt=3 + i // 2,
                   completion=1, cached=1))
    body = oai.response_body(plan, "r", 1, "m", choices)
    assert body["usage"] == {"prompt_tokens": 7, "completion_tokens": 4, "total_tokens": 11,
                             "prompt_tokens_details": {"cached_tokens": 2}}
    assert [c["finish_reason"] for c in body["choices"]] == ["stop", "length", "length", "length"]
    assert body["choices"][1]["logprobs"]["tokens"] == ["token_id:1"]
    assert body["choices"][1]["logprobs"]["token_logprobs"] == [-0.5]


def test_chat_chunks_have_openai_shape():
    plan = oai.parse_chat({"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": True,
                           "stream_options": {"include_usage": True}}, "c")
    role = oai.chunk_body(plan, "c", 1, "m", 0, None, role=True)
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""} and role["usage"] is None
    last = oai.chunk_body(plan, "c", 1, "m", 0, "", finish_reason="stop")
    assert last["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}
    assert last["object"] == "chat.completion.chunk"


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
    def __init__(self, *scripts) -> None:
        self.scripts = list(scripts)
        self.calls: list[FakeCall] = []
        self.requests: list[api.GenerateRequest] = []
        self.metadata = []
        self.client = self
        self.stub = self
        self.names = ("m",)

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


class Log:
    def info(self, *a, **k) -> None:
        pass


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


async def asgi(app, path: str, body: bytes, headers=(), disconnect_after: float | None = None):
    """One HTTP request through the app; returns (status, headers, body bytes)."""
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
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


def _app(upstream, **kw):
    return create_app(Gateway(upstream, Log(), **kw))


def _body(**fields) -> bytes:
    return json.dumps({"model": "m", "prompt": "hi", **fields}).encode()


def test_app_streams_chunks_usage_and_done():
    up = FakeUpstream([_msg(), _msg(text="a", ids=[5]), _msg(text="b", ids=[6], finish=api.FINISH_REASON_LENGTH,
                                                            prompt=2, completion=2)])
    status, headers, data = asyncio.run(asgi(_app(up), "/v1/completions",
                                             _body(stream=True, stream_options={"include_usage": True}),
                                             headers=[(b"authorization", b"Bearer k")]))
    assert status == 200 and headers[b"content-type"].startswith(b"text/event-stream")
    events = [e.removeprefix(b"data: ") for e in data.split(b"\n\n") if e]
    assert events[-1] == b"[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert [c["choices"][0]["text"] for c in chunks[:-1]] == ["a", "b"]
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] == 4
    assert up.metadata == [(("authorization", "Bearer k"),)]


def test_app_refuses_a_large_body_before_reading_it():
    up = FakeUpstream()
    status, _, data = asyncio.run(asgi(_app(up, max_body_bytes=2048), "/v1/completions", b"{}",
                                       headers=[(b"content-length", b"999999")]))
    assert status == 413 and b"--max-body-bytes" in data and not up.requests
    status, _, data = asyncio.run(asgi(_app(up, max_body_bytes=2048), "/v1/completions", b"x" * 4096))
    assert status == 413 and not up.requests
    status, _, data = asyncio.run(asgi(_app(up), "/v1/completions", b"{not json"))
    assert status == 400 and json.loads(data)["error"]["type"] == "invalid_request_error"


def test_app_maps_statuses_and_limits_streams():
    up = FakeUpstream([rpc_error(grpc.StatusCode.UNAUTHENTICATED, "no key")],
                      [rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED, "tenant over its limits")],
                      [rpc_error(grpc.StatusCode.UNAVAILABLE, "no executor is up")])
    for want in (401, 429, 503):
        status, _, data = asyncio.run(asgi(_app(up), "/v1/completions", _body(stream=True)))
        assert status == want and json.loads(data)["error"]["message"]
    status, _, data = asyncio.run(asgi(_app(up), "/v1/completions", _body(model="other")))
    assert status == 404 and json.loads(data)["error"]["code"] == "model_not_found"
    status, _, data = asyncio.run(asgi(_app(FakeUpstream(), max_streams=0), "/v1/completions", _body()))
    assert status == 429 and "--max-streams" in json.loads(data)["error"]["message"]
    status, _, data = asyncio.run(asgi(_app(up), "/v1/nothing", b"{}"))
    assert status == 404 and "no such endpoint" in json.loads(data)["error"]["message"]


def test_app_disconnect_cancels_the_grpc_call():
    up = FakeUpstream([_msg(text="a", ids=[1]), 30.0, _msg(text="never", ids=[2], finish=1)])
    status, _, data = asyncio.run(asgi(_app(up), "/v1/completions", _body(stream=True), disconnect_after=0.2))
    assert status == 200 and b"never" not in data and up.calls[0].cancelled
    up = FakeUpstream([30.0, _msg(text="never", ids=[2], finish=1)])  # not streaming, nothing sent yet
    status, _, _ = asyncio.run(asgi(_app(up), "/v1/completions", _body(), disconnect_after=0.2))
    assert status is None and up.calls[0].cancelled  # nothing was sent to a client that left


def test_app_error_mid_stream_is_an_sse_error_event():
    up = FakeUpstream([_msg(text="a", ids=[1]), rpc_error(grpc.StatusCode.UNAVAILABLE, "executor lost")])
    status, _, data = asyncio.run(asgi(_app(up), "/v1/chat/completions", json.dumps(
        {"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": True}).encode()))
    events = [e.removeprefix(b"data: ") for e in data.split(b"\n\n") if e]
    assert status == 200 and events[-1] == b"[DONE]"
    assert json.loads(events[-2])["error"]["message"] == "executor lost"
    assert json.loads(events[0])["choices"][0]["delta"]["role"] == "assistant"


def test_app_merges_several_prompts_by_choice_index():
    up = FakeUpstream([0.05, _msg(index=1, text="p0f1", ids=[1], finish=1, prompt=1, completion=1),
                       _msg(index=0, text="p0f0", ids=[1], finish=1, prompt=1, completion=1)],
                      [_msg(index=0, text="p1f0", ids=[1], finish=1, prompt=2, completion=1),
                       _msg(index=1, text="p1f1", ids=[1], finish=1, prompt=2, completion=1)])
    status, _, data = asyncio.run(asgi(_app(up), "/v1/completions", _body(prompt=["a", "b"], n=2)))
    body = json.loads(data)
    assert status == 200 and [c["text"] for c in body["choices"]] == ["p0f0", "p0f1", "p1f0", "p1f1"]
    assert body["usage"]["prompt_tokens"] == 3 and body["usage"]["completion_tokens"] == 4


# ---- serve's gateway child and the HTTP health probe --------------------------------------------
def test_serve_child_command(monkeypatch):
    import argparse

    from pagedkv.gateway import serve_child_command

    args = argparse.Namespace(http_port=0, host="0.0.0.0", port=50051, shutdown_timeout=30.0, log_format="json",
                              tls_cert="", tls_key="")
    assert serve_child_command(args) is None
    args.http_port = 8000
    cmd = serve_child_command(args)
    assert cmd[cmd.index("--address") + 1] == "127.0.0.1:50051" and cmd[cmd.index("--port") + 1] == "8000"
    assert "--tls-cert" not in cmd
    args.tls_cert, args.tls_key = "s.pem", "s.key"
    monkeypatch.delenv("PAGEDKV_TLS_CA", raising=False)
    with pytest.raises(ValueError, match="PAGEDKV_TLS_CA"):
        serve_child_command(args)
    monkeypatch.setenv("PAGEDKV_TLS_CA", "ca.pem")
    cmd = serve_child_command(args)
    assert [cmd[cmd.index(f) + 1] for f in ("--tls-cert", "--tls-key", "--tls-ca")] == ["s.pem", "s.key", "ca.pem"]


def test_check_http_refuses_what_is_not_an_http_url():
    from pagedkv.gateway import check_http

    with pytest.raises(ValueError, match="--http"):
        check_http("127.0.0.1:8000/health")
    ok, said = check_http(f"http://127.0.0.1:{_closed_port()}/health", timeout=2)
    assert not ok and "health" in said


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
