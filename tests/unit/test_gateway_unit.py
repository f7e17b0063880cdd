"""The HTTP gateway's ASGI app without processes, against a scripted scheduler stub (tests/support/gateway_stub.py):
the body bound before parsing, the nesting bound before json.loads, prompt sizes before sending, streams counted
against --max-streams, one credential, a disconnect cancels the gRPC call, an error mid-stream becomes an SSE error
event, a broken upstream stream resumed; and serve's gateway child. The translation, refusals, status mapping,
bodies, request limits and the nesting scan: test_gateway_translation_unit.py."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest

from pagedkv.api.v1 import api_pb2 as api
from pagedkv.gateway.app import Gateway, create_app
from pagedkv.gateway.errors import RETRY_AFTER_S
from pagedkv.gateway.guards import MAX_JSON_DEPTH
from pagedkv.gateway.request_limits import RequestLimits
from pagedkv.gateway.upstream import GATEWAY_RESUME
from pagedkv.grpc_common import QUEUE_FULL_PREFIX
from pagedkv.resume_policy import ResumePolicy

# FakeUpstream, Log, _msg, asgi and rpc_error are imported from here by the other gateway unit tests
from tests.support.gateway_stub import FakeUpstream, Log, asgi, rpc_error
from tests.support.gateway_stub import app as _app
from tests.support.gateway_stub import body as _body
from tests.support.gateway_stub import msg as _msg
from tests.support.gateway_stub import seeded as _seeded

pytestmark = pytest.mark.unit


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
