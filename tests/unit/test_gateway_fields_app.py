"""The gateway's fields through its answers: the context-length refusal in OpenAI's words (mapped from the
scheduler's own messages), unknown fields named in a response header and a warning, X-Request-Id used and echoed,
/version, and one n limit for the gateway and the scheduler. The field table itself: test_gateway_fields.py."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest

import pagedkv
from pagedkv.api.v1 import api_pb2 as api
from pagedkv.bounds import InvalidRequest
from pagedkv.gateway import fields
from pagedkv.gateway.app import Gateway, create_app
from pagedkv.gateway.errors import ApiError, from_grpc
from pagedkv.gateway.openai_requests import (
    MAX_CLIENT_ID_CHARS,
    parse_chat,
    parse_completion,
)
from pagedkv.gateway.request_limits import RequestLimits, check_sizes
from scheduler_svc.validation import Limits, check_prompt_ids, check_sampling
from tests.support.gateway_stub import BASE, FakeUpstream, Log, asgi, rpc_error
from tests.support.gateway_stub import first_request as _req
from tests.support.gateway_stub import msg as _msg
from tests.support.gateway_stub import parse as _parse

pytestmark = pytest.mark.unit


# ---- the context-length refusal --------------------------------------------------------------------
def _scheduler_refusal(prompt_len: int, max_tokens: int, max_model_len: int = 2048) -> str:
    """The scheduler's own message (scheduler_svc/validation.py) for a request too long for its context."""
    limits = Limits(max_model_len=max_model_len, vocab_size=32000)
    try:
        check_prompt_ids([1] * prompt_len, limits)
        check_sampling(api.SamplingParams(max_tokens=max_tokens), prompt_len, limits)
    except InvalidRequest as err:
        return str(err)
    raise AssertionError("the scheduler took it")


@pytest.mark.parametrize("chat", [False, True])
def test_the_schedulers_length_refusals_become_openais_context_length_error(chat):
    field = "messages" if chat else "prompt"
    err = from_grpc(grpc.StatusCode.INVALID_ARGUMENT, _scheduler_refusal(2000, 100), chat=chat)
    assert (err.status, err.code, err.param, err.type) == (400, "context_length_exceeded", field,
                                                           "invalid_request_error")
    assert err.message.startswith("This model's maximum context length is 2048 tokens. However, you requested 2100 "
                                  f"tokens (2000 in the {field}, 100 in the completion). Please reduce the length "
                                  f"of the {field} or completion.")
    err = from_grpc(grpc.StatusCode.INVALID_ARGUMENT, _scheduler_refusal(2048, 0), chat=chat)
    assert err.code == "context_length_exceeded" and err.message.startswith(
        f"This model's maximum context length is 2048 tokens. However, your {field} resulted in 2048 tokens.")
    tenant = Limits(max_model_len=512, vocab_size=10, max_len_name="the 32 pages tenant t can hold (tokens)")
    with pytest.raises(InvalidRequest) as e:
        check_sampling(api.SamplingParams(max_tokens=100), 500, tenant)
    err = from_grpc(grpc.StatusCode.INVALID_ARGUMENT, str(e.value))
    assert "maximum context length is 512 tokens" in err.message and "tenant t" in err.message
    other = from_grpc(grpc.StatusCode.INVALID_ARGUMENT, "sampling.top_p: 2; must be in (0, 1]")
    assert other.code != "context_length_exceeded" and other.param == "top_p"


def test_the_gateways_own_token_count_check_is_a_context_length_error():
    plan = parse_completion({"model": "m", "prompt": [1] * 2048}, "r")
    with pytest.raises(ApiError) as e:
        check_sizes(plan, RequestLimits.of(2048))
    assert e.value.code == "context_length_exceeded" and e.value.param == "prompt"
    assert e.value.message.startswith("This model's maximum context length is 2048 tokens.")


def test_truncate_prompt_tokens_is_checked_against_the_context_before_the_prompts_length():
    plan = parse_completion({"model": "m", "prompt": [1] * 3000, "truncate_prompt_tokens": 100}, "r")
    check_sizes(plan, RequestLimits.of(2048))  # 3000 ids, of which the last 100 are kept: taken
    plan = parse_completion({"model": "m", "prompt": [1] * 3000, "truncate_prompt_tokens": 2048}, "r")
    with pytest.raises(ApiError) as e:
        check_sizes(plan, RequestLimits.of(2048))
    assert e.value.code == "context_length_exceeded"
    assert "2048 token ids (truncate_prompt_tokens=2048)" in e.value.message
    for keep, limits in ((2049, RequestLimits.of(2048)), (0, None), (-1, None), ("5", None)):
        with pytest.raises(ApiError) as e:
            plan = parse_chat({**BASE[True], "truncate_prompt_tokens": keep}, "r")
            check_sizes(plan, limits)
        assert e.value.status == 400 and e.value.param == "truncate_prompt_tokens", keep
    with pytest.raises(ApiError, match=r"truncate_prompt_tokens: 2049; must be in \[1, max_model_len=2048\]"):
        check_sizes(parse_completion({**BASE[False], "truncate_prompt_tokens": 2049}, "r"), RequestLimits.of(2048))


def test_app_answers_a_length_refusal_in_openais_words():
    up = FakeUpstream([rpc_error(grpc.StatusCode.INVALID_ARGUMENT, _scheduler_refusal(20, 2040))])
    body = json.dumps({**BASE[True], "max_tokens": 2040}).encode()
    status, _, data = asyncio.run(asgi(create_app(Gateway(up, Log())), "/v1/chat/completions", body))
    error = json.loads(data)["error"]
    assert status == 400 and error["code"] == "context_length_exceeded" and error["param"] == "messages"


# ---- the app: headers, logs, request ids, /version ------------------------------------------------
def _done() -> list:
    return [_msg(text="a", ids=[1], finish=api.FINISH_REASON_STOP, prompt=1, completion=1)]


def _post(body: dict, headers=(), stream: bool = False):
    up, log = FakeUpstream(_done()), Log()
    status, got, data = asyncio.run(asgi(create_app(Gateway(up, log)), "/v1/completions",
                                         json.dumps({**BASE[False], "stream": stream, **body}).encode(),
                                         headers=headers))
    return status, got, data, up, log


@pytest.mark.parametrize("stream", [False, True])
def test_app_names_unknown_fields_in_a_header_and_a_warning(stream):
    status, headers, _, up, log = _post({"frobnicate": 1, "user": "u"}, stream=stream)
    assert status == 200 and headers[fields.IGNORED_FIELDS_HEADER.encode()] == b"frobnicate"
    assert [(lvl, kw["fields"]) for lvl, event, kw in log.lines if event == "request_fields_ignored"] == [
        ("warning", ["frobnicate"])]
    assert [(lvl, kw["fields"]) for lvl, event, kw in log.lines if event == "request_fields_ignored_by_design"] == [
        ("debug", ["user"])]
    status, headers, _, _, log = _post({})
    assert status == 200 and fields.IGNORED_FIELDS_HEADER.encode() not in headers
    assert not [line for line in log.lines if line[1].startswith("request_fields_ignored")]


@pytest.mark.parametrize("stream", [False, True])
def test_app_uses_and_echoes_the_clients_request_id(stream):
    status, headers, data, up, _ = _post({}, headers=[(b"x-request-id", b"trace-42")], stream=stream)
    assert status == 200 and headers[b"x-request-id"] == b"trace-42" and up.requests[0].request_id == "trace-42"
    if not stream:
        assert json.loads(data)["id"] == "cmpl-trace-42"
    _, headers, _, up, _ = _post({"request_id": "body-7"})  # vLLM's body field, when no header
    assert headers[b"x-request-id"] == b"body-7" and up.requests[0].request_id == "body-7"
    _, headers, _, up, _ = _post({"request_id": "body-7"}, headers=[(b"x-request-id", b"hdr")])
    assert up.requests[0].request_id == "hdr"  # the header wins, as vLLM's


def test_app_makes_its_own_id_for_an_unusable_header_and_refuses_a_bad_body_id():
    long = b"x" * (MAX_CLIENT_ID_CHARS + 1)
    status, headers, _, up, log = _post({}, headers=[(b"x-request-id", long)])
    rid = up.requests[0].request_id
    assert status == 200 and rid.startswith("cmpl-") and headers[b"x-request-id"] == rid.encode()
    assert any(event == "x_request_id_not_used" for _, event, _ in log.lines)
    status, headers, data, up, _ = _post({"request_id": "has space"})
    assert status == 400 and json.loads(data)["error"]["param"] == "request_id" and not up.requests
    status, headers, data, up, _ = _post({"best_of": 2}, headers=[(b"x-request-id", b"t-1")])
    error = json.loads(data)["error"]
    assert status == 400 and error["param"] == "best_of" and headers[b"x-request-id"] == b"t-1"


def test_app_version():
    status, _, data = asyncio.run(asgi(create_app(Gateway(FakeUpstream(), Log())), "/version", b"", method="GET"))
    assert status == 200 and json.loads(data) == {"version": pagedkv.__version__}


def test_one_n_limit_for_the_gateway_and_the_scheduler():
    """The gateway refuses n past the scheduler's MAX_FORKS in the same words, naming n and the limit."""
    from pagedkv.bounds import MAX_FORKS

    for chat in (False, True):
        assert _req(_parse(chat, n=MAX_FORKS)).sampling.n == MAX_FORKS
        with pytest.raises(ApiError) as e:
            _parse(chat, n=MAX_FORKS + 1)
        assert (e.value.status, e.value.param) == (400, "n")
        assert e.value.message == f"n: {MAX_FORKS + 1}; must be in [1, {MAX_FORKS}]"
    with pytest.raises(InvalidRequest) as e:
        check_sampling(api.SamplingParams(n=MAX_FORKS + 1), 1, Limits(max_model_len=64, vocab_size=10))
    assert str(e.value).startswith(f"sampling.n: {MAX_FORKS + 1}; must be in [1, {MAX_FORKS}]")
    assert from_grpc(grpc.StatusCode.INVALID_ARGUMENT, str(e.value)).param == "n"
