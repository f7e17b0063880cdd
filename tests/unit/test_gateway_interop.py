"""What vLLM and OpenAI clients count on from the gateway, against a scripted scheduler stub: /tokenize and
/detokenize in vLLM's shapes (pagedkv/gateway/tokenize.py: what each body becomes, the answer's shape, refusals that
name the field and the limit, sizes checked before anything is sent, the scheduler's refusals in OpenAI's terms,
the model checked when named, one credential); 405 in OpenAI's shape for a known path asked with another method;
the served model names (several, the first reported; another is 404 model_not_found)."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest

from pagedkv.api.v1 import api_pb2 as api
from pagedkv.gateway import fields
from pagedkv.gateway.app import Gateway, create_app
from pagedkv.gateway.errors import ApiError
from tests.unit.test_gateway_unit import FakeUpstream, Log, asgi, rpc_error

pytestmark = pytest.mark.unit


class TokenUpstream(FakeUpstream):
    """A scheduler stub that answers Tokenize and Detokenize (or refuses with ``error``)."""

    def __init__(self, error: grpc.aio.AioRpcError | None = None) -> None:
        super().__init__()
        self.sent: list = []
        self.error = error

    async def Tokenize(self, req, metadata, timeout):  # noqa: N802
        self.sent.append(req)
        self.metadata.append(metadata)
        if self.error:
            raise self.error
        return api.TokenizeResponse(token_ids=[1, 7, 8], tokens=["<s>", "h", "i"])

    async def Detokenize(self, req, metadata, timeout):  # noqa: N802
        self.sent.append(req)
        if self.error:
            raise self.error
        return api.DetokenizeResponse(text="<s>hi")


def post(path: str, body, up: TokenUpstream | None = None, headers=(), method: str = "POST"):
    up = up or TokenUpstream()
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    status, got, data = asyncio.run(asgi(create_app(Gateway(up, Log(), max_prompt_bytes=100)), path, raw,
                                         headers=headers, method=method))
    return status, got, json.loads(data) if data else None, up


def test_tokenize_a_prompt_in_vllms_shape():
    status, headers, body, up = post("/tokenize", {"model": "m", "prompt": "hi"})
    assert status == 200 and body == {"count": 3, "max_model_len": 2048, "tokens": [1, 7, 8], "token_strs": None}
    (req,) = up.sent
    assert req.text == "hi" and not req.HasField("add_special_tokens")  # the scheduler's rule: BOS, as Generate
    assert fields.IGNORED_FIELDS_HEADER.encode() not in headers
    status, headers, body, up = post("/tokenize", {"prompt": "hi", "add_special_tokens": False,
                                                   "return_token_strs": True, "frobnicate": 1})
    assert status == 200 and body["token_strs"] == ["<s>", "h", "i"]  # (model left out: vLLM's)
    assert up.sent[0].HasField("add_special_tokens") and not up.sent[0].add_special_tokens
    assert headers[fields.IGNORED_FIELDS_HEADER.encode()] == b"frobnicate"


def test_tokenize_messages_as_chat_completions_reads_them():
    body = {"model": "m", "messages": [{"role": "developer", "content": "s"}, {"role": "user", "content": "u",
                                                                              "name": "ann"}],
            "add_generation_prompt": False, "chat_template_kwargs": {"enable_thinking": True}}
    status, _, answer, up = post("/tokenize", body)
    assert status == 200 and answer["count"] == 3
    chat = up.sent[0].chat
    assert [(m.role, m.content, m.name) for m in chat.messages] == [("system", "s", ""), ("user", "u", "ann")]
    assert chat.HasField("add_generation_prompt") and not chat.add_generation_prompt
    assert json.loads(chat.chat_template_kwargs) == {"enable_thinking": True}


@pytest.mark.parametrize(("body", "status", "param", "words"), [
    ({"model": "other", "prompt": "hi"}, 404, "model", "'other'"),
    ({"model": "m"}, 400, "prompt", "required"),
    ({"prompt": ["hi"]}, 400, "prompt", "required: a string"),
    ({"prompt": "x" * 101}, 400, "prompt", "at most 100"),
    ({"messages": [{"role": "user", "content": "x" * 101}]}, 400, "messages", "at most 100 in all"),
    ({"messages": [{"role": "user", "content": "x"}], "add_special_tokens": True}, 400, "add_special_tokens", "True"),
    ({"messages": [{"role": "user", "content": "x"}], "prompt": "x"}, 400, "prompt", "not both"),
    ({"prompt": "x", "tools": [{"type": "function"}]}, 400, "tools", "only with messages"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, 400, "tools[0]",
     "must be an object"),
    ({"prompt": "x", "return_token_strs": "yes"}, 400, "return_token_strs", "not a boolean"),
    ([1, 2], 400, None, "JSON object"),
])
def test_tokenize_refusals_name_the_field_and_nothing_is_sent(body, status, param, words):
    got, _, answer, up = post("/tokenize", body)
    assert got == status and answer["error"]["param"] == param and words in answer["error"]["message"]
    assert answer["error"]["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    assert not up.sent


def test_the_schedulers_refusals_of_tokenize_and_detokenize_name_the_field():
    up = TokenUpstream(rpc_error(grpc.StatusCode.INVALID_ARGUMENT, "chat.chat_template: a template from a request "
                                 "is refused"))
    status, _, answer, _ = post("/tokenize", {"messages": [{"role": "user", "content": "x"}],
                                              "chat_template": "{{ 1 }}"}, up)
    assert status == 400 and answer["error"]["param"] == "chat_template"
    up = TokenUpstream(rpc_error(grpc.StatusCode.INVALID_ARGUMENT, "text: 9 bytes of UTF-8; at most 8"))
    assert post("/tokenize", {"prompt": "x"}, up)[2]["error"]["param"] == "prompt"
    up = TokenUpstream(rpc_error(grpc.StatusCode.INVALID_ARGUMENT, "token_ids: id 5000 outside the vocabulary"))
    status, _, answer, _ = post("/detokenize", {"tokens": [5000]}, up)
    assert status == 400 and answer["error"]["param"] == "tokens" and "5000" in answer["error"]["message"]
    assert answer["error"]["message"].startswith("tokens: id 5000")  # (vLLM's field, not Detokenize's token_ids)
    up = TokenUpstream(rpc_error(grpc.StatusCode.UNAUTHENTICATED, "unknown API key"))
    assert post("/detokenize", {"tokens": [1]}, up)[0] == 401


def test_detokenize_in_vllms_shape_and_bounded():
    status, _, body, up = post("/detokenize", {"model": "m", "tokens": [1, 7, 8]})
    assert status == 200 and body == {"prompt": "<s>hi"} and list(up.sent[0].token_ids) == [1, 7, 8]
    for tokens, words in (([1] * 2049, "2049 ids; at most max_model_len=2048"), ([-1], "[0, 2^31)"),
                          (["a"], "a list of token ids"), (None, "required")):
        status, _, body, up = post("/detokenize", {"tokens": tokens})
        assert status == 400 and body["error"]["param"] == "tokens" and words in body["error"]["message"]
        assert not up.sent


def test_tokenize_passes_the_callers_credential_and_refuses_two():
    status, _, _, up = post("/tokenize", {"prompt": "hi"}, headers=[(b"authorization", b"Bearer k1")])
    assert status == 200 and up.metadata == [(("authorization", "Bearer k1"),)]
    status, _, body, up = post("/detokenize", {"tokens": [1]}, headers=[(b"authorization", b"Bearer k1"),
                                                                         (b"x-api-key", b"k2")])
    assert status == 401 and body["error"]["code"] == "invalid_api_key" and not up.sent


@pytest.mark.parametrize(("method", "path", "allow"), [
    ("GET", "/v1/completions", b"POST"), ("PUT", "/v1/chat/completions", b"POST"), ("GET", "/tokenize", b"POST"),
    ("DELETE", "/detokenize", b"POST"), ("POST", "/v1/models", b"GET, HEAD"), ("POST", "/health", b"GET, HEAD"),
])
def test_a_wrong_method_on_a_known_path_is_405_in_openais_shape(method, path, allow):
    status, headers, body, up = post(path, b"", method=method)
    assert status == 405 and set(headers[b"allow"].split(b", ")) == set(allow.split(b", "))  # (a set: any order)
    assert body["error"] == {"message": f"{method} is not allowed on {path}", "type": "invalid_request_error",
                             "param": None, "code": None}
    assert post("/nope", b"", method=method)[0] == 404


class NamesStub:
    """A scheduler stub answering ModelInfo (what Upstream learns the names from)."""

    def __init__(self, info: api.ModelInfoResponse) -> None:
        self.info, self.calls = info, 0

    async def ModelInfo(self, req, metadata, timeout):  # noqa: N802
        self.calls += 1
        return self.info


def _upstream(info: api.ModelInfoResponse, served: tuple[str, ...] = ()):
    from pagedkv.gateway.upstream import Upstream

    up = Upstream.__new__(Upstream)  # (no channel: the unit tier opens none)
    up.client = type("C", (), {"stub": NamesStub(info)})()
    up.names, up.max_model_len, up.created = served, 0, 0
    return up


def test_served_model_names_the_first_is_reported_and_another_is_404():
    info = api.ModelInfoResponse(model="a", served_model_names=["a", "b"], max_model_len=64)
    up = _upstream(info)
    assert asyncio.run(up.check_model("b", ())) == "a" and up.names == ("a", "b")
    with pytest.raises(ApiError) as e:
        asyncio.run(up.check_model("gpt-4", ()))
    assert (e.value.status, e.value.code, e.value.param, e.value.type) == (404, "model_not_found", "model",
                                                                           "not_found_error")
    assert "lists a, b" in e.value.message
    assert asyncio.run(_upstream(api.ModelInfoResponse(model="old")).check_model("old", ())) == "old"  # older one
    up = _upstream(info, served=("x", "y"))  # the gateway's own --served-model-name wins
    assert asyncio.run(up.check_model("y", ())) == "x" and up.client.stub.calls == 0
    from pagedkv.cli import build_parser

    for argv in (["--served-model-name", "a", "b"], ["--served-model-name", "a", "--served-model-name", "b"]):
        assert build_parser().parse_args(["gateway", *argv]).served_model_name == ["a", "b"]
