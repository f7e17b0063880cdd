"""LoRA adapters at the gateway (#52): the OpenAI ``model`` field may name an adapter the caller may use (asked of
the scheduler with the caller's key: each tenant sees its own), which becomes GenerateRequest.adapter on completions,
chat and the Responses API, and which answers report; any other name is 404 model_not_found; GET /v1/models lists
the caller's adapters after the model's names, with ``parent`` the model's first name (vLLM's shape)."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest

from pagedkv.api.v1 import api_pb2 as api
from pagedkv.gateway.app import Gateway, create_app
from pagedkv.gateway.errors import ApiError
from pagedkv.gateway.responses_routes import Responses
from pagedkv.gateway.responses_store import ResponsesStore
from pagedkv.gateway.upstream import Upstream
from tests.support.gateway_stub import FakeUpstream, Log, asgi
from tests.support.gateway_stub import msg as _msg

pytestmark = pytest.mark.unit

SQL, CHAT = api.AdapterInfo(name="sql", rank=8, num_bytes=1 << 20), api.AdapterInfo(name="chat", rank=16)
BY_KEY = {"Bearer alice": [SQL, CHAT], "Bearer bob": [SQL], "Bearer eve": []}  # each tenant's ModelInfo.adapters


class TenantStub:
    """A scheduler answering ModelInfo as the caller's tenant sees it (its adapters, by key)."""

    def __init__(self) -> None:
        self.calls: list = []

    async def ModelInfo(self, req, metadata, timeout):  # noqa: N802
        self.calls.append(metadata)
        key = dict(metadata).get("authorization", "")
        return api.ModelInfoResponse(model="base", served_model_names=["base", "alias"], max_model_len=64,
                                     adapters=BY_KEY.get(key, []))


def _upstream() -> Upstream:
    up = Upstream.__new__(Upstream)  # (no channel: the unit tier opens none)
    up.client = type("C", (), {"stub": TenantStub()})()
    up.names, up.max_model_len, up.max_logprobs, up.created = (), 0, 0, 0
    return up


def _key(who: str):
    return (("authorization", f"Bearer {who}"),)


def test_a_model_name_selects_the_base_model_or_an_adapter_the_caller_may_use():
    up = _upstream()
    assert asyncio.run(up.select_model("alias", _key("bob"))) == ("base", "")
    assert asyncio.run(up.select_model("sql", _key("bob"))) == ("sql", "sql")
    assert asyncio.run(up.select_model("chat", _key("alice"))) == ("chat", "chat")
    assert up.client.stub.calls[-1] == _key("alice"), "asked with the caller's own key"
    for who, name in (("bob", "chat"), ("eve", "sql"), ("alice", "nope")):  # another tenant's, none, unknown
        with pytest.raises(ApiError) as e:
            asyncio.run(up.select_model(name, _key(who)))
        assert (e.value.status, e.value.code, e.value.param) == (404, "model_not_found", "model")
        assert e.value.message == f"model: {name!r} is not served here; GET /v1/models lists base, alias and the " \
                                  "adapters you may use"
    assert asyncio.run(up.check_model("sql", _key("bob"))) == "sql"  # (/tokenize: any name that generates)


def _models(who: str) -> list[dict]:
    app = create_app(Gateway(_upstream(), Log()))
    status, _, out = asyncio.run(asgi(app, "/v1/models", b"", headers=[(b"authorization", f"Bearer {who}".encode())],
                                      method="GET"))
    assert status == 200
    return json.loads(out)["data"]


def test_v1_models_lists_the_callers_adapters_after_the_model_with_their_parent():
    data = _models("alice")
    assert [(d["id"], d["parent"], d["root"]) for d in data] == [
        ("base", None, "base"), ("alias", None, "base"), ("sql", "base", "sql"), ("chat", "base", "chat")]
    assert all(d["object"] == "model" and d["owned_by"] == "pagedkv" and d["max_model_len"] == 64 for d in data)
    assert [d["id"] for d in _models("bob")] == ["base", "alias", "sql"]
    assert [d["id"] for d in _models("eve")] == ["base", "alias"], "a tenant sees no adapter it may not use"


def _finished():
    return [_msg(text="ok", ids=[5], finish=api.FINISH_REASON_STOP, prompt=3, completion=1)]


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "hi"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/responses", {"input": "hi", "store": False}),
])
def test_completions_chat_and_responses_send_the_adapter_and_report_it(path, body):
    up = FakeUpstream(_finished(), _finished())
    up.adapters = ("sql",)
    gw = Gateway(up, Log())
    app = create_app(gw, extra_routes=Responses(gw, ResponsesStore(None), 0).routes())

    def call(model: str):
        status, _, out = asyncio.run(asgi(app, path, json.dumps({"model": model, **body}).encode()))
        return status, json.loads(out)
    status, out = call("sql")
    assert status == 200 and out["model"] == "sql", out
    status, out = call("m")
    assert status == 200 and out["model"] == "m"
    assert [r.adapter for r in up.requests] == ["sql", ""]
    status, out = call("chat")
    assert status == 404 and out["error"]["code"] == "model_not_found" and len(up.requests) == 2


def test_the_schedulers_not_found_for_an_adapter_is_openais_model_not_found():
    """(A tenants-file reload between the gateway's check and the scheduler's.)"""
    from pagedkv.gateway.errors import from_grpc

    err = from_grpc(grpc.StatusCode.NOT_FOUND, "adapter: 'sql' is not served; ModelInfo lists the adapters this "
                    "caller's tenant may use (leave adapter empty for the base model)")
    assert (err.status, err.code, err.param) == (404, "model_not_found", "model")
    assert err.message.startswith("model: 'sql' is not served;")
