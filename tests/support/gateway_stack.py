"""``pagedkv gateway`` in front of a real scheduler and executor on loopback, every link with TLS and a tenants
file, for tests/e2e/test_gateway_e2e.py: the stack that starts them (with clients for the OpenAI SDK, gRPC and plain
HTTPS), and the helpers its tests share."""

from __future__ import annotations

import asyncio
import json
import ssl
import subprocess
import sys
import urllib.error
import urllib.request

import openai

from pagedkv.client import Client
from pagedkv.tenancy import hash_key
from tests.support import procs
from tests.support.chat_template import TEMPLATE

KEY, ADMIN_KEY = "key-gw-user", "key-gw-ops"
TENANTS = f"""
[tenants.user]
keys = ["{hash_key(KEY)}"]
revoked_keys = ["{hash_key('key-gw-revoked')}"]

[tenants.ops]
keys = ["{hash_key(ADMIN_KEY)}"]
admin = true
"""
MODEL = "chat-tiny"  # --served-model-name


class Stack:
    model_dir = None

    def __init__(self, tmp) -> None:
        from transformers import AutoTokenizer

        from pagedkv.tools.random_model import build_random_model

        path = build_random_model(tmp / "model", seed=5, hidden_size=64, intermediate_size=128, num_layers=2,
                                  num_heads=4, num_kv_heads=2)
        tok = AutoTokenizer.from_pretrained(str(path))
        tok.chat_template = TEMPLATE
        tok.save_pretrained(str(path))
        self.model_dir = path
        self.tokenizer = AutoTokenizer.from_pretrained(str(path))
        certs = tmp / "certs"
        r = subprocess.run([sys.executable, "-m", "pagedkv", "gen-certs", "--out", str(certs), "--hosts", "scheduler"],
                           cwd=procs.ROOT, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        self.certs, self.ca = certs, str(certs / "ca.pem")
        tls = ("--tls-cert", str(certs / "server.pem"), "--tls-key", str(certs / "server.key"))
        (tmp / "tenants.toml").write_text(TENANTS)
        self.procs: list[procs.Proc] = []
        self.executor = self._start(lambda: procs.executor("--model", str(path), "--num-pages", "256"))
        self.scheduler = self._start(lambda: procs.scheduler(self.executor.address, args=(
            "--tenants-file", str(tmp / "tenants.toml"), "--trust-request-chat-template", *tls)))
        self.gateway = self._start(lambda: procs.Proc("gateway", "--address", self.scheduler.address, "--tls-ca",
                                                      self.ca, "--served-model-name", MODEL, *tls))
        self.base = f"https://127.0.0.1:{self.gateway.port}"

    def _start(self, start):
        try:
            p = start()
        except Exception:
            self.stop()
            raise
        self.procs.append(p)
        return p

    def stop(self) -> list[int | None]:
        return [p.stop(60) for p in reversed(self.procs)]

    def openai(self, key: str | None = KEY, **kw) -> openai.OpenAI:
        http = openai.DefaultHttpxClient(verify=ssl.create_default_context(cafile=self.ca))
        return openai.OpenAI(base_url=f"{self.base}/v1", api_key=key or "", max_retries=0, http_client=http,
                             timeout=60, **kw)

    def grpc(self, key: str = KEY) -> Client:
        return Client(self.scheduler.address, api_key=key, tls_ca=self.ca)

    def post(self, path: str, body: dict, key: str | None = KEY, method: str = "POST") -> tuple[int, dict]:
        ctx = ssl.create_default_context(cafile=self.ca)
        headers = {"content-type": "application/json", **({"authorization": f"Bearer {key}"} if key else {})}
        req = urllib.request.Request(self.base + path, json.dumps(body).encode(), headers, method=method)
        try:
            with urllib.request.urlopen(req, timeout=30, context=ctx) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read())

    def get(self, path: str) -> tuple[int, str]:
        ctx = ssl.create_default_context(cafile=self.ca)
        try:
            with urllib.request.urlopen(self.base + path, timeout=10, context=ctx) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as err:
            return err.code, err.read().decode()


def ids_of(logprobs_tokens: list[str]) -> list[int]:
    assert all(t.startswith("token_id:") for t in logprobs_tokens)
    return [int(t.removeprefix("token_id:")) for t in logprobs_tokens]


def run(coro):
    return asyncio.run(coro)


async def grpc_complete(stack: Stack, prompt=None, **params):
    async with stack.grpc() as c:
        if params.get("n", 1) > 1:
            return await c.complete_n(prompt, **params)
        return await c.complete(prompt, **params)


def compose_gateway() -> dict:
    import yaml

    return yaml.safe_load((procs.ROOT / "docker-compose.yml").read_text())["services"]["gateway"]
