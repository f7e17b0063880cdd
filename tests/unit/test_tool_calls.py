"""Tool calls (pagedkv/tool_calls.py, scheduler_svc/chat.py's tool checks): each format read from fixed outputs; a
stream cut anywhere adds up to exactly the non-streamed answer (hypothesis picks the cuts); required's schema takes
what the grammar may write and refuses the rest (jsonschema); the scheduler's checks of tools and tool_choice, and
the template seeing the tools."""

from __future__ import annotations

import functools
import json
import types

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv import tool_calls as tc
from pagedkv.api.v1 import api_pb2 as api
from pagedkv.bounds import InvalidRequest
from pagedkv.tenancy import Tenant
from scheduler_svc import chat as chats
from scheduler_svc.constraints import check_constraint

pytestmark = pytest.mark.unit

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
           "required": ["city"]}

# (format, output, content, [(name, arguments as JSON)], named function)
CASES = [
    ("named", ' {"city": "Paris", "days": 2} ', "", [("weather", {"city": "Paris", "days": 2})], "weather"),
    ("required", '[{"name": "weather", "parameters": {"city": "Rome"}}, {"name":"time","parameters":{}}]', "",
     [("weather", {"city": "Rome"}), ("time", {})], ""),
    ("required", '[ {\n "name" : "weather" , "parameters" : { "city" : "a\\"]}" } } ]', "",
     [("weather", {"city": 'a"]}'})], ""),
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
     "Let me check.", [("weather", {"city": "Oslo"})], ""),
    ("hermes", '<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>{"name": "b", "arguments": '
     '"{\\"x\\": 1}"}</tool_call> done', "done", [("a", {}), ("b", {"x": 1})], ""),
    ("hermes", "no calls here, only <tool text", "no calls here, only <tool text", [], ""),
    ("hermes", "<tool_call>{not json}</tool_call> after", "<tool_call>{not json}</tool_call> after", [], ""),
    ("hermes", 'x <tool_call>{"name": "a", "arguments": {}}', 'x <tool_call>{"name": "a", "arguments": {}}', [], ""),
    ("llama3_json", '<|python_tag|>{"name": "weather", "parameters": {"city": "Lima"}}; {"name": "t", '
     '"parameters": {}}', "", [("weather", {"city": "Lima"}), ("t", {})], ""),
    ("llama3_json", "The answer is 4.", "The answer is 4.", [], ""),
    ("llama3_json", '{"not": "a call"}', '{"not": "a call"}', [], ""),
    ("mistral", '[TOOL_CALLS][{"name": "weather", "arguments": {"city": "Kyiv"}}]', "",
     [("weather", {"city": "Kyiv"})], ""),
    ("mistral", "[link](x) text", "[link](x) text", [], ""),
]


def _calls(extracted: tc.Extracted) -> list[tuple[str, object]]:
    return [(c.name, json.loads(c.arguments)) for c in extracted.calls]


@pytest.mark.parametrize("fmt, text, content, calls, function", CASES)
def test_each_format_reads_its_calls_and_keeps_the_rest_as_content(fmt, text, content, calls, function):
    out = tc.extract(fmt, text, True, function)
    assert out.content == content and _calls(out) == calls


def _streamed(fmt: str, pieces: list[str], function: str = "", parallel: bool = True):
    stream = tc.ToolCallStream(fmt, function, parallel)
    content, calls = "", []
    for k, piece in enumerate(pieces):
        text, deltas = stream.feed(piece, final=k == len(pieces) - 1)
        content += text
        for d in deltas:
            if "id" in d:
                assert d["index"] == len(calls) and d["type"] == "function" and d["id"].startswith("chatcmpl-tool-")
                calls.append([d["function"]["name"], d["function"]["arguments"]])
            else:
                assert set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}
                calls[d["index"]][1] += d["function"]["arguments"]
    return content, [tuple(c) for c in calls]


@settings(max_examples=60, deadline=None)
@given(case=st.sampled_from(CASES), cuts=st.lists(st.integers(min_value=0, max_value=200), max_size=12),
       parallel=st.booleans())
def test_a_stream_cut_anywhere_adds_up_to_the_whole_answer(case, cuts, parallel):
    fmt, text, _, _, function = case
    points = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    pieces = [text[a:b] for a, b in zip(points, points[1:])] + [""]  # (the finish comes with no text)
    whole = tc.extract(fmt, text, True, function, parallel)
    assert _streamed(fmt, pieces, function, parallel) == (whole.content, [(c.name, c.arguments)
                                                                           for c in whole.calls])


def test_forced_formats_stream_arguments_as_they_are_written():
    text = '[{"name": "weather", "parameters": {"city": "Paris"}}]'
    stream = tc.ToolCallStream("required")
    sent = [stream.feed(ch) for ch in text]
    first = next(i for i, (_, deltas) in enumerate(sent) if deltas)
    assert text[:first + 1].endswith('"weather"')  # (the call goes out once its name is complete)
    pieces = [d["function"]["arguments"] for _, deltas in sent for d in deltas]
    assert len(pieces) > 10 and "".join(pieces) == '{"city": "Paris"}'  # (piece by piece, not one block)


def test_an_auto_call_goes_out_whole_once_its_markup_closes_and_text_that_may_open_it_is_held():
    stream = tc.ToolCallStream("hermes")
    assert stream.feed("Hi <tool") == ("Hi", [])
    assert stream.feed('_call>{"name": "a", "arguments": {"k": 1}}') == ("", [])
    content, deltas = stream.feed("</tool_call>")
    assert content == "" and deltas[0]["function"] == {"name": "a", "arguments": '{"k": 1}'}


def test_parallel_false_keeps_the_first_call():
    out = tc.extract("hermes", '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", '
                     '"arguments": {}}</tool_call>', True, parallel=False)
    assert [c.name for c in out.calls] == ["a"]


def test_required_schema_takes_calls_of_the_tools_and_refuses_the_rest():
    schema = tc.required_schema([("weather", WEATHER), ("time", {"type": "object", "properties": {}})])
    jsonschema.validate([{"name": "weather", "parameters": {"city": "Rome"}}, {"name": "time", "parameters": {}}],
                        schema)
    for bad in ([], [{"name": "nope", "parameters": {}}], [{"name": "weather", "parameters": {"days": 2}}],
                [{"parameters": {"city": "x"}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    one = tc.required_schema([("weather", WEATHER)], parallel=False)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "weather", "parameters": {"city": "a"}}] * 2, one)


def test_the_parser_is_named_by_the_templates_markup():
    assert tc.detect_parser("{{ '<tool_call>' }}") == "hermes"
    assert tc.detect_parser("[AVAILABLE_TOOLS] [TOOL_CALLS]") == "mistral"
    assert tc.detect_parser("<|python_tag|>") == "llama3_json"
    assert tc.detect_parser("{{ messages }}") is None and tc.detect_parser(None) is None


# ---- the scheduler's side --------------------------------------------------------------------------------------
def _chat(tools=(("weather", WEATHER),), choice=None, parallel=None, template="") -> api.Chat:
    chat = api.Chat(messages=[api.ChatMessage(role="user", content="hi")], chat_template=template)
    for name, params in tools:
        chat.tools.add(type="function", function=api.FunctionDefinition(
            name=name, description=f"the {name}", parameters=json.dumps(params) if params is not None else ""))
    if choice is not None:
        chat.tool_choice.CopyFrom(choice)
    if parallel is not None:
        chat.parallel_tool_calls = parallel
    return chat


DEEP = functools.reduce(lambda v, _: [v], range(32), 1)


def _checked(chat: api.Chat, templates="{{ messages }}"):
    return chats.check_chat(chat, "prompt.chat", 1 << 20, templates, trust_request_templates=True)


def test_tools_reach_the_template_as_transformers_passes_them():
    prompt = _checked(_chat(tools=[("weather", WEATHER), ("now", None)]))
    assert prompt.tools == [
        {"type": "function", "function": {"name": "weather", "parameters": WEATHER, "description": "the weather"}},
        {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {},
                                                                        "additionalProperties": False},
                                          "description": "the now"}}]
    assert _checked(_chat(tools=())).tools is None


@pytest.mark.parametrize("chat, message", [
    (_chat(tools=[("weather", WEATHER), ("weather", WEATHER)]), "prompt.chat.tools[1].function.name: 'weather' is "
     "given twice"),
    (_chat(tools=[("bad name", WEATHER)]), "prompt.chat.tools[0].function.name: 'bad name'; must be 1 to 64"),
    (_chat(tools=[("f", [1])]), "prompt.chat.tools[0].function.parameters: must be a JSON object (a JSON Schema)"),
    (_chat(tools=[("f", {"a": DEEP})]),
     "prompt.chat.tools[0].function.parameters: JSON nested more than 32 levels deep"),
    (_chat(tools=(), choice=api.ToolChoice(mode="required")), "prompt.chat.tool_choice: set only with"),
    (_chat(choice=api.ToolChoice(mode="sometimes")), "prompt.chat.tool_choice.mode: 'sometimes'; must be one of"),
    (_chat(choice=api.ToolChoice(function="other")), "prompt.chat.tool_choice.function: 'other' is none of"),
    (_chat(tools=(), parallel=False), "prompt.chat.parallel_tool_calls: set only with"),
    (_chat(tools=[(f"f{i}", None) for i in range(129)]), "prompt.chat.tools: 129 tools; at most 128"),
])
def test_bad_tools_are_refused_naming_the_field(chat, message):
    with pytest.raises(InvalidRequest) as e:
        _checked(chat)
    assert str(e.value).startswith(message), str(e.value)


def test_tool_use_constrains_forced_choices_and_finds_auto_parsers():
    named = chats.tool_use(_chat(choice=api.ToolChoice(function="weather")), "prompt.chat")
    assert named.fmt == "named" and json.loads(named.constraint.json_schema) == WEATHER and named.constraint.strict
    required = chats.tool_use(_chat(choice=api.ToolChoice(mode="required"), parallel=False), "prompt.chat")
    assert required.fmt == "required" and json.loads(required.constraint.json_schema)["maxItems"] == 1
    assert required.constraint.strict
    assert chats.tool_use(_chat(choice=api.ToolChoice(mode="none")), "prompt.chat") == chats.ToolUse()
    assert chats.tool_use(_chat(tools=()), "prompt.chat") == chats.ToolUse()
    assert chats.tool_use(_chat(), "prompt.chat", "{{ '<tool_call>' }}").fmt == "hermes"
    assert chats.tool_use(_chat(template="[TOOL_CALLS]"), "prompt.chat", "{{ '<tool_call>' }}").fmt == "mistral"
    assert chats.tool_use(_chat(), "prompt.chat", "{{ messages }}", parser="llama3_json").fmt == "llama3_json"
    with pytest.raises(InvalidRequest, match=r"^prompt.chat.tool_choice: auto \(the default with tools\) needs a "):
        chats.tool_use(_chat(), "prompt.chat", "{{ messages }}")


def test_a_tenant_without_structured_outputs_gets_no_tool_choice_that_needs_the_grammar():
    named = chats.tool_use(_chat(choice=api.ToolChoice(function="weather")), "prompt.chat")
    sampling = types.SimpleNamespace(ignore_eos=False, stop_token_ids=[])
    plain = Tenant("plain", structured_outputs=False)
    with pytest.raises(InvalidRequest, match=r"^prompt.chat.tool_choice \(named\): tenant plain may not constrain"):
        check_constraint(api.SamplingParams(), sampling, [2], named.constraint, "prompt.chat.tool_choice (named)",
                         plain)
    assert check_constraint(api.SamplingParams(), sampling, [2], None, "", plain) is None
    small = Tenant("small", max_constraint_bytes=10)
    with pytest.raises(InvalidRequest, match=r"^prompt.chat.tools: the JSON schema .* is \d+ bytes; at most 10 "
                       r"\(tenant small's"):
        check_constraint(api.SamplingParams(), sampling, [2], named.constraint, "prompt.chat.tool_choice (named)",
                         small)
