"""Through real processes: a checkpoint with a chat template and a generation_config.json that sets temperature,
top_p, repetition_penalty and min_p (with do_sample false, which vLLM does not read). Its defaults travel executor ->
Describe -> scheduler -> ModelInfo and apply, as vLLM applies them, to requests that leave them unset; chat messages
render with its template, from the client and from ``pagedkv generate --chat``."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest

from pagedkv.client import Client
from tests.support import procs
from tests.support.chat_template import TEMPLATE, template_ids

pytestmark = pytest.mark.e2e

GENERATION_CONFIG = {"bos_token_id": 1, "eos_token_id": 2, "do_sample": False, "temperature": 0.6, "top_p": 0.9,
                     "repetition_penalty": 1.3, "min_p": 0.02}
MODEL_DEFAULTS = dict(temperature=0.6, top_p=0.9, top_k=0, repetition_penalty=1.3, min_p=0.02)


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    from transformers import AutoTokenizer

    from pagedkv.tools.random_model import build_random_model

    # initializer_range 0.02: nearly flat logits, so that sampling (unlike greedy) varies with the seed
    path = build_random_model(tmp_path_factory.mktemp("chat-model"), seed=11, hidden_size=64, intermediate_size=128,
                              num_layers=2, num_heads=4, num_kv_heads=2, initializer_range=0.02)
    (path / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG))
    tok = AutoTokenizer.from_pretrained(str(path))
    tok.chat_template = TEMPLATE
    tok.save_pretrained(str(path))
    return path, AutoTokenizer.from_pretrained(str(path))


@pytest.fixture(scope="module")
def server(chat_model):
    executor = procs.executor("--model", str(chat_model[0]), "--num-pages", "64")
    try:
        scheduler = procs.scheduler(executor.address, args=("--max-model-len", "256"))
    except Exception:
        executor.stop()
        raise
    yield scheduler.address
    scheduler.stop()
    executor.stop()


def test_defaults_and_chat_through_the_processes(server, chat_model):
    tokenizer = chat_model[1]
    messages = [("system", "Be brief."), ("user", "Hi")]
    expected = template_ids(tokenizer, [{"role": r, "content": c} for r, c in messages])

    async def scenario():
        async with Client(server) as c:
            info = await c.model_info()
            chat = await c.complete(messages=messages, temperature=0, max_tokens=4, ignore_eos=True)
            ids = await c.complete(expected, temperature=0, max_tokens=4, ignore_eos=True)
            tokenized = await c.tokenize(messages=messages)
            unset, explicit, unpenalized, greedy = [], [], [], []
            for seed in range(4):
                common = dict(max_tokens=12, seed=seed, ignore_eos=True)
                unset.append((await c.complete("abc", **common)).token_ids)
                explicit.append((await c.complete("abc", **MODEL_DEFAULTS, **common)).token_ids)
                plain = {**MODEL_DEFAULTS, "repetition_penalty": 1.0, "min_p": 0.0}
                unpenalized.append((await c.complete("abc", **plain, **common)).token_ids)
                greedy.append((await c.complete("abc", temperature=0, **common)).token_ids)
            return info, chat, ids, tokenized, unset, explicit, unpenalized, greedy

    info, chat, ids, tokenized, unset, explicit, unpenalized, greedy = asyncio.run(scenario())
    d = info.sampling_defaults
    assert (round(d.temperature, 4), round(d.top_p, 4), d.top_k, round(d.repetition_penalty, 4),
            round(d.min_p, 4)) == (0.6, 0.9, 0, 1.3, 0.02)  # vLLM's: what the file sets; do_sample not read
    assert chat.prompt_tokens == len(expected) and tokenized == expected
    assert chat.token_ids == ids.token_ids
    assert unset == explicit, "a request that sets none of them samples with the checkpoint's five"
    assert unpenalized != unset, "the checkpoint's repetition_penalty and min_p were not applied"
    assert len({tuple(t) for t in unset}) > 1 and len({tuple(t) for t in greedy}) == 1


def test_generate_chat_command(server, chat_model):
    expected = template_ids(chat_model[1], [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}])
    out = subprocess.run([sys.executable, "-m", "pagedkv", "generate", "--address", server, "--chat", "--system",
                          "S", "Hi", "--max-tokens", "3", "--temperature", "0"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert f"prompt_tokens={len(expected)} completion_tokens=" in out.stderr
    out = subprocess.run([sys.executable, "-m", "pagedkv", "generate", "--address", server, "--system", "S", "Hi"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--system needs --chat" in out.stderr


def test_a_request_template_is_refused_without_the_trust_flag(server):
    """The scheduler runs a request's own chat_template only with --trust-request-chat-template (vLLM's rule)."""
    import grpc

    async def scenario():
        async with Client(server) as c:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await c.complete(messages=[("user", "hi")], chat_template="{{ 'x' }}", max_tokens=1)
            return e.value

    err = asyncio.run(scenario())
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details().startswith("prompt.chat.chat_template: a template from a request is refused")
