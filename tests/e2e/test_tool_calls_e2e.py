"""Tool calling through real processes on loopback (``pagedkv serve`` + ``pagedkv gateway``, the ``openai`` SDK).

tiny-llama has random weights, so its calls follow the tools only because the grammar writes them: with tool_choice
required every call names one of the tools and its arguments validate against that tool's schema (``jsonschema``),
with n > 1 and seeded sampling; a named choice gives that tool's arguments; parallel_tool_calls false one call.
tool_choice auto is read with the parser the template's markup names (hermes here); a regex constraint makes the
random model write the markup, so the parse is exercised end to end. Streamed answers add up to the non-streamed
ones (same seed). A history with tool calls and tool results reaches the template; bad tools are 400s naming the
field; the gRPC API says the format in the stream's first message.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import jsonschema
import openai
import pytest

from pagedkv import tool_calls
from pagedkv.client import Client
from pagedkv.local_server import LocalServer
from tests.support import procs

pytestmark = pytest.mark.e2e

# A ChatML template that renders tools and tool turns as Hermes/Qwen do (the parser is found from its <tool_call>).
HERMES = """
{%- if tools %}<|im_start|>system
You may call these tools:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
Answer each call as <tool_call>{"name": <name>, "arguments": <object>}</tool_call><|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant
{%- for c in m.tool_calls %}
<tool_call>{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}</tool_call>
{%- endfor %}<|im_end|>
{% elif m.role == 'tool' %}<|im_start|>user
<tool_response>{{ m.content }}</tool_response><|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
PLAIN = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"

WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
CONVERT = {"type": "object", "properties": {
    "amount": {"type": "integer", "minimum": 0, "maximum": 1000}, "to": {"type": "string", "pattern": "^[A-Z]{3}$"},
    "options": {"type": "object", "properties": {"round": {"type": "boolean"}}, "required": ["round"],
                "additionalProperties": False}},
    "required": ["amount", "to", "options"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "convert", "description": "Convert money", "parameters": CONVERT}},
         {"type": "function", "function": {"name": "now", "description": "The time"}}]
SCHEMAS = {t["function"]["name"]: t["function"].get("parameters", {"type": "object", "additionalProperties": False})
           for t in TOOLS}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris for 2 days?"}]
HERMES_CALL = (r'Sure\. <tool_call>\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)", "days": [1-7]\}\}'
               r"</tool_call>")


@pytest.fixture(scope="module")
def gateway(model_cache):
    server = LocalServer("--model", "tiny-llama", "--num-pages", "256", "--block-size", "8", "--threads", "1",
                         "--trust-request-chat-template")
    proc = procs.Proc("gateway", "--address", server.address, "--served-model-name", "tiny")
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{proc.port}/v1", api_key="k", max_retries=0, timeout=120)
    yield server, proc, client
    proc.stop()
    server.stop()


def _create(client, template=HERMES, **kw):
    body = {"chat_template": template, **kw.pop("extra_body", {})}
    return client.chat.completions.create(model="tiny", messages=kw.pop("messages", MESSAGES), tools=TOOLS,
                                          extra_body=body, **kw)


def _check_call(call) -> None:
    assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_required_calls_name_a_tool_and_their_arguments_follow_its_schema(gateway):
    _, _, client = gateway
    names = set()
    for seed in range(4):
        answer = _create(client, tool_choice="required", n=2, temperature=1.0, seed=seed, max_tokens=400)
        for choice in answer.choices:
            assert choice.finish_reason == "tool_calls", choice
            assert choice.message.content is None and choice.message.tool_calls
            for call in choice.message.tool_calls:
                _check_call(call)
                names.add(call.function.name)
    assert len(names) > 1  # (the grammar lets the random model pick among the tools)
    one = _create(client, tool_choice="required", parallel_tool_calls=False, temperature=1.0, seed=7, max_tokens=300)
    assert len(one.choices[0].message.tool_calls) == 1 and one.choices[0].finish_reason == "tool_calls"


def test_a_named_choice_writes_that_tools_arguments(gateway):
    _, _, client = gateway
    for seed in range(3):
        answer = _create(client, tool_choice={"type": "function", "function": {"name": "convert"}}, temperature=1.0,
                         seed=seed, max_tokens=300)
        (call,) = answer.choices[0].message.tool_calls
        assert call.function.name == "convert" and answer.choices[0].finish_reason == "tool_calls"
        _check_call(call)


def _streamed(client, **kw) -> tuple[str | None, list[tuple[str, str]], str]:
    content, calls, finish = None, {}, None
    for chunk in _create(client, stream=True, **kw):
        for choice in chunk.choices:
            delta = choice.delta
            if delta.content:
                content = (content or "") + delta.content
            for d in delta.tool_calls or ():
                if d.id is not None:
                    assert d.index == len(calls) and d.type == "function"
                    calls[d.index] = [d.function.name, ""]
                calls[d.index][1] += d.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, [tuple(c) for c in calls.values()], finish


@pytest.mark.parametrize("choice, extra", [
    ("required", {}),
    ({"type": "function", "function": {"name": "get_weather"}}, {}),
    ("auto", {"guided_regex": HERMES_CALL}),
], ids=["required", "named", "auto"])
def test_a_stream_adds_up_to_the_non_streamed_answer(gateway, choice, extra):
    _, _, client = gateway
    kw = dict(tool_choice=choice, temperature=1.0, seed=11, max_tokens=300, extra_body=extra)
    whole = _create(client, **kw).choices[0]
    calls = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert _streamed(client, **kw) == (whole.message.content, calls, whole.finish_reason)
    assert calls and whole.finish_reason == "tool_calls"


def test_auto_reads_the_templates_markup(gateway):
    _, _, client = gateway
    answer = _create(client, tool_choice="auto", temperature=1.0, seed=3, max_tokens=100,
                     extra_body={"guided_regex": HERMES_CALL}).choices[0]
    assert answer.message.content == "Sure." and answer.finish_reason == "tool_calls"
    (call,) = answer.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] in ("Paris", "Rome")
    free = _create(client, temperature=1.0, seed=3, max_tokens=20).choices[0]  # (auto by default: free text here)
    assert free.message.tool_calls == [] or all(c.function.name in SCHEMAS for c in free.message.tool_calls)
    none = _create(client, tool_choice="none", max_tokens=100, extra_body={"guided_regex": HERMES_CALL}).choices[0]
    assert none.message.tool_calls == [] and none.message.content.startswith("Sure. <tool_call>")


def test_a_history_of_calls_and_results_reaches_the_template(gateway):
    _, proc, client = gateway
    history = [*MESSAGES,
               {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                   "name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    r = httpx.post(f"http://127.0.0.1:{proc.port}/tokenize", timeout=60, json={
        "model": "tiny", "messages": history, "tools": TOOLS, "chat_template": HERMES, "return_token_strs": False})
    assert r.status_code == 200, r.text
    detok = httpx.post(f"http://127.0.0.1:{proc.port}/detokenize", timeout=60,
                       json={"model": "tiny", "tokens": r.json()["tokens"]}).json()["prompt"]
    assert '"name": "convert"' in detok and "<tool_response>sunny, 21 C</tool_response>" in detok
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}</tool_call>' in detok
    answer = _create(client, messages=history, tool_choice="none", temperature=0, max_tokens=8).choices[0]
    assert answer.message.tool_calls == [] and answer.finish_reason == "length"


def test_bad_tools_are_400s_naming_the_field(gateway):
    _, _, client = gateway

    def refused(**kw) -> openai.BadRequestError:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=5, **kw)
        return e.value

    bad = refused(tools=TOOLS, tool_choice="auto", extra_body={"chat_template": PLAIN})
    assert bad.body["param"] == "tool_choice" and "--tool-call-parser" in bad.body["message"]
    bad = refused(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
                  tool_choice="required", extra_body={"chat_template": HERMES})
    assert bad.body["param"] == "tools" and "not usable" in bad.body["message"]
    bad = refused(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}},
                  extra_body={"chat_template": HERMES})
    assert bad.body["param"] == "tool_choice" and "'nope' is none of" in bad.body["message"]
    bad = refused(tools=[TOOLS[0], TOOLS[0]], extra_body={"chat_template": HERMES})
    assert bad.body["param"] == "tools" and "given twice" in bad.body["message"]


def test_the_grpc_api_says_how_its_output_is_read(gateway):
    server, _, _ = gateway

    async def first(**kw) -> tuple[str, str]:
        text, fmt = "", None
        async with Client(server.address) as client:
            async for msg in client.generate(messages=[("user", "hi")], chat_template=HERMES,
                                             tools=[TOOLS[0]], max_tokens=200, temperature=1.0, seed=5, **kw):
                fmt = msg.prompt.tool_call_format if fmt is None else fmt
                text += msg.text
        return fmt, text

    fmt, text = asyncio.run(first(tool_choice="required", parallel_tool_calls=False))
    assert fmt == "required"
    (call,) = tool_calls.extract(fmt, text, True).calls
    assert call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    assert asyncio.run(first(tool_choice="none"))[0] == ""
