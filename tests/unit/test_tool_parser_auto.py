"""--tool-call-parser auto (the default): the parser found from the chat template, said at start-up; none and an
explicit name; tool_choice auto refused naming the flag when no parser is known, while required, named and none
keep working; the built-in SmolLM2's template (pagedkv/chat_templates.py) renders tools in hermes markup and, with
no tools, exactly what the GGUF's template renders."""

from __future__ import annotations

import argparse
import json

import pytest

from pagedkv import tool_calls
from pagedkv.api.v1 import api_pb2 as api
from pagedkv.bounds import InvalidRequest
from pagedkv.chat_templates import SMOLLM2_PLAIN, SMOLLM2_TOOLS
from pagedkv.model_fetch import REGISTRY_MODELS
from scheduler_svc import args as scheduler_args
from scheduler_svc import chat as chats
from scheduler_svc.tokenizer import _compile

pytestmark = pytest.mark.unit

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}}]


def _chat(choice: api.ToolChoice | None = None) -> api.Chat:
    chat = api.Chat(messages=[api.ChatMessage(role="user", content="weather in Paris?")],
                    tools=[api.Tool(type="function", function=api.FunctionDefinition(
                        name="get_weather", parameters=json.dumps(WEATHER)))])
    if choice is not None:
        chat.tool_choice.CopyFrom(choice)
    return chat


def test_the_flag_defaults_to_auto_and_takes_none_and_each_parser():
    p = argparse.ArgumentParser()
    scheduler_args.add_args(p)
    assert p.parse_args([]).tool_call_parser == "auto"
    for name in ("none", *tool_calls.PARSERS):
        assert p.parse_args(["--tool-call-parser", name]).tool_call_parser == name
    with pytest.raises(SystemExit):
        p.parse_args(["--tool-call-parser", "pythonic"])


@pytest.mark.parametrize("flag, template, parser, source", [
    ("auto", SMOLLM2_TOOLS, "hermes", "the chat template's markup"),
    ("auto", {"default": "{{ '[TOOL_CALLS]' }}", "rag": "x"}, "mistral", "the chat template's markup"),
    ("auto", "{{ '<|python_tag|>' }}", "llama3_json", "the chat template's markup"),
    ("auto", SMOLLM2_PLAIN, None, "the chat template writes no tool-call markup"),
    ("auto", None, None, "the model has no chat template"),
    ("none", SMOLLM2_TOOLS, None, "--tool-call-parser none"),
    ("mistral", SMOLLM2_TOOLS, "mistral", "--tool-call-parser"),  # (an explicit name wins over the markup)
])
def test_the_server_says_which_parser_and_why(flag, template, parser, source):
    assert tool_calls.server_parser(flag, template) == (parser, source)


def test_auto_is_refused_naming_the_flag_and_the_fixes_when_no_parser_is_known():
    for flag, template, why in (("auto", SMOLLM2_PLAIN, "--tool-call-parser auto found no parser"),
                                ("none", SMOLLM2_TOOLS, "started with --tool-call-parser none")):
        with pytest.raises(InvalidRequest) as e:
            chats.tool_use(_chat(), "prompt.chat", template, parser=flag)
        message = str(e.value)
        assert message.startswith("prompt.chat.tool_choice: auto (the default with tools) needs a tool-call parser")
        assert why in message and "--tool-call-parser hermes|llama3_json|mistral" in message
        assert "tool_choice required or a named function" in message
        with pytest.raises(InvalidRequest):  # (tool_choice "auto" sent: the same as unset)
            chats.tool_use(_chat(api.ToolChoice(mode="auto")), "prompt.chat", template, parser=flag)


@pytest.mark.parametrize("flag", ["auto", "none"])
def test_required_named_and_none_need_no_parser(flag):
    required = chats.tool_use(_chat(api.ToolChoice(mode="required")), "prompt.chat", SMOLLM2_PLAIN, parser=flag)
    assert required.fmt == "required" and required.constraint.strict
    named = chats.tool_use(_chat(api.ToolChoice(function="get_weather")), "prompt.chat", SMOLLM2_PLAIN, parser=flag)
    assert named.fmt == "named" and json.loads(named.constraint.json_schema)["required"] == ["city"]
    assert chats.tool_use(_chat(api.ToolChoice(mode="none")), "prompt.chat", SMOLLM2_PLAIN, parser=flag).fmt == ""


def test_auto_reads_with_the_templates_parser_or_the_flags():
    assert chats.tool_use(_chat(), "prompt.chat", SMOLLM2_TOOLS, parser="auto").fmt == "hermes"
    assert chats.tool_use(_chat(), "prompt.chat", SMOLLM2_PLAIN, parser="hermes").fmt == "hermes"
    own = _chat()
    own.chat_template = "{{ '[TOOL_CALLS]' }}"  # (a request's own template, where the server trusts them)
    assert chats.tool_use(own, "prompt.chat", SMOLLM2_PLAIN, parser="auto").fmt == "mistral"


def test_the_builtin_smollm2_gets_the_template_with_tools():
    assert REGISTRY_MODELS["smollm2-135m-instruct"].chat_template == SMOLLM2_TOOLS
    assert tool_calls.server_parser("auto", SMOLLM2_TOOLS)[0] == "hermes"


CHATS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
     {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "And?"}],
]


@pytest.mark.parametrize("messages", CHATS)
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_without_tools_the_template_renders_what_the_ggufs_renders(messages, generation_prompt):
    plain, tools = _compile(SMOLLM2_PLAIN), _compile(SMOLLM2_TOOLS)
    assert tools.render(messages=messages, tools=None, add_generation_prompt=generation_prompt) == \
        plain.render(messages=messages, add_generation_prompt=generation_prompt)


@pytest.mark.parametrize("system", [None, "Be brief."])
def test_with_tools_the_template_shows_them_and_a_call_it_renders_parses_back(system):
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": "Weather in Paris?"}, {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"}]
    text = _compile(SMOLLM2_TOOLS).render(messages=messages, tools=TOOLS, add_generation_prompt=True)
    assert text.count("<|im_start|>system\n") == 1 and (system or "SmolLM") in text
    assert json.dumps(TOOLS[0]) in text and "<tool_response>\nsunny\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n")
    turn = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    got = tool_calls.extract("hermes", turn, final=True)  # (what the model is shown is what auto reads)
    assert [(c.name, json.loads(c.arguments)) for c in got.calls] == [("get_weather", {"city": "Paris"})]
    assert got.content == ""
