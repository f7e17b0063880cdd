"""The gateway's field table (pagedkv/gateway/fields.py) walked: every honoured field sent at a value that is not its
default reaches the GenerateRequest (or the answer's shape); every refused one is a 400 naming it, and is accepted
at its defaults; every one ignored by design leaves the GenerateRequest as it was and is logged at debug; an
unknown field is accepted, logged as a warning and named in a response header; and the docs' table
(docs/openai.md) as the code writes it. The context-length refusal, X-Request-Id and /version:
test_gateway_fields_app.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagedkv.gateway import fields
from pagedkv.gateway.errors import ApiError
from pagedkv.gateway.openai_requests import client_request_id, parse_chat, parse_completion
from tests.support.gateway_stub import BASE
from tests.support.gateway_stub import first_request as _req
from tests.support.gateway_stub import parse as _parse

pytestmark = pytest.mark.unit


def _sampled(name):
    return lambda body, plan: (_req(plan).sampling.HasField(name), getattr(_req(plan).sampling, name))


# Where each honoured field lands: (body, plan) -> a value that differs from the baseline's when it is honoured.
HONOURED = {
    "model": lambda body, plan: plan.model,
    "prompt": lambda body, plan: _req(plan).text,
    "messages": lambda body, plan: [(m.role, m.content) for m in _req(plan).chat.messages],
    "max_tokens": lambda body, plan: _req(plan).sampling.max_tokens,
    "max_completion_tokens": lambda body, plan: _req(plan).sampling.max_tokens,
    "temperature": _sampled("temperature"),
    "top_p": _sampled("top_p"),
    "top_k": _sampled("top_k"),
    "seed": _sampled("seed"),
    "stop": lambda body, plan: list(_req(plan).sampling.stop),
    "stop_token_ids": lambda body, plan: list(_req(plan).sampling.stop_token_ids),
    "ignore_eos": lambda body, plan: _req(plan).sampling.ignore_eos,
    "include_stop_str_in_output": lambda body, plan: _req(plan).sampling.include_stop_str_in_output,
    "n": lambda body, plan: (_req(plan).sampling.n, plan.num_choices),
    "logprobs": lambda body, plan: (_req(plan).sampling.logprobs, _req(plan).sampling.top_logprobs, plan.logprobs,
                                    plan.top_logprobs),
    "top_logprobs": lambda body, plan: (_req(plan).sampling.top_logprobs, plan.top_logprobs),
    "prompt_logprobs": lambda body, plan: (_sampled("prompt_logprobs")(body, plan), plan.prompt_logprobs),
    "echo": lambda body, plan: (_req(plan).sampling.echo, plan.echo),
    "return_tokens_as_token_ids": lambda body, plan: plan.tokens_as_ids,
    "stream": lambda body, plan: plan.stream,
    "stream_options": lambda body, plan: plan.include_usage,
    "priority": lambda body, plan: _req(plan).priority,
    "page_budget": lambda body, plan: _req(plan).page_budget,
    "request_id": lambda body, plan: client_request_id(None, body),
    "add_generation_prompt": lambda body, plan: (_req(plan).chat.HasField("add_generation_prompt"),
                                                 _req(plan).chat.add_generation_prompt),
    "continue_final_message": lambda body, plan: _req(plan).chat.continue_final_message,
    "chat_template": lambda body, plan: _req(plan).chat.chat_template,
    "chat_template_kwargs": lambda body, plan: json.loads(_req(plan).chat.chat_template_kwargs or "{}"),
    "truncate_prompt_tokens": lambda body, plan: [r.truncate_prompt_tokens for r in plan.requests],
    "presence_penalty": lambda body, plan: _req(plan).sampling.presence_penalty,
    "frequency_penalty": lambda body, plan: _req(plan).sampling.frequency_penalty,
    "repetition_penalty": lambda body, plan: _req(plan).sampling.repetition_penalty,
    "min_p": lambda body, plan: _req(plan).sampling.min_p,
    "min_tokens": lambda body, plan: _req(plan).sampling.min_tokens,
    "logit_bias": lambda body, plan: dict(_req(plan).sampling.logit_bias),
    "allowed_token_ids": lambda body, plan: list(_req(plan).sampling.allowed_token_ids),
    "bad_words": lambda body, plan: list(_req(plan).sampling.bad_words),
    "tools": lambda body, plan: [t.function.name for t in _req(plan).chat.tools],
    "tool_choice": lambda body, plan: _req(plan).chat.tool_choice.mode,
    "parallel_tool_calls": lambda body, plan: (_req(plan).chat.HasField("parallel_tool_calls"),
                                               plan.parallel_tool_calls),
    **{name: lambda body, plan: _req(plan).sampling.constraint.WhichOneof("kind")
       for name in ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                    "guided_grammar")},
}


def _endpoints(f: fields.Field) -> list[bool]:
    return {fields.BOTH: [False, True], fields.COMPLETIONS: [False], fields.CHAT: [True]}[f.where]


def _cases(kind: str, table=fields.FIELDS):
    return [pytest.param(f, chat, id=f"{'chat' if chat else 'completions'}-{f.name}")
            for f in table if f.kind == kind for chat in _endpoints(f)]


def test_the_table_names_each_field_once_per_endpoint_and_every_honoured_field_has_a_check():
    for table in (fields.FIELDS, fields.STREAM_OPTIONS, fields.MESSAGE_FIELDS):
        for chat in (False, True):
            names = [f.name for f in table if f.where in (fields.BOTH, fields.CHAT if chat else fields.COMPLETIONS)]
            assert len(names) == len(set(names))
        assert all(not f.accepts(f.example) for f in table)  # each example is a value that is not the default
    assert {f.name for f in fields.FIELDS if f.kind == fields.HONOURED} == set(HONOURED)


TOOLS = [{"type": "function", "function": {"name": "f"}}]
# what a field needs beside it
NEEDS = {"stream_options": {"stream": True}, "top_logprobs": {"logprobs": True}, "tool_choice": {"tools": TOOLS},
         "parallel_tool_calls": {"tools": TOOLS}}


@pytest.mark.parametrize("field, chat", _cases(fields.HONOURED))
def test_an_honoured_field_reaches_the_generate_request(field, chat):
    body = {**BASE[chat], **NEEDS.get(field.name, {})}
    sent = {**body, field.name: field.example}
    parse = parse_chat if chat else parse_completion
    check = HONOURED[field.name]
    assert check(sent, parse(sent, "r")) != check(body, parse(body, "r"))


@pytest.mark.parametrize("field, chat", _cases(fields.REFUSED))
def test_a_refused_field_is_a_400_naming_it_and_its_defaults_pass(field, chat):
    with pytest.raises(ApiError) as e:
        _parse(chat, **{field.name: field.example})
    assert e.value.status == 400 and e.value.param == field.name and e.value.type == "invalid_request_error"
    assert e.value.message.startswith(f"{field.name}: ") and "not supported" in e.value.message
    baseline = _parse(chat).requests
    for value in field.accepted:  # (None: as if absent)
        plan = _parse(chat, **{field.name: value})
        assert plan.requests == baseline and not plan.screened.unknown


@pytest.mark.parametrize("field, chat", _cases(fields.IGNORED))
def test_a_field_ignored_by_design_changes_nothing_sent(field, chat):
    plan = _parse(chat, **{field.name: field.example})
    assert plan.requests == _parse(chat).requests
    assert plan.screened.ignored == [field.name] and not plan.screened.unknown


def test_value_dependent_refusals_and_the_logits_controls_accept_the_defaults():
    for chat in (False, True):
        plan = _parse(chat, min_tokens=0, skip_special_tokens=True, presence_penalty=0.0, logit_bias={},
                      bad_words=[], response_format={"type": "text"})
        assert plan.requests == _parse(chat).requests
        # repetition_penalty and min_p at their neutral values are sent: they win over the model's defaults
        s = _req(_parse(chat, repetition_penalty=1.0, min_p=0)).sampling
        assert (s.HasField("repetition_penalty"), s.repetition_penalty, s.HasField("min_p"), s.min_p) == (
            True, 1.0, True, 0.0)
        s = _req(_parse(chat)).sampling
        assert not s.HasField("repetition_penalty") and not s.HasField("min_p")  # unset: the model's defaults
    with pytest.raises(ApiError) as e:
        _parse(False, skip_special_tokens=1)  # 1 is not True
    assert e.value.param == "skip_special_tokens"
    with pytest.raises(ApiError) as e:
        _parse(False, logprobs=-1)  # (vLLM's -1, the whole vocabulary, is not taken)
    assert e.value.param == "logprobs"


def test_an_unknown_field_is_accepted_and_named():
    for chat in (False, True):
        plan = _parse(chat, frobnicate=1, suffix_=2)
        assert plan.requests == _parse(chat).requests and plan.screened.unknown == ["frobnicate", "suffix_"]
    plan = _parse(True, suffix="x")  # a completions field on chat: unknown there
    assert plan.screened.unknown == ["suffix"]


def test_stream_options_fields():
    assert _parse(False, stream=True, stream_options={"include_usage": True}).include_usage
    for value in (None, False, True):  # (vLLM's: usage in every chunk only with include_usage)
        plan = _parse(False, stream=True, stream_options={"continuous_usage_stats": value})
        assert not plan.screened.unknown and not plan.continuous_usage
    for chat in (False, True):
        both = {"include_usage": True, "continuous_usage_stats": True}
        assert _parse(chat, stream=True, stream_options=both).continuous_usage
    with pytest.raises(ApiError) as e:
        _parse(True, stream=True, stream_options={"continuous_usage_stats": 1})
    assert e.value.status == 400 and e.value.param == "stream_options.continuous_usage_stats"
    plan = _parse(True, stream=True, stream_options={"include_obfuscation": False, "other": 1})
    assert plan.screened.ignored == ["stream_options.include_obfuscation"]
    assert plan.screened.unknown == ["stream_options.other"]


@pytest.mark.parametrize("field", [f for f in fields.MESSAGE_FIELDS if f.kind == fields.REFUSED], ids=lambda f: f.name)
def test_a_message_field_the_template_would_not_get_is_refused(field):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x", field.name: field.example}]
    with pytest.raises(ApiError) as e:
        parse_chat({"model": "m", "messages": messages}, "r")
    assert e.value.status == 400 and e.value.param == f"messages[1].{field.name}"
    for value in field.accepted:
        messages[1][field.name] = value
        assert [m.content for m in parse_chat({"model": "m", "messages": messages}, "r").requests[0].chat.messages] \
            == ["hi", "x"]


MESSAGE_HONOURED = {
    "role": lambda m: m.role,
    "content": lambda m: m.content,
    "name": lambda m: m.name,
    "tool_calls": lambda m: [(c.id, c.type, c.function.name, c.function.arguments) for c in m.tool_calls],
    "tool_call_id": lambda m: m.tool_call_id,
}


@pytest.mark.parametrize("field", [f for f in fields.MESSAGE_FIELDS if f.kind == fields.HONOURED], ids=lambda f: f.name)
def test_an_honoured_message_field_reaches_the_chat_message(field):
    base = {"role": "user", "content": "hi"}
    sent = parse_chat({"model": "m", "messages": [{**base, field.name: field.example}]}, "r")
    plain = parse_chat({"model": "m", "messages": [base]}, "r")
    check = MESSAGE_HONOURED[field.name]
    assert check(_req(sent).chat.messages[0]) != check(_req(plain).chat.messages[0])
    assert {f.name for f in fields.MESSAGE_FIELDS if f.kind == fields.HONOURED} == set(MESSAGE_HONOURED)


def test_message_fields_are_typed_and_other_message_fields_named():
    plan = parse_chat({"model": "m", "messages": [{"role": "assistant", "content": "other", "extra": 1}]}, "r")
    assert [(m.role, m.content) for m in _req(plan).chat.messages] == [("assistant", "other")]
    assert plan.screened.unknown == ["messages[0].extra"]
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"x": "é"}}}
    plan = parse_chat({"model": "m", "messages": [{"role": "assistant", "content": None, "tool_calls": [call]}]}, "r")
    (got,) = _req(plan).chat.messages[0].tool_calls
    assert (got.id, got.function.name, json.loads(got.function.arguments)) == ("c1", "f", {"x": "é"})
    for message, param in (({"role": "tool", "content": "x", "tool_call_id": 5}, "messages[0].tool_call_id"),
                           ({"role": "user", "content": "x", "name": ["n"]}, "messages[0].name"),
                           ({"role": "assistant", "tool_calls": {"id": "c"}}, "messages[0].tool_calls"),
                           ({"role": "assistant", "tool_calls": ["c"]}, "messages[0].tool_calls[0]"),
                           ({"role": "assistant", "tool_calls": [{"id": "c"}]}, "messages[0].tool_calls[0].function"),
                           ({"role": "assistant", "tool_calls": [{"function": {"arguments": 3}}]},
                            "messages[0].tool_calls[0].function.arguments")):
        with pytest.raises(ApiError) as e:
            parse_chat({"model": "m", "messages": [message]}, "r")
        assert e.value.status == 400 and e.value.param == param, message
    for param, value in (("chat_template_kwargs", [1]), ("chat_template", 1), ("continue_final_message", "yes")):
        with pytest.raises(ApiError) as e:
            _parse(True, **{param: value})
        assert e.value.param == param


def test_the_header_shows_safe_names_only_and_a_bounded_number():
    assert fields.ignored_header(["a", "b.c"]) == "a, b.c"
    assert fields.ignored_header(["ok", "bad\r\nX-Injected: 1", "é"]) == "ok, (+2 more)"
    many = [f"f{i}" for i in range(100)]
    assert fields.ignored_header(many).endswith(f"f{fields.MAX_HEADER_NAMES - 1}, (+84 more)")


def test_the_docs_have_the_table_as_the_code_writes_it():
    page = (Path(__file__).resolve().parents[2] / "docs" / "openai.md").read_text()
    page = "\n".join(line.strip() for line in page.splitlines())  # (it is indented in a list item)
    assert fields.readme_table() in page, "docs/openai.md's 'OpenAI fields' table: paste fields.readme_table()"
