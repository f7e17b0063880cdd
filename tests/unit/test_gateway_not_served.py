"""What the gateway does not serve gets OpenAI's error shape saying why (#48): /v1/embeddings (and vLLM's other
pooling endpoints) a 400 naming the generation model and embeddings, never a bare 404; an unknown path a 404
naming it and every endpoint that exists. The openai SDK reads both as its typed errors."""

from __future__ import annotations

import asyncio
import json

import pytest

from pagedkv.gateway.app import Gateway, create_app
from pagedkv.gateway.not_served import POOLING
from tests.unit.test_gateway_unit import FakeUpstream, Log, asgi

pytestmark = pytest.mark.unit


def _call(path: str, body: bytes = b"{}", method: str = "POST") -> tuple[int, dict]:
    app = create_app(Gateway(FakeUpstream(), Log()))
    status, _, data = asyncio.run(asgi(app, path, body, method=method))
    return status, json.loads(data)["error"]


def test_embeddings_is_refused_naming_why():
    body = json.dumps({"model": "m", "input": "hello"}).encode()
    status, error = _call("/v1/embeddings", body)
    assert status == 400 and error["type"] == "invalid_request_error" and error["code"] == "model_not_supported"
    assert error["param"] == "model"
    assert error["message"].startswith("/v1/embeddings: this server does not serve embeddings; the served model "
                                       "is a generation model")
    assert "POST /v1/chat/completions" in error["message"] and "/v1/embeddings" not in error["message"][16:]


@pytest.mark.parametrize("path", sorted(POOLING))
def test_every_pooling_endpoint_says_the_same(path):
    status, error = _call(path)
    assert status == 400 and POOLING[path] in error["message"] and "generation model" in error["message"]


@pytest.mark.parametrize("path, method", [("/v1/nothing", "POST"), ("/v1/chat/complete", "POST"),
                                          ("/v2/models", "GET")])
def test_an_unknown_path_is_a_404_naming_it_and_the_endpoints(path, method):
    status, error = _call(path, method=method)
    assert status == 404 and error["type"] == "not_found_error" and error["code"] == "not_found"
    assert error["message"].startswith(f"{method} {path}: no such endpoint; this server answers ")
    for served in ("POST /v1/completions", "POST /v1/chat/completions", "GET /v1/models", "POST /tokenize",
                   "GET /health"):
        assert served in error["message"]
    assert "/v1/embeddings" not in error["message"]  # (listed as served it would not be)
