"""Chat messages for the public API (``chat_of``): the Python client's (pagedkv.client) form of a conversation as an
``api.Chat``. A message is ``(role, content)`` or a mapping in OpenAI's shape: role, content, and optionally name,
tool_calls (``[{id, type, function: {name, arguments}}]``; arguments as JSON text, or an object it is written as)
and tool_call_id. The scheduler checks what it gets (scheduler_svc/chat.py)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from pagedkv.api.v1 import api_pb2 as api

Message = Mapping[str, Any] | tuple[str, str]  # {"role": ..., "content": ..., ...} or (role, content)


def chat_message(m: Message) -> api.ChatMessage:
    if not isinstance(m, Mapping):
        return api.ChatMessage(role=m[0], content=m[1])
    msg = api.ChatMessage(role=m["role"], content=m.get("content") or "", name=m.get("name") or "",
                          tool_call_id=m.get("tool_call_id") or "")
    for call in m.get("tool_calls") or ():
        function = call.get("function") or {}
        arguments = function.get("arguments") or ""
        msg.tool_calls.add(id=call.get("id") or "", type=call.get("type") or "function", function=api.FunctionCall(
            name=function.get("name") or "",
            arguments=arguments if isinstance(arguments, str) else json.dumps(arguments)))
    return msg


def tool(t: Mapping[str, Any]) -> api.Tool:
    """A tool in OpenAI's shape ({type, function: {name, description, parameters, strict}}) as an api.Tool."""
    function = t.get("function") or {}
    parameters = function.get("parameters")
    return api.Tool(type=t.get("type") or "function", function=api.FunctionDefinition(
        name=function.get("name") or "", description=function.get("description") or "",
        parameters=parameters if isinstance(parameters, str) else json.dumps(parameters) if parameters else "",
        strict=bool(function.get("strict"))))


def chat_of(messages: Sequence[Message], add_generation_prompt: bool | None = None, *, chat_template: str = "",
            chat_template_kwargs: Mapping[str, Any] | None = None, continue_final_message: bool = False,
            tools: Sequence[Mapping[str, Any]] = (), tool_choice: str | None = None,
            parallel_tool_calls: bool | None = None) -> api.Chat:
    """``messages`` as an api.Chat; ``chat_template_kwargs``: the template's extra variables (sent as JSON);
    ``tools`` in OpenAI's shape; ``tool_choice``: none, auto, required, or a tool's name (the stream's first
    message says how its text is read: Prompt.tool_call_format, for pagedkv.tool_calls.extract)."""
    chat = api.Chat(messages=[chat_message(m) for m in messages], chat_template=chat_template,
                    chat_template_kwargs=json.dumps(dict(chat_template_kwargs)) if chat_template_kwargs else "",
                    continue_final_message=continue_final_message, tools=[tool(t) for t in tools])
    if add_generation_prompt is not None:
        chat.add_generation_prompt = add_generation_prompt
    if tool_choice in ("none", "auto", "required"):
        chat.tool_choice.mode = tool_choice
    elif tool_choice is not None:
        chat.tool_choice.function = tool_choice
    if parallel_tool_calls is not None:
        chat.parallel_tool_calls = parallel_tool_calls
    return chat
