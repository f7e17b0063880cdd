"""Refusals name the field the client sent (issue 46, F10): a chat refused because of its tools names ``tools`` (the
gateway's body) or ``prompt.chat.tools`` (the gRPC request), not ``messages`` or an internal field such as
``sampling.constraint.json_schema``. The two measured shapes: 1,000 tools; 128 tools with tool_choice required."""

from __future__ import annotations

import json
import types

import grpc
import pytest

from pagedkv.api.v1 import api_pb2 as api
from pagedkv.bounds import MAX_TOOLS, InvalidRequest, check_chat_size
from pagedkv.gateway.errors import ApiError, from_grpc, param_of, prompt_too_long
from pagedkv.gateway.openai_requests import parse_chat
from pagedkv.gateway.request_limits import RequestLimits, check_sizes
from pagedkv.gateway.tokenize import tokenize_request
from scheduler_svc import chat as chats
from scheduler_svc.constraints import MAX_CONSTRAINT_BYTES, check_constraint

pytestmark = pytest.mark.unit

MESSAGES = [{"role": "user", "content": "What is the weather?"}]
# a tool's parameters as real ones look (about 500 bytes of schema each): 128 of them make required's schema
# larger than MAX_CONSTRAINT_BYTES
PARAMETERS = {"type": "object", "properties": {
    f"field_{j}": {"type": "string", "description": f"the {j}th detail the function needs, as free text"}
    for j in range(6)}, "required": ["field_0"]}


def _tools(n: int, description: str = "does one thing") -> list[dict]:
    return [{"type": "function", "function": {"name": f"tool_{i}", "description": description,
                                              "parameters": PARAMETERS}} for i in range(n)]


def _grpc_chat(n: int, choice: str = "", description: str = "does one thing") -> api.Chat:
    chat = api.Chat(messages=[api.ChatMessage(role="user", content=MESSAGES[0]["content"])])
    chat.tools.extend(api.Tool(type="function", function=api.FunctionDefinition(
        name=t["function"]["name"], description=description, parameters=json.dumps(PARAMETERS)))
        for t in _tools(n))
    if choice:
        chat.tool_choice.mode = choice
    return chat


# ---- the scheduler's names -> OpenAI's params ---------------------------------------------------------------------
@pytest.mark.parametrize("details, param", [
    ("prompt.chat.tools: 1000 tools; at most 128", "tools"),
    ("prompt.chat.tools: their text takes the chat's to 9000 bytes of UTF-8", "tools"),
    ("prompt.chat.tools: the JSON schema prompt.chat.tool_choice (required) makes of them is 65608 bytes; at most "
     "65536", "tools"),
    ("prompt.chat.tools[3].function.name: 'a b'", "tools"),
    ("prompt.chat.tool_choice.function: 'x' is none of prompt.chat.tools", "tool_choice"),
    ("prompt.chat.messages: text of 9000 bytes of UTF-8", "messages"),
    ("tools: 1000 tools; at most 128", "tools"),
    ("messages: text of 9000 bytes", "messages"),
])
def test_scheduler_fields_of_a_chat_with_tools_map_to_the_openai_params(details, param):
    assert param_of(details, chat=True) == param
    assert from_grpc(grpc.StatusCode.INVALID_ARGUMENT, details, chat=True).param == param


def test_prompt_too_long_names_the_field_its_refusal_names():
    tools = prompt_too_long("tools: their text takes the chat's to 2000 bytes of UTF-8", chat=True)
    assert (tools.status, tools.param, tools.code) == (400, "tools", "prompt_too_long")
    assert prompt_too_long("messages: text of 2000 bytes", chat=True).param == "messages"
    assert prompt_too_long("prompt: 2000 bytes of UTF-8", chat=False).param == "prompt"
    assert prompt_too_long("prompt[1]: 2000 bytes of UTF-8", chat=False).param == "prompt"


# ---- 1,000 tools --------------------------------------------------------------------------------------------------
def test_a_thousand_tools_are_refused_naming_tools_by_the_gateway():
    body = {"model": "m", "messages": MESSAGES, "tools": _tools(1000)}
    with pytest.raises(ApiError) as e:
        parse_chat(body, "r")
    assert (e.value.status, e.value.param, e.value.code) == (400, "tools", "array_above_max_length")
    assert e.value.message.startswith("tools: 1000 tools; at most 128")
    with pytest.raises(ApiError) as e:  # /tokenize reads a conversation the same way
        tokenize_request(body, RequestLimits.of(2048))
    assert e.value.param == "tools"
    parse_chat({**body, "tools": _tools(MAX_TOOLS)}, "r")  # (the limit itself is taken)


def test_a_thousand_tools_are_refused_naming_prompt_chat_tools_by_the_scheduler():
    with pytest.raises(InvalidRequest) as e:
        chats.check_chat(_grpc_chat(1000), "prompt.chat", 1 << 20, "{{ messages }}")
    assert str(e.value).startswith("prompt.chat.tools: 1000 tools; at most 128")
    assert from_grpc(grpc.StatusCode.INVALID_ARGUMENT, str(e.value), chat=True).param == "tools"


# ---- tools whose text takes a chat over --max-prompt-bytes ---------------------------------------------------------
def test_tools_that_take_a_chat_over_its_bytes_are_named():
    limit = 8000  # the messages take 20 bytes; 20 tools of about 750 bytes of description and schema each pass it
    with pytest.raises(InvalidRequest) as e:
        check_chat_size(_grpc_chat(20, description="x" * 100), "prompt.chat.messages", limit)
    assert str(e.value).startswith("prompt.chat.tools: their text takes the chat's to at least ")
    assert f"at most {limit} in all (--max-prompt-bytes" in str(e.value)
    assert from_grpc(grpc.StatusCode.INVALID_ARGUMENT, str(e.value), chat=True).param == "tools"
    # counted in bytes: 2-byte characters in the descriptions (7,690 characters in all, 8,890 bytes)
    with pytest.raises(InvalidRequest, match=r"^prompt\.chat\.tools: their text takes the chat's to 8890 bytes"):
        check_chat_size(_grpc_chat(10, description="\u00e9" * 120), "prompt.chat.messages", limit)
    # the messages alone over it: the messages named, tools or not
    chat = _grpc_chat(20)
    chat.messages[0].content = "\u00e9" * (limit // 2 + 1)
    with pytest.raises(InvalidRequest, match=r"^prompt\.chat\.messages: text of at least \d+ bytes"):
        check_chat_size(chat, "prompt.chat.messages", limit)
    check_chat_size(_grpc_chat(10), "prompt.chat.messages", limit)


def test_tools_that_take_a_chat_over_its_bytes_are_named_by_the_gateway():
    body = {"model": "m", "messages": MESSAGES, "tools": _tools(20, "x" * 100)}
    with pytest.raises(ApiError) as e:
        tokenize_request(body, RequestLimits(max_model_len=2048, prompt_bytes=8000, body_bytes=1 << 20))
    assert (e.value.status, e.value.param, e.value.code) == (400, "tools", "prompt_too_long")


def test_tools_that_take_a_chat_over_its_bytes_are_named_by_chat_completions():
    body = {"model": "m", "messages": MESSAGES, "tools": _tools(20, "x" * 100)}
    with pytest.raises(ApiError) as e:
        check_sizes(parse_chat(body, "r"), RequestLimits(max_model_len=2048, prompt_bytes=8000, body_bytes=1 << 20))
    assert (e.value.status, e.value.param, e.value.code) == (400, "tools", "prompt_too_long")


# ---- 128 tools with tool_choice required ---------------------------------------------------------------------------
def _required_constraint() -> tuple[chats.ToolUse, int]:
    use = chats.tool_use(_grpc_chat(128, "required"), "prompt.chat")
    return use, len(use.constraint.json_schema.encode())


def test_128_tools_make_a_required_schema_over_the_constraint_limit():
    """The shape measured: the gateway and check_chat take 128 tools; the schema required makes of them is over
    MAX_CONSTRAINT_BYTES, so check_constraint refuses it."""
    parse_chat({"model": "m", "messages": MESSAGES, "tools": _tools(128), "tool_choice": "required"}, "r")
    chats.check_chat(_grpc_chat(128, "required"), "prompt.chat", 1 << 20, "{{ messages }}")
    use, size = _required_constraint()
    assert use.fmt == "required" and size > MAX_CONSTRAINT_BYTES
    sampling = types.SimpleNamespace(ignore_eos=False, stop_token_ids=[])
    with pytest.raises(InvalidRequest, match=rf"\b{size} bytes; at most {MAX_CONSTRAINT_BYTES}\b"):
        check_constraint(api.SamplingParams(), sampling, [2], use.constraint, "prompt.chat.tool_choice (required)")


def test_128_tools_with_tool_choice_required_are_refused_naming_the_tools():
    use, size = _required_constraint()
    sampling = types.SimpleNamespace(ignore_eos=False, stop_token_ids=[])
    with pytest.raises(InvalidRequest) as e:
        check_constraint(api.SamplingParams(), sampling, [2], use.constraint, "prompt.chat.tool_choice (required)")
    assert str(e.value).startswith("prompt.chat.tools: "), str(e.value)
    assert from_grpc(grpc.StatusCode.INVALID_ARGUMENT, str(e.value), chat=True).param == "tools"
