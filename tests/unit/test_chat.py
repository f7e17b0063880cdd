"""Chat prompts: Generate and Tokenize take role/content messages and render them with the checkpoint's chat
template (transformers' apply_chat_template), bounded before the template runs, on the tokenizer thread.
In one process: a GenerationService over a cluster of FakeExecutors, and a byte tokenizer saved with (and
without) a chat template."""

from __future__ import annotations

import grpc
import pytest

from pagedkv.api.v1 import api_pb2 as api
from pagedkv.bounds import MAX_CHAT_MESSAGES
from pagedkv.client import Client
from tests.support.chat_service import LIMIT, Spy, chat_request, chat_tokenizers, generate, run_service
from tests.support.chat_template import template_ids
from tests.support.fake_cluster import FakeClient
from tests.support.fake_grpc import Aborted, Context

pytestmark = pytest.mark.unit

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Héllo?"}]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """(with a chat template, without one), each saved and loaded back as a checkpoint's would be."""
    return chat_tokenizers(tmp_path_factory)


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
        ids = await service.prompts.ids(chat_request(MESSAGES))
        no_prompt = await service.prompts.ids(chat_request(MESSAGES, add_generation_prompt=False))
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
     f"prompt.chat.messages: text of at least 201 bytes of UTF-8; at most {LIMIT} in all"),
    ([{"role": "user", "content": "é" * 60}, {"role": "user", "content": "b" * 81}],  # 120 + 81 bytes
     f"prompt.chat.messages: text of 201 bytes of UTF-8; at most {LIMIT} in all"),
    ([{"role": "assistant", "content": "hi"}],
     "prompt.chat: the chat template refused the messages: the conversation must not start"),
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
        return await service.prompts.ids(chat_request(messages))

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


# ---- truncate_prompt_tokens ---------------------------------------------------------------------------------
def test_truncated_keeps_the_last_tokens_and_names_its_limit():
    from pagedkv.bounds import InvalidRequest
    from scheduler_svc.prompts import truncated

    assert truncated([1, 2, 3, 4], 0, 8) == [1, 2, 3, 4]  # 0: not set
    assert truncated([1, 2, 3, 4], 2, 8) == [3, 4] and truncated([1, 2, 3, 4], 8, 8) == [1, 2, 3, 4]
    for keep in (-1, 9):
        with pytest.raises(InvalidRequest, match=rf"^truncate_prompt_tokens: {keep}; must be in \[1, max_model_len=8"):
            truncated([1, 2], keep, 8)


def sent_token_ids(monkeypatch) -> list[list[int]]:
    """The token ids of every new request the executor is sent from now on (FakeClient.step recorded)."""
    sent: list[list[int]] = []
    step = FakeClient.step

    async def recording_step(self, plan):
        sent.extend(list(r.token_ids) for r in plan.new_requests)
        return await step(self, plan)
    monkeypatch.setattr(FakeClient, "step", recording_step)
    return sent


def test_truncate_prompt_tokens_cuts_text_token_ids_and_chats_before_the_length_check(tokenizers, monkeypatch):
    """The executor gets the last N ids of what the prompt tokenized (rendered) to, and a prompt longer than the
    context is taken once cut (max_model_len is 512 here)."""
    sent = sent_token_ids(monkeypatch)
    chat_tok = tokenizers[0]
    text = "abcdefgh" * 80  # 640 tokens, + BOS

    async def scenario(service):
        usage = []
        for prompt, kw in ((text, {}), ([i % 250 for i in range(900)], {}), (None, {"messages": MESSAGES})):
            req = Client.build_request(prompt, max_tokens=1, truncate_prompt_tokens=7, **kw)
            usage.append((await generate(service, req))[-1].usage.prompt_tokens)
        with pytest.raises(Aborted) as err:
            await generate(service, Client.build_request(text, max_tokens=1, truncate_prompt_tokens=513))
        return usage, err.value

    usage, err = run_service(chat_tok, scenario, monkeypatch, limit=4000)
    assert usage == [7, 7, 7]
    assert sent == [chat_tok(text)["input_ids"][-7:], [143, 144, 145, 146, 147, 148, 149],
                    template_ids(chat_tok, MESSAGES)[-7:]]
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details.startswith("truncate_prompt_tokens: 513; must be in [1, max_model_len=512]")


# ---- one BOS rule ---------------------------------------------------------------------------------------
def test_tokenize_and_generate_agree_on_bos(tokenizers, monkeypatch):
    """Tokenize without add_special_tokens gives exactly the ids Generate runs for the same text (BOS added, as
    transformers' and vLLM's default); add_special_tokens false leaves it out; a chat's template writes its own."""
    from scheduler_svc.prompts import adds_special_tokens

    assert (adds_special_tokens("text"), adds_special_tokens("text", False), adds_special_tokens("chat"),
            adds_special_tokens("chat", True)) == (True, False, False, False)
    sent = sent_token_ids(monkeypatch)

    async def scenario(service):
        await generate(service, Client.build_request("hi", max_tokens=1))
        default = await service.Tokenize(api.TokenizeRequest(text="hi"), Context())
        without = await service.Tokenize(api.TokenizeRequest(text="hi", add_special_tokens=False), Context())
        return list(default.token_ids), list(without.token_ids)

    default, without = run_service(tokenizers[0], scenario, monkeypatch)
    assert sent == [default] and default == [1, ord("h") + 3, ord("i") + 3] and without == default[1:]


def test_tokenize_a_chat_refuses_add_special_tokens_true(tokenizers, monkeypatch):
    """With chat the template writes the special tokens: add_special_tokens false is what happens anyway, true is
    refused naming the field (never silently dropped)."""
    chat = chat_request(MESSAGES).chat

    async def scenario(service):
        plain = await service.Tokenize(api.TokenizeRequest(chat=chat), Context())
        false = await service.Tokenize(api.TokenizeRequest(chat=chat, add_special_tokens=False), Context())
        with pytest.raises(Aborted) as err:
            await service.Tokenize(api.TokenizeRequest(chat=chat, add_special_tokens=True), Context())
        return list(plain.token_ids), list(false.token_ids), err.value

    plain, false, err = run_service(tokenizers[0], scenario, monkeypatch)
    assert plain == false == template_ids(tokenizers[0], MESSAGES)
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT and err.details.startswith("add_special_tokens: true")


def test_detokenize_keeps_special_tokens_and_is_bounded(tokenizers, monkeypatch):
    async def scenario(service):
        ids = (await service.Tokenize(api.TokenizeRequest(text="hé"), Context())).token_ids
        text = await service.Detokenize(api.DetokenizeRequest(token_ids=ids), Context())
        errors = []
        for bad in ([1] * 513, [300], [-1]):
            with pytest.raises(Aborted) as err:
                await service.Detokenize(api.DetokenizeRequest(token_ids=bad), Context())
            errors.append(err.value)
        return text.text, errors

    text, errors = run_service(tokenizers[0], scenario, monkeypatch)
    assert text == tokenizers[0].decode(tokenizers[0]("hé")["input_ids"]) and text.endswith("hé") and text != "hé"
    assert [e.code for e in errors] == [grpc.StatusCode.INVALID_ARGUMENT] * 3
    assert [e.details for e in errors] == ["token_ids: 513 ids; at most max_model_len=512",
                                           "token_ids: id 300 outside the vocabulary [0, 300)",
                                           "token_ids: id -1 outside the vocabulary [0, 300)"]
