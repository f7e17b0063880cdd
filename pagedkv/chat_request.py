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


def chat_of(messages: Sequence[Message], add_generation_prompt: bool | None = None, *, chat_template: str = "",
            chat_template_kwargs: Mapping[str, Any] | None = None, continue_final_message: bool = False) -> api.Chat:
    """``messages`` as an api.Chat; ``chat_template_kwargs``: the template's extra variables (sent as JSON)."""
    chat = api.Chat(messages=[chat_message(m) for m in messages], chat_template=chat_template,
                    chat_template_kwargs=json.dumps(dict(chat_template_kwargs)) if chat_template_kwargs else "",
                    continue_final_message=continue_final_message)
    if add_generation_prompt is not None:
        chat.add_generation_prompt = add_generation_prompt
    return chat
