"""vLLM's run-time LoRA endpoints at the gateway (#52): POST /v1/load_lora_adapter and /v1/unload_lora_adapter go
to the scheduler's LoadAdapter and UnloadAdapter with the caller's key, answer vLLM's plain-text success line, map
the scheduler's refusals to vLLM's statuses (adapter_routes.py's table), and refuse a body or a field out of bounds
(400 naming the field, 413 for the body) before anything is sent. A loaded adapter is listed by GET /v1/models for
its tenant only, and gone from it once unloaded."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest

from pagedkv.api.v1 import api_pb2 as api
from pagedkv.gateway.adapter_routes import MAX_BODY_BYTES
from pagedkv.gateway.app import Gateway, create_app
from pagedkv.gateway.fields import IGNORED_FIELDS_HEADER
from pagedkv.gateway.upstream import Upstream
from pagedkv.grpc_common import QUEUE_FULL_PREFIX
from tests.support.gateway_stub import Log, asgi, rpc_error

pytestmark = pytest.mark.unit

LOAD, UNLOAD = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"


class AdapterStub:
    """A scheduler whose tenants (by key) load and unload their own adapters; ``fail``: the next call's refusal."""

    def __init__(self) -> None:
        self.by_key: dict[str, list[api.AdapterInfo]] = {}
        self.calls: list[tuple[str, object, tuple, float]] = []
        self.fail: tuple[grpc.StatusCode, str] | None = None

    def _called(self, what: str, req, metadata, timeout) -> str:
        self.calls.append((what, req, metadata, timeout))
        if self.fail:
            raise rpc_error(*self.fail)
        return dict(metadata).get("authorization", "")

    async def ModelInfo(self, req, metadata, timeout):  # noqa: N802
        key = dict(metadata).get("authorization", "")
        return api.ModelInfoResponse(model="base", max_model_len=64, adapters=self.by_key.get(key, []))

    async def LoadAdapter(self, req, metadata, timeout):  # noqa: N802
        key = self._called("load", req, metadata, timeout)
        info = api.AdapterInfo(name=req.name, rank=8, num_pages=3, owner="" if req.public else key[7:])
        self.by_key.setdefault(key, []).append(info)
        return info

    async def UnloadAdapter(self, req, metadata, timeout):  # noqa: N802
        key = self._called("unload", req, metadata, timeout)
        self.by_key[key] = [a for a in self.by_key.get(key, []) if a.name != req.name]
        return api.UnloadAdapterResponse()


def _app():
    up = Upstream.__new__(Upstream)  # (no channel: the unit tier opens none)
    stub = AdapterStub()
    up.client = type("C", (), {"stub": stub})()
    up.names, up.max_model_len, up.max_logprobs, up.created = (), 0, 0, 0
    log = Log()
    return create_app(Gateway(up, log)), stub, log


def _post(app, path: str, body, who: str = "alice", raw: bytes | None = None, headers=()):
    data = raw if raw is not None else json.dumps(body).encode()
    status, out_headers, out = asyncio.run(asgi(app, path, data, headers=[
        (b"authorization", f"Bearer {who}".encode()), *headers]))
    return status, {k.decode(): v.decode() for k, v in out_headers.items()}, out


def _models(app, who: str) -> list[tuple[str, str | None]]:
    status, _, out = asyncio.run(asgi(app, "/v1/models", b"", headers=[(b"authorization", f"Bearer {who}".encode())],
                                      method="GET"))
    assert status == 200
    return [(d["id"], d["parent"]) for d in json.loads(out)["data"]]


def test_load_answers_vllms_line_and_v1_models_lists_the_adapter_for_its_tenant_only_until_unloaded():
    app, stub, log = _app()
    status, headers, out = _post(app, LOAD, {"lora_name": "sql", "lora_path": "adapters/sql"})
    assert (status, out) == (200, b"Success: LoRA adapter 'sql' added successfully.")
    assert headers["content-type"].startswith("text/plain") and IGNORED_FIELDS_HEADER not in headers
    what, req, metadata, timeout = stub.calls[0]
    assert (what, req) == ("load", api.LoadAdapterRequest(name="sql", path="adapters/sql", public=False))
    assert metadata == (("authorization", "Bearer alice"),), "the caller's own key goes to the scheduler"
    assert timeout > 0
    assert _models(app, "alice") == [("base", None), ("sql", "base")]
    assert _models(app, "bob") == [("base", None)], "another tenant does not see it"
    assert ("info", "adapter_loaded", {"name": "sql", "owner": "alice", "public": False, "rank": 8, "pages": 3}) \
        in log.lines

    status, _, out = _post(app, UNLOAD, {"lora_name": "sql"})
    assert (status, out) == (200, b"Success: LoRA adapter 'sql' removed successfully.")
    assert stub.calls[1][:3] == ("unload", api.UnloadAdapterRequest(name="sql"), (("authorization", "Bearer alice"),))
    assert _models(app, "alice") == [("base", None)]


def test_public_is_passed_on_and_vllms_other_fields_are_screened_by_the_gateways_policy():
    app, stub, log = _app()
    status, headers, _ = _post(app, LOAD, {"lora_name": "pub", "lora_path": "/lora/pub", "public": True,
                                           "load_inplace": False, "colour": "red"})
    assert status == 200 and stub.calls[-1][1].public
    assert headers[IGNORED_FIELDS_HEADER] == "colour", "an unknown field: accepted, named in the header"
    assert any(event == "request_fields_ignored" and kw["fields"] == ["colour"] and kw["endpoint"] ==
               "load_lora_adapter" for _, event, kw in log.lines)
    status, headers, _ = _post(app, UNLOAD, {"lora_name": "pub", "lora_int_id": 3})
    assert status == 200 and IGNORED_FIELDS_HEADER not in headers, "lora_int_id: ignored by design"
    status, _, out = _post(app, LOAD, {"lora_name": "x", "lora_path": "p", "load_inplace": True})
    err = json.loads(out)["error"]
    assert (status, err["param"]) == (400, "load_inplace") and "unload it, then load" in err["message"]
    assert len(stub.calls) == 2


ERR = grpc.StatusCode


@pytest.mark.parametrize("code, unload, details, status, param, err_code", [
    (ERR.INVALID_ARGUMENT, False, "path: no adapter_config.json in adapters/x", 400, "lora_path", None),
    (ERR.INVALID_ARGUMENT, False, "name: 'base' is the model's name", 400, "lora_name", None),
    (ERR.UNAUTHENTICATED, False, "unknown API key", 401, None, "invalid_api_key"),
    (ERR.PERMISSION_DENIED, False, "tenant alice: max_adapters is 0 in the tenants file", 403, None,
     "permission_denied"),
    (ERR.PERMISSION_DENIED, False, "public: only an admin tenant loads a public adapter", 403, None,
     "permission_denied"),
    (ERR.NOT_FOUND, False, "path: no adapter found at adapters/x under --lora-root", 404, "lora_path", "not_found"),
    (ERR.NOT_FOUND, True, "adapter: 'x' is not loaded by this tenant", 404, "lora_name", "not_found"),
    (ERR.ALREADY_EXISTS, False, "name: 'x' is already loaded", 400, "lora_name", "already_exists"),
    (ERR.FAILED_PRECONDITION, False, "the executors have no --lora-root", 400, None, "failed_precondition"),
    (ERR.FAILED_PRECONDITION, True, "adapter: 'x' is in use by 2 requests; retry when they end", 409, "lora_name",
     "failed_precondition"),
    (ERR.RESOURCE_EXHAUSTED, False, "tenant alice owns 2 adapters (its max_adapters)", 400, None,
     "resource_exhausted"),
    (ERR.RESOURCE_EXHAUSTED, False, f"{QUEUE_FULL_PREFIX}adapter loads", 429, None, "rate_limit_exceeded"),
    (ERR.UNIMPLEMENTED, False, "Method not found!", 501, None, "not_implemented"),
    (ERR.UNAVAILABLE, True, "no executor is up", 503, None, "unavailable"),
])
def test_the_schedulers_refusals_map_to_vllms_statuses(code, unload, details, status, param, err_code):
    app, stub, _ = _app()
    stub.fail = (code, details)
    body = {"lora_name": "x"} if unload else {"lora_name": "x", "lora_path": "adapters/x"}
    got, headers, out = _post(app, UNLOAD if unload else LOAD, body)
    err = json.loads(out)["error"]
    assert (got, err["param"], err["code"]) == (status, param, err_code), err
    if param:
        assert err["message"].startswith(f"{param}:"), "the message names this body's field, not the scheduler's"
    assert ("retry-after" in headers) == (status == 429)


def _refused(body=None, path: str = LOAD, raw: bytes | None = None, headers=()) -> tuple[int, dict]:
    app, stub, _ = _app()
    status, _, out = _post(app, path, body, raw=raw, headers=headers)
    assert stub.calls == [], "refused before anything is sent"
    return status, json.loads(out)["error"]


@pytest.mark.parametrize("path, body, param, words", [
    (LOAD, {"lora_path": "p"}, "lora_name", "required"),
    (LOAD, {"lora_name": "x"}, "lora_path", "required"),
    (LOAD, {"lora_name": 7, "lora_path": "p"}, "lora_name", "required"),
    (LOAD, {"lora_name": "x", "lora_path": ["p"]}, "lora_path", "required"),
    (LOAD, {"lora_name": "a" * 65, "lora_path": "p"}, "lora_name", "a name of 65 characters; must be 1 to 64"),
    (LOAD, {"lora_name": "a/b", "lora_path": "p"}, "lora_name", "'a/b'; must be 1 to 64 characters of A-Z"),
    (LOAD, {"lora_name": "x", "lora_path": "p" * 4097}, "lora_path", "4097 characters; must be 1 to 4096"),
    (LOAD, {"lora_name": "x", "lora_path": "a\x00b"}, "lora_path", "a control character"),
    (LOAD, {"lora_name": "x", "lora_path": "p", "public": "yes"}, "public", "is not a boolean"),
    (UNLOAD, {"lora_int_id": 1}, "lora_name", "required"),
    (UNLOAD, {"lora_name": "a" * 65}, "lora_name", "must be 1 to 64"),
])
def test_fields_out_of_bounds_are_a_400_naming_the_field(path, body, param, words):
    status, err = _refused(body, path)
    assert (status, err["param"]) == (400, param) and words in err["message"], err
    assert err["message"].startswith(f"{param}:")


def test_the_body_is_bounded_before_it_is_parsed():
    big = json.dumps({"lora_name": "x", "lora_path": "p" * MAX_BODY_BYTES}).encode()
    status, err = _refused(raw=big)  # (read whole: no Content-Length)
    assert (status, err["code"]) == (413, "body_too_large") and f"at most {MAX_BODY_BYTES}" in err["message"]
    status, err = _refused(raw=b"{}", headers=[(b"content-length", str(MAX_BODY_BYTES + 1).encode())])
    assert status == 413 and err["message"].startswith(f"request body: {MAX_BODY_BYTES + 1} bytes")
    assert _refused(raw=b"[1]")[0] == 400
    assert _refused(raw=b"{nope")[0] == 400
    assert _refused(raw=b"[" * 100 + b"]" * 100)[1]["code"] == "body_too_deep"


def test_two_credentials_are_refused_before_the_call_and_get_is_a_405():
    status, err = _refused({"lora_name": "x", "lora_path": "p"}, headers=[(b"x-api-key", b"k")])
    assert (status, err["code"]) == (401, "invalid_api_key")
    app, _, _ = _app()
    status, _, _ = asyncio.run(asgi(app, LOAD, b"", method="GET"))
    assert status == 405
