"""``pagedkv gateway --edge-upstream`` (a real process on loopback) in front of a stand-in for Dynamo's frontend: an
HTTP server in this process that records what reaches it and answers as an OpenAI frontend does. The edge checks
keys itself, replaces the client's routing hints (nvext.cache_salt, x-dynamo-meta-*) with the tenant's, streams
SSE through as it comes, relays upstream errors as they are, and its /health follows the upstream's."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from pagedkv.cli import free_port
from pagedkv.fleet_salt import TENANT_META_HEADER, cache_salt, verify_assertion
from pagedkv.tenancy import hash_key
from tests.support import procs

pytestmark = pytest.mark.e2e

MAX_RESPONSE_BYTES = 64 << 10  # the edge's --max-response-bytes (its least)
FLEET_SECRET = "fleet-secret-for-the-edge-test-0123"
KEY_A, KEY_B = "key-edge-alpha", "key-edge-beta"
TENANTS = f"""
[tenants.alpha]
keys = ["{hash_key(KEY_A)}"]

[tenants.beta]
keys = ["{hash_key(KEY_B)}"]
"""


class FakeFrontend:
    """What Dynamo's frontend would be sent, recorded (path, headers, body); its answers: JSON, SSE (the rest of a
    stream only once ``release`` is set: the client's first chunk shows nothing was held back), a 404 for the
    model "missing", and /health with ``health_status``."""

    def __init__(self) -> None:
        self.received: list[tuple[str, dict[str, str], dict | None]] = []
        self.release = threading.Event()
        self.health_status = 200
        frontend = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def _answer(self, status: int, obj) -> None:
                body = json.dumps(obj).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:  # noqa: N802
                if self.path == "/health":
                    return self._answer(frontend.health_status, {"status": "healthy"})
                frontend.received.append((self.path, dict(self.headers.items()), None))
                self._answer(200, {"object": "list", "data": [{"id": "tiny", "object": "model"}]})

            def do_POST(self) -> None:  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                frontend.received.append((self.path, {k.lower(): v for k, v in self.headers.items()}, body))
                if body.get("model") == "missing":
                    return self._answer(404, {"error": {"message": "model missing not found", "code": 404}})
                if body.get("prompt") == "big" and not body.get("stream"):
                    return self._answer(200, {"choices": [{"text": "x" * 2 * MAX_RESPONSE_BYTES}]})
                if body.get("prompt") in ("big", "big-at-once"):  # an SSE stream twice the edge's bound
                    self.send_response(200)
                    self.send_header("content-type", "text/event-stream")
                    self.send_header("connection", "close")
                    self.end_headers()
                    event = b'data: {"choices":[{"text":"' + b"y" * 990 + b'"}]}\n\n'
                    events = [event] * (2 * MAX_RESPONSE_BYTES // 1024)
                    if body["prompt"] == "big-at-once":  # four events, then the rest in one write (as a relay that
                        self.wfile.write(b"".join(events[:4]))  # reads late finds them: a chunk of many events)
                        time.sleep(0.3)
                        events = [b"".join(events[4:])]
                    for piece in events:
                        self.wfile.write(piece)
                    self.close_connection = True
                    return
                if not body.get("stream"):
                    return self._answer(200, {"id": "cmpl-1", "object": "text_completion",
                                              "choices": [{"index": 0, "text": "hello", "finish_reason": "stop"}]})
                self.send_response(200)
                self.send_header("content-type", "text/event-stream")
                self.send_header("connection", "close")
                self.end_headers()
                self.wfile.write(b'data: {"choices":[{"index":0,"text":"first"}]}\n\n')
                self.wfile.flush()
                frontend.release.wait(60)
                self.wfile.write(b'data: {"choices":[{"index":0,"text":"second"}]}\n\ndata: [DONE]\n\n')
                self.wfile.flush()
                self.close_connection = True

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def edge(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("edge")
    (tmp / "tenants.toml").write_text(TENANTS)
    (tmp / "fleet.secret").write_text(FLEET_SECRET)
    frontend = FakeFrontend()
    gateway = procs.Proc("gateway", "--edge-upstream", frontend.url, "--tenants-file", str(tmp / "tenants.toml"),
                         "--fleet-secret-file", str(tmp / "fleet.secret"), "--max-streams", "1",
                         "--max-response-bytes", str(MAX_RESPONSE_BYTES))
    client = httpx.Client(base_url=f"http://127.0.0.1:{gateway.port}", timeout=60)
    yield frontend, client, gateway
    client.close()
    code = gateway.stop(30)
    frontend.close()
    assert code == 0, gateway.log()[-3000:]


def test_the_key_is_checked_at_the_edge(edge):
    frontend, client, _ = edge
    before = len(frontend.received)
    body = {"model": "tiny", "prompt": "hi"}
    for headers in ({}, {"authorization": "Bearer not-a-key"}):
        r = client.post("/v1/completions", json=body, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text
    assert client.get("/v1/models").status_code == 401
    assert len(frontend.received) == before, "a refused request reached the upstream"
    r = client.get("/v1/models", headers={"authorization": f"Bearer {KEY_B}"})
    assert r.status_code == 200 and r.json()["data"][0]["id"] == "tiny"


def test_client_routing_hints_are_replaced_by_the_tenants(edge):
    frontend, client, _ = edge
    forged = {"x-dynamo-meta-pagedkv-tenant": "beta.9999999999." + "0" * 64, "x-dynamo-meta-tenant": "beta",
              "x-pagedkv-tenant": "beta", "x-gateway-inference-fairness-id": "beta",
              "x-dynamo-request-priority": "9", "x-request-id": "req-edge-1"}
    body = {"model": "tiny", "prompt": "hi", "nvext": {"cache_salt": cache_salt(FLEET_SECRET.encode(), "beta"),
                                                       "ignore_eos": True}}
    r = client.post("/v1/completions", json=body, headers={"authorization": f"Bearer {KEY_A}", **forged})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "hello", r.text
    path, headers, sent = frontend.received[-1]
    assert path == "/v1/completions"
    assert sent["nvext"] == {"cache_salt": cache_salt(FLEET_SECRET.encode(), "alpha"), "ignore_eos": True}
    assert verify_assertion(FLEET_SECRET.encode(), headers[TENANT_META_HEADER]) == "alpha"
    dropped = [h for h in headers if h.startswith(("x-dynamo-", "x-pagedkv-", "x-gateway-")) or h == "authorization"]
    assert dropped == [TENANT_META_HEADER], headers
    assert headers["x-request-id"] == "req-edge-1"
    # beta's own request: its salt and its assertion
    client.post("/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": "x"}]},
                headers={"authorization": f"Bearer {KEY_B}"})
    path, headers, sent = frontend.received[-1]
    assert path == "/v1/chat/completions" and sent["nvext"] == {"cache_salt": cache_salt(FLEET_SECRET.encode(), "beta")}
    assert verify_assertion(FLEET_SECRET.encode(), headers[TENANT_META_HEADER]) == "beta"
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": "x", "nvext": "salt"},
                    headers={"authorization": f"Bearer {KEY_A}"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "nvext"


STREAM = {"model": "tiny", "prompt": "hi", "stream": True}


def test_a_stream_passes_through_as_it_comes(edge):
    frontend, client, _ = edge
    frontend.release.clear()
    with client.stream("POST", "/v1/completions", json=STREAM, headers={"authorization": f"Bearer {KEY_A}"}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = r.iter_lines()
        first = next(line for line in lines if line)
        assert json.loads(first.removeprefix("data: "))["choices"][0]["text"] == "first"  # before the rest exists
        over = client.post("/v1/completions", json=STREAM, headers={"authorization": f"Bearer {KEY_A}"})
        assert over.status_code == 429 and "--max-streams" in over.json()["error"]["message"]  # (1 relayed now)
        frontend.release.set()
        rest = [line for line in lines if line]
    assert rest == ['data: {"choices":[{"index":0,"text":"second"}]}', "data: [DONE]"]


@pytest.mark.parametrize("prompt", ["big", "big-at-once"])
def test_an_answer_past_max_response_bytes_is_cut(edge, prompt):
    """Cut at the last whole event within the bound, also when the events come in one chunk (NOTE: seen in CI: under
    load the relay read them late, together, and sent none of them but the error event)."""
    _, client, _ = edge
    auth = {"authorization": f"Bearer {KEY_A}"}
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": "big"}, headers=auth)
    assert r.status_code == 502 and "--max-response-bytes" in r.json()["error"]["message"]
    with client.stream("POST", "/v1/completions", json={"model": "tiny", "prompt": prompt, "stream": True},
                       headers=auth) as r:
        body = r.read()
    assert MAX_RESPONSE_BYTES - 1024 < len(body) < MAX_RESPONSE_BYTES + 1024
    last = body.rstrip().rsplit(b"\n\n", 1)[-1]
    assert last.startswith(b"data: ") and "it was cut here" in json.loads(last[6:])["error"]["message"]


def _disconnects(client: httpx.Client) -> float:
    text = client.get("/metrics").text
    m = re.search(r'^pagedkv_gateway_requests_total\{endpoint="completions",status="499"\} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def test_a_client_gone_mid_stream_ends_the_relay(edge):
    frontend, client, _ = edge
    frontend.release.clear()
    before = _disconnects(client)
    with client.stream("POST", "/v1/completions", json=STREAM, headers={"authorization": f"Bearer {KEY_A}"}) as r:
        assert next(line for line in r.iter_lines() if line).startswith("data: ")
    # (closed with the rest not yet sent: the edge sees the client go, closes the upstream and frees the stream)
    try:
        assert procs.wait_for(lambda: _disconnects(client) == before + 1, 30)
        r = client.post("/v1/completions", json={"model": "tiny", "prompt": "hi"},
                        headers={"authorization": f"Bearer {KEY_A}"})
        assert r.status_code == 200, r.text  # (--max-streams 1: the gone stream no longer counts)
    finally:
        frontend.release.set()


def test_upstream_errors_and_health_are_relayed(edge):
    frontend, client, _ = edge
    r = client.post("/v1/completions", json={"model": "missing", "prompt": "hi"},
                    headers={"authorization": f"Bearer {KEY_A}"})
    assert r.status_code == 404 and r.json() == {"error": {"message": "model missing not found", "code": 404}}
    assert client.get("/health").status_code == 200
    frontend.health_status = 503
    try:
        r = client.get("/health")
        assert r.status_code == 503 and "not serving (503)" in r.json()["error"]["message"]
    finally:
        frontend.health_status = 200
    assert client.post("/tokenize", json={"prompt": "x"}).status_code == 404  # (the edge serves the OpenAI routes only)


def test_an_unreachable_upstream_is_502(tmp_path):
    (tmp_path / "tenants.toml").write_text(TENANTS)
    (tmp_path / "fleet.secret").write_text(FLEET_SECRET)
    port = free_port()  # (nothing listens there)
    gateway = procs.Proc("gateway", "--edge-upstream", f"http://127.0.0.1:{port}", "--tenants-file",
                         str(tmp_path / "tenants.toml"), "--fleet-secret-file", str(tmp_path / "fleet.secret"))
    try:
        r = httpx.post(f"http://127.0.0.1:{gateway.port}/v1/completions", json={"model": "tiny", "prompt": "x"},
                       headers={"authorization": f"Bearer {KEY_A}"}, timeout=30)
        assert r.status_code == 502 and "cannot be reached" in r.json()["error"]["message"]
        assert httpx.get(f"http://127.0.0.1:{gateway.port}/health", timeout=30).status_code == 503
    finally:
        assert gateway.stop(30) == 0


@pytest.mark.parametrize(("args", "error"), [
    (("--edge-upstream", "http://127.0.0.1:9"), "--edge-upstream needs --tenants-file"),
    (("--edge-upstream", "ftp://x", "--tenants-file", "T", "--fleet-secret-file", "S"), "--edge-upstream 'ftp://x'"),
    (("--tenants-file", "T"), "--tenants-file: only with --edge-upstream"),
    (("--trust-gie-headers",), "--trust-gie-headers needs --trusted-hop-secret-file"),
])
def test_edge_flags_are_checked(tmp_path, args, error):
    (tmp_path / "T").write_text(TENANTS)
    (tmp_path / "S").write_text(FLEET_SECRET)
    env = {**os.environ, "PAGEDKV_FLEET_SECRET": "", "PAGEDKV_TRUSTED_HOP_SECRET": "", "PYTHONPATH": str(procs.ROOT)}
    r = subprocess.run([sys.executable, "-m", "pagedkv", "gateway", *args], cwd=tmp_path, capture_output=True,
                       text=True, timeout=60, env=env)
    assert r.returncode == 1 and error in r.stderr, r.stderr
