"""The flags vLLM users type (#48, point 5), served by real ``pagedkv serve`` processes on loopback:

- ``--api-key``: no key or a wrong one gets UNAUTHENTICATED over gRPC and 401 over HTTP, the key gets answers;
  with ``--tenants-file`` too, serve stops at once, naming both flags;
- ``--chat-template FILE`` on tiny-llama (a generated checkpoint without a chat template): chat requests render with
  it, as transformers renders it; a missing file or a template that does not compile stops serve in one line;
- ``--log-level``: at info a few requests log no per-request line and at least one stats line with its fields; at
  debug the per-request lines are there;
- ``--model ORG/NAME`` with HF_HUB_OFFLINE=1 against a Hugging Face cache the test builds: a hit serves and
  answers, a miss stops serve in one line that says it needs the network.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request

import grpc
import pytest

from pagedkv.cli import free_port
from pagedkv.client import Client
from pagedkv.local_server import ROOT, LocalServer
from tests.conftest import wait_until
from tests.support.chat_template import TEMPLATE, template_ids

pytestmark = pytest.mark.e2e

KEY = "sk-test-0123456789"
STATS_FIELDS = ("prompt_tok_s", "generation_tok_s", "running", "waiting", "swapped", "kv_usage_pct",
                "prefix_hit_rate_pct")
PER_REQUEST = ("request_admitted", "request_finished")
COMPLETION = {"model": "tiny-llama", "prompt": "Hello", "max_tokens": 2}


def post(url: str, body: dict, key: str = "") -> tuple[int, dict]:
    headers = {"content-type": "application/json", **({"authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(url, json.dumps(body).encode(), headers)
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")


def serve_fails(*args: str, env: dict | None = None) -> tuple[int, list[str]]:
    """serve run with ``args`` that must stop on its own: (exit code, its stderr lines)."""
    proc = subprocess.run([sys.executable, "-m", "pagedkv", "serve", "--port", str(free_port()), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, env=env)
    return proc.returncode, [line for line in proc.stderr.splitlines() if line.strip()]


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    """serve with --api-key, --chat-template FILE, the gateway, at --log-level info with a stats line each second."""
    template = tmp_path_factory.mktemp("template") / "chat.jinja"
    template.write_text(TEMPLATE)
    http = free_port()
    server = LocalServer("--api-key", KEY, "--chat-template", str(template), "--http-port", str(http),
                         "--log-level", "info", "--log-stats-interval", "1", "--threads", "1", "--log-format", "json")
    server.url = f"http://127.0.0.1:{http}"
    yield server
    server.stop()


async def _grpc_answers(address: str, key: str) -> int:
    async with Client(address, api_key=key) as client:
        return len((await client.complete("Hello", max_tokens=4, ignore_eos=True, temperature=0)).token_ids)


def test_api_key_is_asked_over_grpc_and_http(keyed):
    for key in ("", "sk-wrong"):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            asyncio.run(_grpc_answers(keyed.address, key))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        status, body = post(f"{keyed.url}/v1/completions", COMPLETION, key)
        assert status == 401 and body["error"]["code"] == "invalid_api_key"
    assert asyncio.run(_grpc_answers(keyed.address, KEY)) == 4
    status, body = post(f"{keyed.url}/v1/completions", COMPLETION, KEY)
    assert status == 200 and body["usage"]["completion_tokens"] == 2


def test_chat_template_flag_renders_chats_for_a_checkpoint_without_one(keyed):
    from transformers import AutoTokenizer

    from pagedkv.models import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model("tiny-llama")))
    assert tokenizer.chat_template is None  # (the checkpoint has none: chat needs the flag)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    chat = {"model": "tiny-llama", "messages": messages, "max_tokens": 1}
    status, body = post(f"{keyed.url}/v1/chat/completions", chat, KEY)
    assert status == 200, body
    assert body["usage"]["prompt_tokens"] == len(template_ids(tokenizer, messages, chat_template=TEMPLATE))


def test_info_level_logs_stats_lines_not_requests(keyed):
    for _ in range(3):
        assert asyncio.run(_grpc_answers(keyed.address, KEY)) == 4
    assert wait_until(lambda: any(e.get("event") == "stats" and e["generation_tok_s"] > 0 for e in keyed.events), 30)
    stats = [e for e in keyed.events if e.get("event") == "stats"]
    assert all(field in stats[0] for field in STATS_FIELDS) and stats[0]["level"] == "info"
    assert not [e for e in keyed.events if e.get("event") in PER_REQUEST]


def test_debug_level_logs_each_request():
    server = LocalServer("--log-level", "debug", "--threads", "1", "--log-format", "json")
    try:
        assert asyncio.run(_grpc_answers(server.address, "")) == 4
        assert wait_until(lambda: all(server.saw(event) for event in PER_REQUEST), 30), server.log()
    finally:
        server.stop()


@pytest.mark.parametrize("args,names", [
    (("--api-key", KEY, "--tenants-file", "tenants.toml"), ("--api-key", "--tenants-file")),
    (("--chat-template", "/no/such/chat.jinja"), ("--chat-template", "no such file")),
    (("--chat-template", "{% if x %}unclosed"), ("--chat-template", "does not compile")),
])
def test_serve_refuses_bad_flags_at_once_in_one_line(tmp_path, args, names):
    (tmp_path / "tenants.toml").write_text("[tenants.a]\nkeys = []\n")
    args = tuple(str(tmp_path / a) if a == "tenants.toml" else a for a in args)
    code, lines = serve_fails(*args)
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and all(n in lines[0] for n in names)


@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    """HF_HOME at a fresh folder, HF_HUB_OFFLINE=1 (for this test and the servers it starts)."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return tmp_path / "hf" / "hub"


def test_hub_model_found_in_the_cache_serves_offline(offline_hub):
    from pagedkv.models import resolve_model

    revision = "a" * 40
    snapshot = offline_hub / "models--acme--tiny-llama" / "snapshots" / revision
    shutil.copytree(resolve_model("tiny-llama"), snapshot)
    (offline_hub / "models--acme--tiny-llama" / "refs").mkdir()
    (offline_hub / "models--acme--tiny-llama" / "refs" / "main").write_text(revision)
    server = LocalServer("--model", "acme/tiny-llama", "--threads", "1")
    try:
        assert asyncio.run(_grpc_answers(server.address, "")) == 4
        assert "model acme/tiny-llama" in server.log()
    finally:
        server.stop()


def test_hub_model_missing_offline_says_it_needs_the_network(offline_hub):
    started = time.monotonic()
    code, lines = serve_fails("--model", "acme/absent", env=dict(os.environ))
    assert code == 2 and len(lines) == 1, lines
    assert "acme/absent" in lines[0] and "HF_HUB_OFFLINE" in lines[0] and "needs the network" in lines[0]
    assert str(offline_hub / "models--acme--absent") in lines[0]
    print(f"hub miss refused in {time.monotonic() - started:.1f} s")
