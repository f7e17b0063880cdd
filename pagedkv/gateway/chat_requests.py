"""An OpenAI chat body's conversation -> ``api.Chat``, as pure functions (``chat_of``): the messages (role, content,
name, tool_calls, tool_call_id), vLLM's template extensions (add_generation_prompt, continue_final_message,
chat_template, chat_template_kwargs), and tools, tool_choice and parallel_tool_calls. Types are checked here (a 400
naming the field); sizes, roles, who may carry tool calls, tools' names and schemas, and the template's bounds are the
scheduler's to check (its chat checks; the chat's size: pagedkv/bounds.py), and its refusal names the field too.
/v1/chat/completions and /tokenize both read a conversation this way."""

from __future__ import annotations

import json
from collections.abc import Mapping

from pagedkv.api.v1 import api_pb2 as api
from pagedkv.bounds import MAX_TOOLS
from pagedkv.gateway.errors import ApiError, bad

CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


def _content(value, i: int) -> str:
    if isinstance(value, str):
        return value
    if value is None:
        return ""
    if isinstance(value, list):
        parts = []
        for j, part in enumerate(value):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad(f"messages[{i}].content[{j}]", "only text parts ({\"type\": \"text\", \"text\": ...}) "
                          "are supported")
            parts.append(part["text"])
        return "".join(parts)
    raise bad(f"messages[{i}].content", "must be a string or a list of text parts")


def _string(m: Mapping, name: str, where: str) -> str:
    value = m.get(name)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise bad(f"{where}.{name}", f"{str(value)[:32]!r} is not a string")
    return value


def _json_text(value, where: str, refusal: str) -> str:
    """A JSON value given as its text, or as an object (written as JSON text); "" when absent."""
    if isinstance(value, Mapping):
        return json.dumps(value, ensure_ascii=False)
    if value is not None and not isinstance(value, str):
        raise bad(where, refusal)
    return value or ""


def _tool_call(call, where: str) -> api.ToolCall:
    """One of an assistant's tool calls, OpenAI's shape: {id, type, function: {name, arguments}}; arguments as JSON
    text (OpenAI's), or an object (written as JSON text)."""
    if not isinstance(call, Mapping):
        raise bad(where, "must be an object {id, type: \"function\", function: {name, arguments}}")
    function = call.get("function")
    if not isinstance(function, Mapping):
        raise bad(f"{where}.function", "must be an object {name, arguments}")
    arguments = _json_text(function.get("arguments"), f"{where}.function.arguments",
                           "must be JSON text (a string) or an object")
    return api.ToolCall(id=_string(call, "id", where), type=_string(call, "type", where),
                        function=api.FunctionCall(name=_string(function, "name", f"{where}.function"),
                                                  arguments=arguments))


def _message(m, i: int) -> api.ChatMessage:
    if not isinstance(m, Mapping):
        raise bad(f"messages[{i}]", "must be an object with role and content")
    role = CHAT_ROLES.get(m.get("role"))
    if role is None:
        raise bad(f"messages[{i}].role", f"{str(m.get('role'))[:32]!r}; must be one of {', '.join(CHAT_ROLES)}")
    where = f"messages[{i}]"
    msg = api.ChatMessage(role=role, content=_content(m.get("content"), i), name=_string(m, "name", where),
                          tool_call_id=_string(m, "tool_call_id", where))
    calls = m.get("tool_calls")
    if calls is not None:
        if not isinstance(calls, list):
            raise bad(f"{where}.tool_calls", "must be a list of tool calls")
        msg.tool_calls.extend(_tool_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(calls))
    return msg


def _tool(tool, where: str) -> api.Tool:
    """One of the request's tools, OpenAI's shape: {type: "function", function: {name, description, parameters,
    strict}}; parameters as an object (or its JSON text)."""
    if not isinstance(tool, Mapping) or not isinstance(tool.get("function"), Mapping):
        raise bad(where, "must be an object {type: \"function\", function: {name, description, parameters}}")
    function = tool["function"]
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise bad(f"{where}.function.name", "required: the function's name")
    parameters = _json_text(function.get("parameters"), f"{where}.function.parameters", "must be a JSON Schema object")
    strict = function.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise bad(f"{where}.function.strict", f"{strict!r} is not a boolean")
    return api.Tool(type=_string(tool, "type", where), function=api.FunctionDefinition(
        name=name, description=_string(function, "description", f"{where}.function"), parameters=parameters,
        strict=bool(strict)))


def _tool_choice(value) -> api.ToolChoice:
    """OpenAI's tool_choice: "none" | "auto" | "required" | {type: "function", function: {name}}."""
    if isinstance(value, str):
        return api.ToolChoice(mode=value)
    if (isinstance(value, Mapping) and value.get("type", "function") == "function"
            and isinstance(value.get("function"), Mapping)):
        name = value["function"].get("name")
        if isinstance(name, str) and name:
            return api.ToolChoice(function=name)
    raise bad("tool_choice", 'must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}')


def tools_of(body: Mapping, chat: api.Chat) -> None:
    """tools, tool_choice and parallel_tool_calls into ``chat`` (the scheduler checks names, schemas and the
    choice against the tools)."""
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise bad("tools", "must be a list of tools")
        if len(tools) > MAX_TOOLS:  # (the scheduler's bound, named as OpenAI names it, before any is read)
            raise ApiError(400, f"tools: {len(tools)} tools; at most {MAX_TOOLS} (OpenAI's limit)", param="tools",
                           code="array_above_max_length")
        chat.tools.extend(_tool(t, f"tools[{i}]") for i, t in enumerate(tools))
    if body.get("tool_choice") is not None:
        chat.tool_choice.CopyFrom(_tool_choice(body["tool_choice"]))
    parallel = body.get("parallel_tool_calls")
    if parallel is not None:
        if not isinstance(parallel, bool):
            raise bad("parallel_tool_calls", f"{parallel!r} is not a boolean")
        chat.parallel_tool_calls = parallel


def chat_of(body: Mapping) -> api.Chat:
    """The body's conversation and its template options (vLLM's: add_generation_prompt, default true;
    continue_final_message; chat_template; chat_template_kwargs, an object), and its tools."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "required: a non-empty list of {role, content}")
    chat = api.Chat(messages=[_message(m, i) for i, m in enumerate(messages)])
    for name in ("add_generation_prompt", "continue_final_message"):
        value = body.get(name)
        if value is not None and not isinstance(value, bool):
            raise bad(name, f"{value!r} is not a boolean")
        if value is not None:
            setattr(chat, name, value)
    template = body.get("chat_template")
    if template is not None:
        if not isinstance(template, str):
            raise bad("chat_template", "must be a string: a Jinja template, or the name of one of the model's")
        chat.chat_template = template
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None:
        if not isinstance(kwargs, Mapping):
            raise bad("chat_template_kwargs", "must be an object (its keys are the template's variables)")
        chat.chat_template_kwargs = json.dumps(kwargs, ensure_ascii=False) if kwargs else ""
    tools_of(body, chat)
    return chat
