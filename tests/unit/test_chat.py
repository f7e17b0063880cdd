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
from scheduler_svc.chat import MAX_CHAT_MESSAGES
from scheduler_svc.validation import Limits
from tests.support import template_workers
from tests.support.chat_template import TEMPLATE, TOOL_TEMPLATE, template_ids
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


def run_service(tokenizer, scenario, monkeypatch, limit: int = LIMIT):
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
        service = GenerationService(c, tokenizer, Limits(max_model_len=512, vocab_size=300, max_prompt_bytes=limit),
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


# ---- tool calls, names, chat_template(_kwargs), continue_final_message ----------------------------------------
# What a client sends (OpenAI's shape: arguments as JSON text), and what the template must be given (vLLM's: arguments
# decoded to an object; text that is not a JSON object becomes {}).
TOOL_MESSAGES = [
    {"role": "user", "content": "Weather?", "name": "ann"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris", "d": [1]}'}},
        {"id": "c2", "function": {"name": "broken", "arguments": "{not json"}},
        {"id": "c3", "function": {"name": "listed", "arguments": "[1, 2]"}},
        {"id": "c4", "function": {"name": "none", "arguments": ""}}]},
    {"role": "tool", "content": "18C", "tool_call_id": "c1"},
]
TOOL_MESSAGES_SEEN = [
    {"role": "user", "content": "Weather?", "name": "ann"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": {"city": "Paris", "d": [1]}}},
        {"id": "c2", "type": "function", "function": {"name": "broken", "arguments": {}}},
        {"id": "c3", "type": "function", "function": {"name": "listed", "arguments": {}}},
        {"id": "c4", "type": "function", "function": {"name": "none", "arguments": {}}}]},
    {"role": "tool", "content": "18C", "tool_call_id": "c1"},
]


@pytest.fixture(scope="module", params=["transformers", "fast"])
def tool_tokenizer(request, tmp_path_factory):
    """A byte tokenizer whose default template prints tool calls, names and enable_thinking (TOOL_TEMPLATE), with
    the suite's TEMPLATE beside it under the name "plain"; as transformers loads it, and as the scheduler does."""
    from transformers import AutoTokenizer

    from scheduler_svc.tokenizer import FastTokenizer, load_tokenizer

    path = tmp_path_factory.mktemp("tools")
    build_byte_tokenizer(path)
    tok = AutoTokenizer.from_pretrained(str(path))
    tok.chat_template = {"default": TOOL_TEMPLATE, "plain": TEMPLATE}
    tok.save_pretrained(str(path))
    hf = AutoTokenizer.from_pretrained(str(path))
    if request.param == "fast":
        fast = load_tokenizer(path)
        assert isinstance(fast, FastTokenizer)
        return fast, hf
    return hf, hf


def test_tool_calls_names_and_template_kwargs_reach_the_template(tool_tokenizer, monkeypatch):
    tokenizer, hf = tool_tokenizer
    want = template_ids(hf, TOOL_MESSAGES_SEEN, enable_thinking=False)
    rendered = hf.apply_chat_template(TOOL_MESSAGES_SEEN, tokenize=False, add_generation_prompt=True,
                                      enable_thinking=False)
    assert '<call c1 function weather {"city": "Paris", "d": [1]}><call c2 function broken {}>' in rendered
    assert "<|user|>[ann]Weather?" in rendered and "<|tool|>(re c1)18C" in rendered
    assert rendered.endswith("<|assistant|><think></think>")

    async def scenario(service):
        req = Client.build_request(messages=TOOL_MESSAGES, max_tokens=2,
                                   chat_template_kwargs={"enable_thinking": False})
        out = await generate(service, req)
        tok = await service.Tokenize(api.TokenizeRequest(chat=req.chat), Context())
        return await service.prompts.ids(req), out, list(tok.token_ids)

    ids, out, tokenized = run_service(tokenizer, scenario, monkeypatch, limit=1000)
    assert ids == want and tokenized == want and out[-1].usage.prompt_tokens == len(want)


def test_continue_final_message_and_a_named_template(tool_tokenizer, monkeypatch):
    tokenizer, hf = tool_tokenizer
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello, I am"}]
    continued = template_ids(hf, messages, add_generation_prompt=False, continue_final_message=True)
    plain = template_ids(hf, messages, chat_template="plain")

    async def scenario(service):
        req = Client.build_request(messages=messages, add_generation_prompt=False, continue_final_message=True)
        named = Client.build_request(messages=messages, chat_template="plain")
        return await service.prompts.ids(req), await service.prompts.ids(named)

    got_continued, got_plain = run_service(tokenizer, scenario, monkeypatch)
    assert got_continued == continued and bytes(t - 3 for t in continued[1:]).endswith(b"Hello, I am")
    assert got_plain == plain and plain != template_ids(hf, messages)


def test_a_request_template_needs_the_trust_flag(tool_tokenizer, monkeypatch):
    """Refused without the flag; with it, rendered by a template worker (here one in process), never on the
    tokenizer thread, with the model's special tokens and the request's kwargs; Tokenize likewise."""
    tokenizer, hf = tool_tokenizer
    own = "{{ bos_token }}{% for m in messages %}[{{ m.role }}:{{ m.content }}]{% endfor %}{{ flavour }}"
    messages = [{"role": "user", "content": "Hi"}]

    async def scenario(service):
        req = Client.build_request(messages=messages, chat_template=own, chat_template_kwargs={"flavour": "x"})
        with pytest.raises(Aborted) as refused:
            await generate(service, req)
        service.prompts.trust_request_templates = True
        service.prompts.use_template_pool(template_workers.pool())
        tokenized = await service.Tokenize(api.TokenizeRequest(chat=req.chat), Context())
        return refused.value, await service.prompts.ids(req), list(tokenized.token_ids)

    spy = Spy(tokenizer)
    refused, ids, tokenized = run_service(spy, scenario, monkeypatch)
    assert refused.code == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.details.startswith("prompt.chat.chat_template: a template from a request is refused")
    assert "--trust-request-chat-template" in refused.details
    want = template_ids(hf, messages, chat_template=own, flavour="x")
    assert ids == tokenized == want and bytes(t - 3 for t in want[1:]) == b"[user:Hi]x"
    assert not spy.template_threads, "a request's own template ran on the tokenizer thread"
    assert [w.jobs for w in template_workers.InlineWorker.started] == [2]


def _tool_call(arguments: str = "{}", **fields) -> dict:
    return {"id": "c", "function": {"name": "f", "arguments": arguments}, **fields}


@pytest.mark.parametrize(("messages", "options", "message"), [
    ([{"role": "user", "content": "x", "tool_calls": [_tool_call()]}], {},
     "prompt.chat.messages[0].tool_calls: only an assistant message calls tools (role is 'user')"),
    ([{"role": "assistant", "content": "x", "tool_call_id": "c"}], {},
     "prompt.chat.messages[0].tool_call_id: only a tool message answers a tool call"),
    ([{"role": "assistant", "content": "", "tool_calls": [_tool_call(type="retrieval")]}], {},
     "prompt.chat.messages[0].tool_calls[0].type: 'retrieval'; only 'function' tool calls are taken"),
    ([{"role": "assistant", "content": "", "tool_calls": [_tool_call()] * 129}], {},
     "prompt.chat.messages[0].tool_calls: 129 calls; at most 128"),
    ([{"role": "user", "content": "x", "name": "n" * 257}], {},
     "prompt.chat.messages[0].name: 257 characters; at most 256"),
    ([{"role": "assistant", "content": "", "tool_calls": [_tool_call("[" * 17 + "]" * 17)]}], {},
     "prompt.chat.messages[0].tool_calls[0].function.arguments: JSON nested more than 16 levels deep; at most 16"),
    ([{"role": "assistant", "content": "", "tool_calls": [_tool_call("a" * 2000)]}], {},
     "prompt.chat.messages: text of at least 2002 bytes of UTF-8; at most 2000 in all"),
    ([{"role": "user", "content": "x"}], {"continue_final_message": True},
     "prompt.chat.continue_final_message: cannot be set with add_generation_prompt (true by default); set "
     "add_generation_prompt to false"),
    ([{"role": "user", "content": "x"}], {"chat_template_kwargs": {"k": "v" * 20_000}},
     "prompt.chat.chat_template_kwargs: 20009 bytes of JSON; at most 16384"),
    ([{"role": "user", "content": "x"}], {"chat_template_kwargs": {"k": [[[[[[[[1]]]]]]]]}},
     "prompt.chat.chat_template_kwargs: JSON nested more than 8 levels deep; at most 8"),
    ([{"role": "user", "content": "x"}], {"chat_template_kwargs": {"messages": [], "add_generation_prompt": False}},
     "prompt.chat.chat_template_kwargs: add_generation_prompt, messages cannot be set here"),
    ([{"role": "user", "content": "x"}], {"chat_template_kwargs": {"sanitize_control_tokens": True}},
     "prompt.chat.chat_template_kwargs: sanitize_control_tokens cannot be set here"),
    ([{"role": "user", "content": "x"}], {"chat_template": "x" * (64 << 10 | 1)},
     "prompt.chat.chat_template: 65537 bytes; at most 65536"),
])
def test_bad_chat_inputs_are_refused_before_the_template(tokenizers, monkeypatch, messages, options, message):
    spy = Spy(tokenizers[0])

    async def scenario(service):
        with pytest.raises(Aborted) as err:
            await generate(service, Client.build_request(messages=messages, max_tokens=1, **options))
        return err.value

    err = run_service(spy, scenario, monkeypatch, limit=2000)  # (names, ids and arguments count against it)
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details.startswith(message), err.details
    assert not spy.template_threads


def test_template_kwargs_that_are_not_an_object_are_refused(tokenizers, monkeypatch):
    async def scenario(service):
        errors = []
        for text in ("[1]", "{bad"):
            req = Client.build_request(messages=[("user", "x")])
            req.chat.chat_template_kwargs = text
            with pytest.raises(Aborted) as err:
                await generate(service, req)
            errors.append(err.value.details)
        return errors

    not_object, not_json = run_service(tokenizers[0], scenario, monkeypatch)
    assert not_object == ("prompt.chat.chat_template_kwargs: must be a JSON object (its keys are the template's "
                          "variables)")
    assert not_json.startswith("prompt.chat.chat_template_kwargs: not valid JSON (")


# ---- truncate_prompt_tokens ---------------------------------------------------------------------------------
def test_truncated_keeps_the_last_tokens_and_names_its_limit():
    from scheduler_svc.prompts import truncated
    from scheduler_svc.validation import InvalidRequest

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
