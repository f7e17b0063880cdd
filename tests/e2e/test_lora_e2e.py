"""LoRA adapters through real processes on loopback (#52): ``pagedkv serve --http-port`` serving tiny-llama with two
adapters made and saved by PEFT (``--lora-modules``) and a tenants file in which one tenant may use only one of
them. Greedy ids through gRPC's ``adapter`` and through the OpenAI SDK's ``model=<adapter>`` equal PEFT's greedy for
that adapter, the base model's equal transformers'; the same prompt under each adapter and the base model shares no
cached page, and under one adapter hits; a tenant not allowed an adapter gets NOT_FOUND (gRPC) and 404
model_not_found (HTTP), as for an adapter nobody serves; /v1/models lists each caller's adapters with their
parent."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import grpc
import openai
import pytest

from pagedkv.cli import free_port
from pagedkv.client import Client
from pagedkv.tenancy import hash_key
from tests.conftest import Server
from tests.support.hf_reference import random_prompts
from tests.support.lora_helpers import make_adapter, peft_greedy, peft_reference

pytestmark = pytest.mark.e2e

MODEL = "tiny-llama"
ALL, SQL_ONLY = "key-lora-all", "key-lora-sql"
TENANTS = f"""
[tenants.all]
keys = ["{hash_key(ALL)}"]

[tenants.sql_only]
keys = ["{hash_key(SQL_ONLY)}"]
adapters = ["sql"]
"""
SPECS = {"sql": (8, ["q_proj", "v_proj"]), "chat": (4, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                        "up_proj", "down_proj"])}
N = 12  # tokens generated


@pytest.fixture(scope="module")
def stack(tiny_llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    adapters = {name: make_adapter(tiny_llama_dir, root / name, r, targets, seed=20 + i)
                for i, (name, (r, targets)) in enumerate(SPECS.items())}
    tenants = root / "tenants.toml"
    tenants.write_text(TENANTS)
    http = free_port()
    server = Server("--http-port", str(http), "--num-pages", "128", "--tenants-file", str(tenants), "--threads", "1",
                    "--lora-modules", *(f"{name}={path}" for name, path in adapters.items()))
    yield server, f"http://127.0.0.1:{http}/v1", peft_reference(tiny_llama_dir, adapters)
    assert server.stop() == 0, server.log()


async def _grpc(address: str, key: str, prompt: list[int], adapter: str):
    async with Client(address, api_key=key) as client:
        return await client.complete(prompt, max_tokens=N, temperature=0, ignore_eos=True, adapter=adapter)


def test_greedy_ids_equal_pefts_per_adapter_and_the_cache_keeps_adapters_apart(stack):
    server, _, peft = stack
    (prompt,) = random_prompts(5, [40], 259)  # (2 full pages of 16)
    outs = {}
    for adapter in ("", "sql", "chat"):
        out = asyncio.run(_grpc(server.address, ALL, prompt, adapter))
        assert out.token_ids == peft_greedy(peft, adapter or None, prompt, N), adapter or "base"
        assert out.cached_tokens == 0, f"{adapter or 'base'}: no page of another adapter's (or the base's) KV"
        outs[adapter] = out.token_ids
    assert len({tuple(ids) for ids in outs.values()}) == 3, "the adapters change the greedy ids"
    again = asyncio.run(_grpc(server.address, ALL, prompt, "sql"))
    assert again.token_ids == outs["sql"] and again.cached_tokens == 32, "the same adapter hits its own pages"


def test_the_openai_sdk_selects_an_adapter_by_model_and_lists_the_callers(stack):
    server, base, peft = stack
    (prompt,) = random_prompts(6, [20], 259)
    c = openai.OpenAI(base_url=base, api_key=ALL, max_retries=0, timeout=120)
    for name in ("sql", "chat", MODEL):
        r = c.completions.create(model=name, prompt=prompt, max_tokens=N, temperature=0, logprobs=0,
                                 extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
        ids = [int(t.removeprefix("token_id:")) for t in r.choices[0].logprobs.tokens]
        assert ids == peft_greedy(peft, None if name == MODEL else name, prompt, N) and r.model == name
    listed = [(m.id, getattr(m, "parent", None)) for m in c.models.list().data]
    assert listed == [(MODEL, None), ("sql", MODEL), ("chat", MODEL)]
    mine = openai.OpenAI(base_url=base, api_key=SQL_ONLY, max_retries=0, timeout=120)
    assert [(m.id, getattr(m, "parent", None)) for m in mine.models.list().data] == [(MODEL, None), ("sql", MODEL)]


def test_an_adapter_the_tenant_may_not_use_is_not_found_as_one_not_served(stack):
    server, base, _ = stack
    errors = {}
    for name in ("chat", "nope"):
        try:
            asyncio.run(_grpc(server.address, SQL_ONLY, [1, 5, 6], name))
        except grpc.aio.AioRpcError as err:
            errors[name] = (err.code(), err.details().replace(repr(name), "NAME"))
    assert errors["chat"] == errors["nope"] and errors["chat"][0] == grpc.StatusCode.NOT_FOUND
    assert "adapter" in errors["chat"][1] and "ModelInfo" in errors["chat"][1]
    mine = openai.OpenAI(base_url=base, api_key=SQL_ONLY, max_retries=0, timeout=60)
    for name in ("chat", "nope"):
        with pytest.raises(openai.NotFoundError) as e:
            mine.chat.completions.create(model=name, messages=[{"role": "user", "content": "x"}], max_tokens=2)
        assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"


def test_pagedkv_generate_takes_an_adapter(stack):
    """`pagedkv generate --adapter NAME`: the adapter's text, as the gRPC client gets it."""
    server, _, _ = stack

    async def text(adapter: str) -> str:
        async with Client(server.address, api_key=ALL) as client:
            return (await client.complete("The cat", max_tokens=N, temperature=0, ignore_eos=True,
                                          adapter=adapter)).text
    for adapter in ("sql", ""):
        flag = ["--adapter", adapter] if adapter else []
        cmd = [sys.executable, "-m", "pagedkv", "generate", "The cat", "--address", server.address, "--api-key", ALL,
               "--max-tokens", str(N), "--temperature", "0", "--ignore-eos", *flag]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        assert done.stdout == asyncio.run(text(adapter)) + "\n", adapter or "base"
        assert f"completion_tokens={N}]" in done.stderr
