"""The HTTP gateway without processes: OpenAI request -> GenerateRequest translation, refusals that name the
field, gRPC status -> HTTP status (RESOURCE_EXHAUSTED: 413 for a message too large, else 429 with Retry-After),
response and chunk bodies, the request limits and the JSON nesting scan. The ASGI app itself against a scripted
scheduler stub: test_gateway_unit.py."""

from __future__ import annotations

import json

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pagedkv.api.v1 import api_pb2 as api
from pagedkv.gateway.errors import RETRY_AFTER_S, ApiError, from_grpc
from pagedkv.gateway.guards import nests_deeper_than
from pagedkv.gateway.openai_requests import (
    DEFAULT_COMPLETION_MAX_TOKENS,
    MAX_PROMPTS,
    parse_chat,
    parse_completion,
)
from pagedkv.gateway.openai_responses import Choice, chunk_body, response_body
from pagedkv.gateway.request_limits import RequestLimits, check_sizes
from pagedkv.grpc_common import QUEUE_FULL_PREFIX
from tests.support.gateway_stub import msg as _msg

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
    from pagedkv.bounds import default_max_prompt_bytes, max_message_bytes

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
