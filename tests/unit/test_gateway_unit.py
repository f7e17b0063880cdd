"""The HTTP gateway without processes: OpenAI request -> GenerateRequest translation, refusals that name the
field, gRPC status -> HTTP status (RESOURCE_EXHAUSTED: 413 for a message too large, else 429 with Retry-After),
response and chunk bodies, the request limits and the JSON nesting scan, and the ASGI app itself against a
scripted scheduler stub (body bound before parsing, nesting bound before json.loads, prompt sizes before sending,
streams counted against --max-streams, one credential, a disconnect cancels the gRPC call, an error mid-stream
becomes an SSE error event)."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pagedkv.api.v1 import api_pb2 as api
from pagedkv.client import ResumePolicy, resumable_generate
from pagedkv.gateway.app import Gateway, create_app
from pagedkv.gateway.errors import RETRY_AFTER_S, ApiError, from_grpc
from pagedkv.gateway.guards import MAX_JSON_DEPTH, nests_deeper_than
from pagedkv.gateway.openai_requests import (
    DEFAULT_COMPLETION_MAX_TOKENS,
    MAX_PROMPTS,
    RequestLimits,
    check_sizes,
    parse_chat,
    parse_completion,
)
from pagedkv.gateway.openai_responses import Choice, chunk_body, response_body
from pagedkv.gateway.upstream import GATEWAY_RESUME
from pagedkv.grpc_common import QUEUE_FULL_PREFIX

pytestmark = pytest.mark.unit


# ---- translation -------------------------------------------------------------------------------
def test_completion_fields_map_to_the_generate_request():
    plan = parse_completion({"model": "m", "prompt": "Hi", "max_tokens": 7, "temperature": 0.5, "top_p": 0.9,
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
    plan = parse_completion({"model": "m", "prompt": [1, 2, 3]}, "r")
    s = plan.requests[0].sampling
    assert list(plan.requests[0].token_ids.ids) == [1, 2, 3] and s.max_tokens == DEFAULT_COMPLETION_MAX_TOKENS
    assert not any(s.HasField(f) for f in ("temperature", "top_p", "top_k", "seed"))  # the checkpoint's defaults
    assert not s.logprobs and not plan.logprobs
    chat = parse_chat({"model": "m", "messages": [{"role": "user", "content": "x"}]}, "r")
    assert chat.requests[0].sampling.max_tokens == 0  # chat: up to the context


def test_several_prompts_are_several_requests():
    plan = parse_completion({"model": "m", "prompt": ["a", "b", [5, 6]], "n": 2}, "r")
    assert [r.WhichOneof("prompt") for r in plan.requests] == ["text", "text", "token_ids"]
    assert [r.request_id for r in plan.requests] == ["r-0", "r-1", "r-2"] and plan.num_choices == 6


def test_chat_messages_and_max_completion_tokens():
    plan = parse_chat({"model": "m", "max_tokens": 5, "max_completion_tokens": 9, "top_k": -1,
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
    ({"model": "m", "prompt": ["x"] * (MAX_PROMPTS + 1)}, "prompt"),
    ({"model": "m", "prompt": "x", "temperature": 2.5}, "temperature"),
    ({"model": "m", "prompt": "x", "temperature": "hot"}, "temperature"),
    ({"model": "m", "prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"model": "m", "prompt": "x", "n": True}, "n"),
    ({"model": "m", "prompt": "x", "logprobs": -1}, "logprobs"),
    ({"model": "m", "prompt": "x", "logprobs": True}, "logprobs"),
    ({"model": "m", "prompt": "x", "prompt_logprobs": -2}, "prompt_logprobs"),
    ({"model": "m", "prompt": "x", "prompt_logprobs": 2, "stream": True}, "prompt_logprobs"),
    ({"model": "m", "prompt": "x", "echo": 1}, "echo"),
    ({"model": "m", "prompt": "x", "presence_penalty": 2.5}, "presence_penalty"),
    ({"model": "m", "prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    ({"model": "m", "prompt": "x", "min_p": 1.5}, "min_p"),
    ({"model": "m", "prompt": "x", "max_tokens": 4, "min_tokens": 5}, "min_tokens"),
    ({"model": "m", "prompt": "x", "logit_bias": {"a": 1}}, "logit_bias"),
    ({"model": "m", "prompt": "x", "allowed_token_ids": []}, "allowed_token_ids"),
    ({"model": "m", "prompt": "x", "bad_words": [3]}, "bad_words"),
    ({"model": "m", "prompt": "x", "logit_bias": {"5": 101}}, "logit_bias"),
    ({"model": "m", "prompt": "x", "logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
    ({"model": "m", "prompt": "x", "best_of": 3}, "best_of"),
    ({"model": "m", "prompt": "x", "stop": [1]}, "stop"),
    ({"model": "m", "prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"model": "m", "prompt": "x", "user": "u" * 300}, "user"),
    ({"model": "m", "prompt": "x", "page_budget": -1}, "page_budget"),
])
def test_completion_refusals_name_the_field(body, param):
    with pytest.raises(ApiError) as e:
        parse_completion(body, "r")
    assert e.value.status == 400 and e.value.param == param and e.value.message.startswith(param)


@pytest.mark.parametrize("body, param", [
    ({"model": "m", "messages": []}, "messages"),
    ({"model": "m", "messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0]"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "logprobs": 1}, "logprobs"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "echo": True}, "echo"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools[0]"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": {"f": 1}}, "tools"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"},], "tools": [{"function": {"name": "f",
      "parameters": [1]}}]}, "tools[0].function.parameters"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "function"}},
     "tool_choice"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "custom", "function": {
      "name": "f"}}}, "tool_choice"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "parallel_tool_calls": "no"},
     "parallel_tool_calls"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": [{"function": {"name": "f"}}],
      "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "functions": [{"name": "f"}]}, "functions"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}},
     "response_format.type"),
])
def test_chat_refusals_name_the_field(body, param):
    with pytest.raises(ApiError) as e:
        parse_chat(body, "r")
    assert e.value.status == 400 and e.value.param == param


@pytest.mark.parametrize("code, status", [
    (grpc.StatusCode.INVALID_ARGUMENT, 400), (grpc.StatusCode.FAILED_PRECONDITION, 400),
    (grpc.StatusCode.UNAUTHENTICATED, 401), (grpc.StatusCode.NOT_FOUND, 404), (grpc.StatusCode.ALREADY_EXISTS, 409),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, 400), (grpc.StatusCode.UNAVAILABLE, 503),
    (grpc.StatusCode.DEADLINE_EXCEEDED, 504), (grpc.StatusCode.INTERNAL, 500), (grpc.StatusCode.UNKNOWN, 500),
])
def test_grpc_status_maps_to_http(code, status):
    err = from_grpc(code, "details")
    assert err.status == status and err.body()["error"]["message"] == "details"
    assert set(err.body()["error"]) == {"message", "type", "param", "code"}


def test_resource_exhausted_is_429_with_retry_after_for_a_full_queue_only():
    """gRPC's own refusal of a message over the scheduler's size limit never succeeds: the openai SDK retries a
    429 (three times), so it must not be one (413). A full queue (QUEUE_FULL_PREFIX) is the 429 that clears; any
    other RESOURCE_EXHAUSTED is a 400 (was: 429)."""
    big = from_grpc(grpc.StatusCode.RESOURCE_EXHAUSTED,
                        "SERVER: Received message larger than max (1048700 vs. 196608)")  # gRPC's words
    assert big.status == 413 and big.param == "prompt" and big.retry_after is None and not big.headers()
    assert "1048700" in big.message and "196608" in big.message and big.message.startswith("prompt: ")
    chat = from_grpc(grpc.StatusCode.RESOURCE_EXHAUSTED, "CLIENT: Sent message larger than max (9 vs. 8)",
                         chat=True)
    assert chat.status == 413 and chat.param == "messages"
    full = from_grpc(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{QUEUE_FULL_PREFIX}tenant a has 64 requests waiting")
    assert full.status == 429 and full.headers() == {"retry-after": str(RETRY_AFTER_S)}
    assert full.body()["error"]["type"] == "rate_limit_error"
    other = from_grpc(grpc.StatusCode.RESOURCE_EXHAUSTED, "tenant over its limits")  # no retry cures it
    assert other.status == 400 and not other.headers() and other.body()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("status, kind", [(400, "invalid_request_error"), (405, "invalid_request_error"),
                                          (408, "invalid_request_error"), (413, "invalid_request_error"),
                                          (431, "invalid_request_error"), (401, "authentication_error"),
                                          (429, "rate_limit_error"), (500, "server_error"), (502, "server_error")])
def test_error_types_follow_openai(status, kind):
    assert ApiError(status, "x").body()["error"]["type"] == kind


def test_request_limits_default_to_the_schedulers():
    from scheduler_svc.validation import default_max_prompt_bytes, max_message_bytes

    limits = RequestLimits.of(2048)
    assert limits.prompt_bytes == default_max_prompt_bytes(2048)
    assert limits.body_bytes == max_message_bytes(limits.prompt_bytes, 2048)
    assert RequestLimits.of(2048, prompt_bytes=1000, body_bytes=5000) == RequestLimits(2048, 1000, 5000)
    assert RequestLimits.of(2048, prompt_bytes=1000).body_bytes == max_message_bytes(1000, 2048)


@pytest.mark.parametrize("body, param", [
    ({"model": "m", "prompt": "x" * 1001}, "prompt"),
    ({"model": "m", "prompt": "\u00e9" * 501}, "prompt"),  # 1002 bytes of UTF-8 in 501 characters
    ({"model": "m", "prompt": ["ok", "x" * 1001]}, "prompt"),
    ({"model": "m", "prompt": [1] * 64}, "prompt"),
    ({"model": "m", "messages": [{"role": "user", "content": "x" * 600}, {"role": "user", "content": "y" * 401}]},
     "messages"),
])
def test_prompt_sizes_are_checked_before_sending(body, param):
    limits = RequestLimits(max_model_len=64, prompt_bytes=1000, body_bytes=10_000)
    plan = parse_chat(body, "r") if "messages" in body else parse_completion(body, "r")
    with pytest.raises(ApiError) as e:
        check_sizes(plan, limits)
    assert e.value.status == 400 and e.value.param == param
    assert "1000" in e.value.message or "max_model_len=64" in e.value.message
    check_sizes(parse_completion({"model": "m", "prompt": ["x" * 1000, [1] * 63]}, "r"), limits)
    check_sizes(parse_chat({"model": "m", "messages": [{"role": "user", "content": "\u00e9" * 500}]}, "r"),
                    limits)


def _depth(v) -> int:
    if isinstance(v, list):
        return 1 + max(map(_depth, v), default=0)
    if isinstance(v, dict):
        return 1 + max(map(_depth, v.values()), default=0)
    return 0


_TRICKY = st.text(alphabet='[]{}"\\ab\n\u00e9', max_size=8)  # strings full of what the scan must skip
_JSON = st.recursive(st.none() | st.integers() | _TRICKY,
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_TRICKY, inner, max_size=3),
                     max_leaves=40)


@given(_JSON, st.booleans())
def test_nesting_scan_agrees_with_json_depth(value, ascii_only):
    body = json.dumps(value, ensure_ascii=ascii_only).encode()
    d = _depth(value)
    assert not nests_deeper_than(body, d) and (d == 0 or nests_deeper_than(body, d - 1))


def test_nesting_scan_counts_deep_bodies():
    deep = [0]
    for _ in range(80):
        deep = [deep, {"k": "]]]}}}"}]
    body = json.dumps(deep).encode()
    assert nests_deeper_than(body, 80) and not nests_deeper_than(body, 81)
    assert not nests_deeper_than(b'{"p": "' + b"[" * 200 + b'"}', 64)  # brackets in a string do not count


def test_nesting_scan_is_never_shallower_than_what_json_loads_reaches():
    """Invalid JSON too: json.loads recurses into everything before the point where it fails."""
    assert nests_deeper_than(b"[" * 100_000, 64)
    assert nests_deeper_than(b'["\\\\", ' + b"[" * 100, 64)  # an escaped backslash, then the string ends
    assert not nests_deeper_than(b'["\\", ' + b"[" * 100 + b'"', 64)  # an escaped quote: the string goes on
    assert nests_deeper_than(b'{"a": "b\\"c' + b"[" * 100, 64) is False  # an unterminated string: json stops there
    assert not nests_deeper_than(b'"' + b'\\"' * 100_000, 64)  # and the scan stays linear on such input


def test_scheduler_field_names_become_openai_params():
    assert from_grpc(grpc.StatusCode.INVALID_ARGUMENT, "sampling.temperature: -1; must be").param == "temperature"
    assert from_grpc(grpc.StatusCode.INVALID_ARGUMENT, "sampling.n: 20; must be").param == "n"
    assert from_grpc(grpc.StatusCode.INVALID_ARGUMENT, "prompt: 900 tokens; must").param == "prompt"
    assert from_grpc(grpc.StatusCode.INVALID_ARGUMENT, "prompt.chat.messages[0].role: x", chat=True
                         ).param == "messages"
    assert from_grpc(grpc.StatusCode.INVALID_ARGUMENT, "priority: 5000; must").param == "priority"
    assert from_grpc(grpc.StatusCode.INVALID_ARGUMENT, "no field here").param is None
    for name in ("chat_template", "chat_template_kwargs", "continue_final_message"):
        assert from_grpc(grpc.StatusCode.INVALID_ARGUMENT, f"prompt.chat.{name}: x", chat=True).param == name
    assert from_grpc(grpc.StatusCode.INVALID_ARGUMENT, "prompt.chat.messages[1].tool_calls[0].type: 'x'", chat=True
                     ).param == "messages"


def _msg(index=0, text="", ids=(), lps=(), finish=0, prompt=0, completion=0, cached=0) -> api.GenerateResponse:
    m = api.GenerateResponse(request_id="r", text=text, token_ids=list(ids), logprobs=list(lps), index=index,
                             finish_reason=finish)
    if finish:
        m.usage.CopyFrom(api.Usage(prompt_tokens=prompt, completion_tokens=completion, cached_tokens=cached))
    return m


def test_response_bodies_count_the_prompt_once_per_prompt():
    plan = parse_completion({"model": "m", "prompt": ["a", "b"], "n": 2, "logprobs": 0}, "r")
    choices = [Choice() for _ in range(4)]
    for i, c in enumerate(choices):
        c.add(_msg(text=f"t{i}", ids=[i], lps=[-0.5]))
        c.add(_msg(finish=api.FINISH_REASON_LENGTH if i else api.FINISH_REASON_STOP, prompt=3 + i // 2,
                   completion=1, cached=1))
    body = response_body(plan, "r", 1, "m", choices)
    assert body["usage"] == {"prompt_tokens": 7, "completion_tokens": 4, "total_tokens": 11,
                             "prompt_tokens_details": {"cached_tokens": 2}}
    assert [c["finish_reason"] for c in body["choices"]] == ["stop", "length", "length", "length"]
    assert body["choices"][1]["logprobs"]["tokens"] == ["token_id:1"]
    assert body["choices"][1]["logprobs"]["token_logprobs"] == [-0.5]


def test_chat_chunks_have_openai_shape():
    plan = parse_chat({"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": True,
                           "stream_options": {"include_usage": True}}, "c")
    role = chunk_body(plan, "c", 1, "m", 0, None, role=True)
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""} and role["usage"] is None
    last = chunk_body(plan, "c", 1, "m", 0, "", finish_reason="stop")
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


def test_a_completions_first_token_gets_a_chunk_even_with_its_text_held_back():
    # (the first byte of a character: no text yet; as vLLM, its chunk goes out, so TTFT is the first token's)
    up = FakeUpstream([_msg(ids=[200]), _msg(ids=[201]), _msg(text="é!", ids=[33]),
                       _msg(text="", ids=[34], finish=api.FINISH_REASON_LENGTH, prompt=2, completion=4)])
    status, _, data = asyncio.run(asgi(_app(up), "/v1/completions", _body(stream=True)))
    chunks = [json.loads(e.removeprefix(b"data: ")) for e in data.split(b"\n\n") if e and e != b"data: [DONE]"]
    assert status == 200 and [c["choices"][0]["text"] for c in chunks] == ["", "é!", ""]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, "length"]


def test_app_refuses_a_large_body_before_reading_it():
    up = FakeUpstream()
    status, _, data = asyncio.run(asgi(_app(up, max_body_bytes=2048), "/v1/completions", b"{}",
                                       headers=[(b"content-length", b"999999")]))
    assert status == 413 and b"--max-body-bytes" in data and not up.requests
    status, _, data = asyncio.run(asgi(_app(up, max_body_bytes=2048), "/v1/completions", b"x" * 4096))
    assert status == 413 and not up.requests
    status, _, data = asyncio.run(asgi(_app(up), "/v1/completions", b"{not json"))
    assert status == 400 and json.loads(data)["error"]["type"] == "invalid_request_error"


def test_app_body_limit_defaults_to_the_schedulers_request_limit():
    up = FakeUpstream()
    limit = RequestLimits.of(2048).body_bytes  # FakeUpstream's max_model_len
    status, _, data = asyncio.run(asgi(_app(up), "/v1/completions", b"{}",
                                       headers=[(b"content-length", str(limit + 1).encode())]))
    error = json.loads(data)["error"]
    assert status == 413 and error["param"] == "prompt" and str(limit) in error["message"] and not up.requests
    assert str(RequestLimits.of(2048).prompt_bytes) in error["message"]


def test_app_refuses_deep_nesting_before_parsing():
    up = FakeUpstream()
    status, _, data = asyncio.run(asgi(_app(up), "/v1/completions", b"[" * 100_000))
    error = json.loads(data)["error"]
    assert status == 400 and error["type"] == "invalid_request_error" and error["code"] == "body_too_deep"
    assert error["message"].startswith("request body:") and str(MAX_JSON_DEPTH) in error["message"]
    nested = json.dumps({"model": "m", "prompt": "hi", "user": "u", "extra": [[[[[[[[1]]]]]]]]}).encode()
    up = FakeUpstream([_msg(text="a", ids=[1], finish=1, prompt=1, completion=1)])
    assert asyncio.run(asgi(_app(up), "/v1/completions", nested))[0] == 200  # 9 levels: fine


def test_app_checks_prompt_sizes_before_sending():
    up = FakeUpstream()
    prompt_bytes = RequestLimits.of(2048).prompt_bytes
    status, _, data = asyncio.run(asgi(_app(up), "/v1/completions", _body(prompt="x" * (prompt_bytes + 1))))
    error = json.loads(data)["error"]
    assert status == 400 and error["param"] == "prompt" and str(prompt_bytes) in error["message"]
    status, _, data = asyncio.run(asgi(_app(up), "/v1/completions", _body(prompt=[1] * 2048)))
    assert status == 400 and "max_model_len=2048" in json.loads(data)["error"]["message"]
    assert not up.requests


def test_app_refuses_two_credentials():
    up = FakeUpstream()
    for headers in ([(b"authorization", b"Bearer a"), (b"authorization", b"Bearer b")],
                    [(b"authorization", b"Bearer a"), (b"x-api-key", b"b")],
                    [(b"api-key", b"a"), (b"authorization", b"Bearer b")]):
        status, _, data = asyncio.run(asgi(_app(up), "/v1/completions", _body(), headers=headers))
        error = json.loads(data)["error"]
        assert status == 401 and error["code"] == "invalid_api_key" and "2 credentials" in error["message"]
    assert not up.requests


def test_app_405_is_an_invalid_request():
    status, headers, data = asyncio.run(asgi(_app(FakeUpstream()), "/v1/completions", b"", method="GET"))
    error = json.loads(data)["error"]
    assert status == 405 and error["type"] == "invalid_request_error" and "GET" in error["message"]
    assert headers[b"allow"] == b"POST"


def test_app_maps_statuses_and_limits_streams():
    up = FakeUpstream([rpc_error(grpc.StatusCode.UNAUTHENTICATED, "no key")],
                      [rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{QUEUE_FULL_PREFIX}tenant a has 9 waiting")],
                      [rpc_error(grpc.StatusCode.UNAVAILABLE, "no executor is up")])
    for want in (401, 429, 503):
        status, headers, data = asyncio.run(asgi(_app(up), "/v1/completions", _body(stream=True)))
        assert status == want and json.loads(data)["error"]["message"]
        assert (b"retry-after" in headers) == (want == 429)
    status, _, data = asyncio.run(asgi(_app(up), "/v1/completions", _body(model="other")))
    assert status == 404 and json.loads(data)["error"]["code"] == "model_not_found"
    status, _, data = asyncio.run(asgi(_app(up), "/v1/nothing", b"{}"))
    assert status == 404 and "no such endpoint" in json.loads(data)["error"]["message"]


def test_app_max_streams_counts_prompts_times_n():
    up = FakeUpstream()
    gateway = Gateway(up, Log(), max_streams=8)
    app = create_app(gateway)
    status, _, data = asyncio.run(asgi(app, "/v1/completions", _body(prompt=["a", "b", "c"], n=3)))
    error = json.loads(data)["error"]
    assert status == 400 and error["param"] == "n" and "9 streams" in error["message"] and "8" in error["message"]
    gateway.active = 3  # three streams being answered
    status, headers, data = asyncio.run(asgi(app, "/v1/completions", _body(prompt=["a", "b"], n=3)))
    assert status == 429 and headers[b"retry-after"] == str(RETRY_AFTER_S).encode()
    assert "--max-streams" in json.loads(data)["error"]["message"] and not up.requests
    up.scripts = [[_msg(index=i, text="t", ids=[1], finish=1, prompt=1, completion=1) for i in range(5)]]
    status, _, data = asyncio.run(asgi(app, "/v1/completions", _body(n=5)))  # 3 + 5 = 8: fits
    assert status == 200 and len(json.loads(data)["choices"]) == 5 and gateway.active == 3


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


FAST = ResumePolicy(attempts=2, timeout_s=5.0, backoff_s=0.001)


@pytest.mark.parametrize("stream", [True, False])
def test_an_upstream_stream_that_breaks_is_resumed_and_the_client_sees_one(stream):
    """The scheduler's stream breaks (UNAVAILABLE) after two tokens: the gateway resends the request with the
    tokens received and the seed, and the HTTP client gets one uninterrupted answer (was: an error event)."""
    up = FakeUpstream([_seeded(_msg(text="a", ids=[1]), 77), _msg(text="b", ids=[2]),
                       rpc_error(grpc.StatusCode.UNAVAILABLE, "Stream removed")],
                      [_msg(text="c", ids=[3]), _msg(text="d", ids=[4], finish=2, prompt=1, completion=4)],
                      resume=FAST)
    status, _, data = asyncio.run(asgi(_app(up), "/v1/completions", _body(stream=stream, seed=77)))
    assert status == 200 and len(up.requests) == 2
    [fork] = up.requests[1].continuation.forks
    assert list(fork.token_ids) == [1, 2] and fork.draw_offset == 2 and up.requests[1].sampling.seed == 77
    if stream:
        events = [e.removeprefix(b"data: ") for e in data.split(b"\n\n") if e]
        chunks = [json.loads(e) for e in events[:-1]]
        assert events[-1] == b"[DONE]" and not any("error" in c for c in chunks)
        assert "".join(c["choices"][0]["text"] for c in chunks) == "abcd"
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    else:
        body = json.loads(data)
        assert body["choices"][0]["text"] == "abcd" and body["usage"]["completion_tokens"] == 4


def test_an_upstream_stream_that_cannot_be_resumed_ends_with_the_error():
    up = FakeUpstream([_seeded(_msg(text="a", ids=[1]), 5), rpc_error(grpc.StatusCode.UNAVAILABLE, "gone")],
                      [rpc_error(grpc.StatusCode.UNAVAILABLE, "still gone")],
                      [rpc_error(grpc.StatusCode.UNAVAILABLE, "still gone")], resume=FAST)
    status, _, data = asyncio.run(asgi(_app(up), "/v1/completions", _body(stream=True)))
    events = [e.removeprefix(b"data: ") for e in data.split(b"\n\n") if e]
    assert status == 200 and events[-1] == b"[DONE]" and len(up.requests) == 3
    assert "still gone (not resumed: 2 resume attempts failed)" == json.loads(events[-2])["error"]["message"]


def test_a_full_queue_is_a_429_at_once_and_waited_out_mid_stream():
    """Before anything was sent, a full queue is the HTTP client's 429 with Retry-After (it decides when to come
    back); once the answer started, a resume that meets a full queue waits it out (GATEWAY_RESUME)."""
    full = rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{QUEUE_FULL_PREFIX}tenant a has 2 requests waiting")
    up = FakeUpstream([full], resume=GATEWAY_RESUME)
    status, headers, data = asyncio.run(asgi(_app(up), "/v1/completions", _body(stream=True)))
    assert status == 429 and headers[b"retry-after"] == str(RETRY_AFTER_S).encode() and len(up.requests) == 1
    assert json.loads(data)["error"]["type"] == "rate_limit_error"
    up = FakeUpstream([_seeded(_msg(text="a", ids=[1]), 3), rpc_error(grpc.StatusCode.UNAVAILABLE, "gone")], [full],
                      [_msg(text="b", ids=[2], finish=2, prompt=1, completion=2)], resume=GATEWAY_RESUME)
    status, _, data = asyncio.run(asgi(_app(up), "/v1/completions", _body()))
    assert status == 200 and json.loads(data)["choices"][0]["text"] == "ab" and len(up.requests) == 3


def _seeded(m: api.GenerateResponse, seed: int) -> api.GenerateResponse:
    m.seed = seed
    return m


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

    from pagedkv.gateway.cli import serve_child_command

    args = argparse.Namespace(http_port=0, host="0.0.0.0", port=50051, shutdown_timeout=30.0, log_format="json",
                              tls_cert="", tls_key="")
    assert serve_child_command(args) is None
    args.http_port = 8000
    cmd = serve_child_command(args)
    assert cmd[cmd.index("--address") + 1] == "127.0.0.1:50051" and cmd[cmd.index("--port") + 1] == "8000"
    assert "--tls-cert" not in cmd and "--max-prompt-bytes" not in cmd
    args.max_prompt_bytes = 1000  # serve's scheduler flag: the gateway refuses what the scheduler would
    assert serve_child_command(args)[-2:] == ["--max-prompt-bytes", "1000"]
    del args.max_prompt_bytes
    args.model, args.tokenizer = "tiny-llama", ""  # logprobs name tokens with the model's tokenizer...
    cmd = serve_child_command(args)
    assert cmd[cmd.index("--tokenizer") + 1] == "tiny-llama"
    args.tokenizer = "/tok"  # ... or the scheduler's --tokenizer
    cmd = serve_child_command(args)
    assert cmd[cmd.index("--tokenizer") + 1] == "/tok"
    del args.model, args.tokenizer
    args.tls_cert, args.tls_key = "s.pem", "s.key"
    monkeypatch.delenv("PAGEDKV_TLS_CA", raising=False)
    with pytest.raises(ValueError, match="PAGEDKV_TLS_CA"):
        serve_child_command(args)
    monkeypatch.setenv("PAGEDKV_TLS_CA", "ca.pem")
    cmd = serve_child_command(args)
    assert [cmd[cmd.index(f) + 1] for f in ("--tls-cert", "--tls-key", "--tls-ca")] == ["s.pem", "s.key", "ca.pem"]
