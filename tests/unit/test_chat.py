"""Chat prompts: Generate and Tokenize take role/content messages and render them with the checkpoint's chat
template (transformers' apply_chat_template), bounded before the template runs, on the tokenizer thread.
In one process: a GenerationService over a cluster of FakeExecutors, and a byte tokenizer saved with (and
without) a chat template."""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest

from pagedkv.api.v1 import api_pb2 as api
from pagedkv.client import Client
from pagedkv.tools.random_model import build_byte_tokenizer
from scheduler_svc import cluster as cluster_mod
from scheduler_svc import engine as engine_mod
from scheduler_svc.api import GenerationService
from scheduler_svc.validation import MAX_CHAT_MESSAGES, Limits
from tests.support.chat_template import TEMPLATE, template_ids
from tests.support.fake_cluster import Box, FakeClient, new_cluster
from tests.support.fake_grpc import Aborted, Context

pytestmark = pytest.mark.unit

LIMIT = 200  # --max-prompt-bytes
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Héllo?"}]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """(with a chat template, without one), each saved and loaded back as a checkpoint's would be."""
    from transformers import AutoTokenizer

    plain_dir = tmp_path_factory.mktemp("plain")
    build_byte_tokenizer(plain_dir)
    chat_dir = tmp_path_factory.mktemp("chat")
    tok = AutoTokenizer.from_pretrained(str(plain_dir))
    tok.chat_template = TEMPLATE
    tok.save_pretrained(str(chat_dir))
    return AutoTokenizer.from_pretrained(str(chat_dir)), AutoTokenizer.from_pretrained(str(plain_dir))


class Spy:
    """Wraps a tokenizer; records the threads apply_chat_template ran on."""

    def __init__(self, tokenizer) -> None:
        self._tok = tokenizer
        self.template_threads: list[str] = []

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def __call__(self, *a, **kw):
        return self._tok(*a, **kw)

    def apply_chat_template(self, *a, **kw):
        self.template_threads.append(threading.current_thread().name)
        return self._tok.apply_chat_template(*a, **kw)


def run_service(tokenizer, scenario, monkeypatch):
    """Runs ``scenario(service)`` against a GenerationService on one FakeExecutor."""
    monkeypatch.setattr(cluster_mod, "ExecutorClient", FakeClient)
    monkeypatch.setattr(engine_mod, "RECONNECT_POLL", 0.05)
    FakeClient.boxes = {"a:1": Box(64)}

    async def main():
        c = new_cluster()
        c.start()
        c.set_addresses({"a:1"})
        await asyncio.wait_for(c.any_up.wait(), 5)
        import structlog
        service = GenerationService(c, tokenizer, Limits(max_model_len=512, vocab_size=300, max_prompt_bytes=LIMIT),
                                    {}, structlog.get_logger())
        try:
            return await scenario(service)
        finally:
            await c.stop()
    return asyncio.run(main())


async def generate(service, request) -> list[api.GenerateResponse]:
    return [m async for m in service.Generate(request, Context())]


def chat_request(messages, add_generation_prompt=None, max_tokens=3) -> api.GenerateRequest:
    req = Client.build_request(messages=messages, add_generation_prompt=add_generation_prompt, max_tokens=max_tokens)
    assert req.WhichOneof("prompt") == "chat"
    return req


def test_generate_and_tokenize_render_the_template(tokenizers, monkeypatch):
    """The prompt is the template's rendering (BOS from the template, not added twice), with the assistant
    opening unless add_generation_prompt is false; Tokenize gives the same ids; it all runs on the tokenizer
    thread."""
    chat_tok, _ = tokenizers
    spy = Spy(chat_tok)
    expected = template_ids(chat_tok, MESSAGES)
    rendered = "<|system|>Be brief.\n<|user|>Héllo?\n<|assistant|>"
    assert expected == [1, *[b + 3 for b in rendered.encode()]]  # our byte tokenizer: 3 specials, then bytes

    async def scenario(service):
        out = await generate(service, chat_request(MESSAGES))
        ids = await service._prompt_ids(chat_request(MESSAGES))
        no_prompt = await service._prompt_ids(chat_request(MESSAGES, add_generation_prompt=False))
        tok = await service.Tokenize(api.TokenizeRequest(chat=chat_request(MESSAGES).chat), Context())
        return out, ids, no_prompt, tok

    out, ids, no_prompt, tok = run_service(spy, scenario, monkeypatch)
    assert ids == expected
    assert out[-1].usage.prompt_tokens == len(expected) and out[-1].finish_reason == api.FINISH_REASON_LENGTH
    assert sum(len(m.token_ids) for m in out) == 3
    assert no_prompt == template_ids(chat_tok, MESSAGES, add_generation_prompt=False)
    assert no_prompt == expected[:-len(b"<|assistant|>")]
    assert list(tok.token_ids) == expected and len(tok.tokens) == len(expected)
    assert spy.template_threads and all(t.startswith("tokenize") for t in spy.template_threads)


def test_a_model_without_a_template_fails_precondition(tokenizers, monkeypatch):
    _, plain = tokenizers

    async def scenario(service):
        codes = []
        for call in (generate(service, chat_request(MESSAGES)),
                     service.Tokenize(api.TokenizeRequest(chat=chat_request(MESSAGES).chat), Context())):
            with pytest.raises(Aborted) as err:
                await call
            codes.append(err.value)
        codes.append(await service.Tokenize(api.TokenizeRequest(text="hi", add_special_tokens=True), Context()))
        return codes

    gen_err, tok_err, text_ok = run_service(plain, scenario, monkeypatch)
    for err, field in ((gen_err, "prompt.chat"), (tok_err, "chat")):
        assert err.code == grpc.StatusCode.FAILED_PRECONDITION
        assert err.details.startswith(f"{field}: the model has no chat template")
    assert list(text_ok.token_ids) == [1, ord("h") + 3, ord("i") + 3]  # text still works


@pytest.mark.parametrize(("messages", "message"), [
    ([], "prompt.chat.messages: 0 messages; must be 1 to 1024"),
    ([{"role": "user", "content": "a"}] * (MAX_CHAT_MESSAGES + 1), "prompt.chat.messages: 1025 messages;"),
    ([{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}],
     "prompt.chat.messages[1].role: 'robot'; must be one of system, user, assistant, tool"),
    ([{"role": "x" * 5000, "content": "b"}], "prompt.chat.messages[0].role: '" + "x" * 32 + "...'"),
    ([{"role": "user", "content": "a" * 150}, {"role": "user", "content": "b" * 51}],
     f"prompt.chat.messages: contents of at least 201 bytes of UTF-8; at most {LIMIT} in all"),
    ([{"role": "user", "content": "é" * 60}, {"role": "user", "content": "b" * 81}],  # 120 + 81 bytes
     f"prompt.chat.messages: contents of 201 bytes of UTF-8; at most {LIMIT} in all"),
    ([{"role": "assistant", "content": "hi"}],
     "prompt.chat: the model's chat template refused the messages: the conversation must not start"),
])
def test_bad_messages_are_invalid_and_bounded_before_the_template(tokenizers, monkeypatch, messages, message):
    spy = Spy(tokenizers[0])

    async def scenario(service):
        with pytest.raises(Aborted) as err:
            await generate(service, chat_request(messages))
        return err.value

    err = run_service(spy, scenario, monkeypatch)
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details.startswith(message), err.details
    assert len(spy.template_threads) == ("template" in message)  # only well-formed messages reach the template


def test_contents_at_the_limit_are_taken(tokenizers, monkeypatch):
    messages = [{"role": "user", "content": "é" * 60}, {"role": "tool", "content": "b" * 80}]  # 200 bytes

    async def scenario(service):
        return await service._prompt_ids(chat_request(messages))

    ids = run_service(tokenizers[0], scenario, monkeypatch)
    assert ids == template_ids(tokenizers[0], messages)


def test_tokenize_refuses_text_and_chat_together(tokenizers, monkeypatch):
    async def scenario(service):
        with pytest.raises(Aborted) as err:
            await service.Tokenize(api.TokenizeRequest(text="hi", chat=chat_request(MESSAGES).chat), Context())
        return err.value

    err = run_service(tokenizers[0], scenario, monkeypatch)
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT and err.details.startswith("text: must be empty")


def test_client_builds_chat_requests():
    req = Client.build_request(messages=[("system", "s"), {"role": "user", "content": "u"}],
                               add_generation_prompt=False)
    assert [(m.role, m.content) for m in req.chat.messages] == [("system", "s"), ("user", "u")]
    assert req.chat.HasField("add_generation_prompt") and not req.chat.add_generation_prompt
    assert not Client.build_request(messages=[("user", "u")]).chat.HasField("add_generation_prompt")
    with pytest.raises(ValueError, match="not both"):
        Client.build_request("text", messages=[("user", "u")])
