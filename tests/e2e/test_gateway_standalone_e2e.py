"""``pagedkv gateway`` without the TLS stack of test_gateway_e2e.py: with no scheduler to reach it answers 503
(and /health says so), and ``pagedkv serve --http-port`` runs it as a child that learns the scheduler's names (vLLM's
--served-model-name a b), lists both on /v1/models, answers either, reports the first, and refuses another name."""

from __future__ import annotations

import urllib.error
import urllib.request

import openai
import pytest

from pagedkv.cli import free_port
from pagedkv.local_server import LocalServer
from tests.support import procs
from tests.support.gateway_stack import MODEL

pytestmark = pytest.mark.e2e


def test_no_scheduler_is_503():
    gw = procs.Proc("gateway", "--address", f"127.0.0.1:{free_port()}", "--served-model-name", MODEL)
    try:
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{gw.port}/v1", api_key="k", max_retries=0, timeout=30)
        with pytest.raises(openai.InternalServerError) as e:
            c.completions.create(model=MODEL, prompt="x", max_tokens=2)
        assert e.value.status_code == 503
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(f"http://127.0.0.1:{gw.port}/health", timeout=10)
        assert e.value.code == 503
    finally:
        assert gw.stop() == 0, gw.log()


def test_serve_http_port_runs_the_gateway_as_a_child(model_cache):
    """serve's gateway learns the scheduler's names (vLLM's --served-model-name a b): /v1/models lists both, either
    may be asked for, answers report the first, another name is 404 model_not_found."""
    port = free_port()
    server = LocalServer("--http-port", str(port), "--num-pages", "64", "--served-model-name", "tiny", "tiny-alias")
    try:
        assert f"HTTP (OpenAI API) on 127.0.0.1:{port}" in server.log()
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=60)
        assert [m.id for m in c.models.list().data] == ["tiny", "tiny-alias"]
        out = list(c.completions.create(model="tiny-alias", prompt="serve", max_tokens=5, stream=True,
                                        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
        assert out[-1].usage.completion_tokens == 5 and {ch.model for ch in out} == {"tiny"}
        with pytest.raises(openai.NotFoundError) as e:
            c.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "x"}])
        assert e.value.body["code"] == "model_not_found"
    finally:
        assert server.stop() == 0, server.log()
