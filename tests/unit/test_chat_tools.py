"""Chat prompts with tool calls (OpenAI's shape in, vLLM's to the template), message names, a request's own
chat_template and chat_template_kwargs, continue_final_message, and the refusals of bad chat inputs before the
template runs. In one process, as test_chat.py: a GenerationService over a cluster of FakeExecutors, and a byte
tokenizer saved with a chat template."""

from __future__ import annotations

import grpc
import pytest

from pagedkv.api.v1 import api_pb2 as api
from pagedkv.client import Client
from pagedkv.tools.random_model import build_byte_tokenizer
from tests.support import template_workers
from tests.support.chat_service import Spy, chat_tokenizers, generate, run_service
from tests.support.chat_template import TEMPLATE, TOOL_TEMPLATE, template_ids
from tests.support.fake_grpc import Aborted, Context

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """(with a chat template, without one), each saved and loaded back as a checkpoint's would be."""
    return chat_tokenizers(tmp_path_factory)


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
