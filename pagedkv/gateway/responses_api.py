"""OpenAI's Responses API -> the gateway's chat-completions path, as pure functions. A ``POST /v1/responses`` body
becomes an OpenAI chat body (``chat_body``), which openai_requests.parse_chat turns into the ``Plan`` every chat
request gets: one engine path. The answer's chat choice becomes the Responses output items (``output_items``) and the
response object (``response_body``); responses_stream.py sends it, responses_store.py keeps it.

Translation (Responses field -> chat field):
  instructions                      -> a system message first
  previous_response_id              -> the stored conversation's items (its input and output), then input
  input: "text"                     -> a user message
  input items: message (role user | assistant | system | developer; content a string or input_text / output_text /
  refusal parts), function_call {call_id, name, arguments}, function_call_output {call_id, output}
                                    -> messages; an assistant's text and the function calls after it are one
                                       assistant message with tool_calls, as the chat template renders a turn
  tools [{type: function, name, description, parameters, strict}] -> tools [{type: function, function: {...}}]
  tool_choice {type: function, name} -> {type: function, function: {name}}; none | auto | required as they are
  text.format json_object | json_schema {name, schema, strict} -> response_format
  max_output_tokens -> max_completion_tokens; temperature, top_p, parallel_tool_calls and the extensions as they are
The conversation is kept as *canonical items* (``Item``: message, function_call, function_call_output, text only), so
that a follow-up renders the earlier turns exactly as they were rendered (its prompt starts with their tokens: the
prefix cache, and the KV retained for a stored response, serve them)."""

from __future__ import annotations

import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass

from pagedkv.gateway import fields
from pagedkv.gateway import responses_fields as table
from pagedkv.gateway.errors import ApiError, bad
from pagedkv.gateway.openai_requests import Plan, parse_chat

ROLES = ("user", "assistant", "system", "developer")
TEXT_PARTS = {"input_text": "text", "output_text": "text", "refusal": "refusal"}
PASSED_ON = ("model", "temperature", "top_p", "parallel_tool_calls", "seed", "top_k", "min_p", "repetition_penalty",
             "presence_penalty", "frequency_penalty", "stop", "priority", "request_id")
RESPONSE_ID = re.compile(r"resp_[0-9a-f]{32}")
MAX_METADATA = 16  # OpenAI's: 16 pairs, keys up to 64 characters, values up to 512
Item = dict  # a canonical item: {"type": "message", "role", "content": str} | function_call | function_call_output


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _text(value, where: str) -> str:
    """A message's content: a string, or a list of text parts (input_text, output_text, refusal)."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise bad(where, "must be a string or a list of content parts")
    out = []
    for j, part in enumerate(value):
        kind = part.get("type") if isinstance(part, Mapping) else None
        key = TEXT_PARTS.get(kind)
        if key is None:
            raise bad(f"{where}[{j}].type", f"{str(kind)[:32]!r}; this server takes text only (input_text, "
                      "output_text, refusal parts)")
        if not isinstance(part.get(key), str):
            raise bad(f"{where}[{j}].{key}", "must be a string")
        out.append(part[key])
    return "".join(out)


def _string(item: Mapping, name: str, where: str, required: bool = True) -> str:
    value = item.get(name)
    if value is None and not required:
        return ""
    if not isinstance(value, str) or (required and not value):
        raise bad(f"{where}.{name}", "required: a string" if value is None else f"{str(value)[:32]!r} is not a "
                  "non-empty string")
    return value


def canonical_items(value, where: str = "input") -> list[Item]:
    """``input`` (a string, or a list of items) as canonical items, or a 400 naming the item and its field."""
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    if not isinstance(value, list):
        raise bad(where, "required: a string or a list of input items")
    items: list[Item] = []
    for i, item in enumerate(value):
        at = f"{where}[{i}]"
        if not isinstance(item, Mapping):
            raise bad(at, "must be an object (an input item)")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ROLES:
                raise bad(f"{at}.role", f"{str(role)[:32]!r}; one of {', '.join(ROLES)}")
            items.append({"type": "message", "role": role, "content": _text(item.get("content"), f"{at}.content")})
        elif kind == "function_call":
            arguments = item.get("arguments", "")
            if not isinstance(arguments, str):
                raise bad(f"{at}.arguments", "must be JSON text (a string)")
            items.append({"type": "function_call", "call_id": _string(item, "call_id", at),
                          "name": _string(item, "name", at), "arguments": arguments})
        elif kind == "function_call_output":
            output = item.get("output")
            items.append({"type": "function_call_output", "call_id": _string(item, "call_id", at),
                          "output": output if isinstance(output, str) else _text(output, f"{at}.output")})
        else:
            raise bad(f"{at}.type", f"{str(kind)[:40]!r} is not supported by this server; give message, "
                      "function_call or function_call_output items (text only)")
    return items


def messages_of(instructions: str, items: list[Item]) -> list[dict]:
    """The chat messages of a conversation: ``instructions`` as a system message first, then the items; function
    calls join the assistant message before them (its text and its calls: one turn)."""
    out: list[dict] = [{"role": "system", "content": instructions}] if instructions else []
    for item in items:
        kind = item["type"]
        if kind == "message":
            out.append({"role": item["role"], "content": item["content"]})
        elif kind == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
    return out


def _tools(value) -> list[dict]:
    if not isinstance(value, list):
        raise bad("tools", "must be a list of tools")
    out = []
    for i, tool in enumerate(value):
        if not isinstance(tool, Mapping) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, Mapping) else tool
            raise bad(f"tools[{i}].type", f"{str(kind)[:40]!r}; this server runs no hosted tools: give function "
                      "tools ({\"type\": \"function\", \"name\", \"parameters\"})")
        out.append({"type": "function", "function": {k: tool[k] for k in ("name", "description", "parameters",
                                                                           "strict") if tool.get(k) is not None}})
    return out


def _tool_choice(value):
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and value.get("type") == "function" and isinstance(value.get("name"), str):
        return {"type": "function", "function": {"name": value["name"]}}
    raise bad("tool_choice", 'must be "none", "auto", "required" or {"type": "function", "name": ...}')


def _response_format(text: Mapping | None) -> dict | None:
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, Mapping):
        raise bad("text.format", 'must be an object such as {"type": "json_object"}')
    kind = fmt.get("type")
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind != "json_schema":
        raise bad("text.format.type", f"{str(kind)[:40]!r}; give text, json_object or json_schema")
    if not isinstance(fmt.get("name"), str) or not fmt["name"]:
        raise bad("text.format.name", "required with json_schema: the schema's name")
    spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if fmt.get(k) is not None}
    return {"type": "json_schema", "json_schema": spec}


def _metadata(value) -> dict:
    if value is None:
        return {}
    if (not isinstance(value, Mapping) or len(value) > MAX_METADATA
            or not all(isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512
                       for k, v in value.items())):
        raise bad("metadata", f"must be an object of at most {MAX_METADATA} string pairs (keys up to 64 "
                  "characters, values up to 512)")
    return dict(value)


# The chat path's names for what a Responses request calls otherwise (a 400 from it names the Responses field)
_RENAMED = (("max_completion_tokens", "max_output_tokens"), ("response_format.json_schema", "text.format"),
            ("response_format", "text.format"), ("messages", "input"))


def renamed(err: ApiError) -> ApiError:
    """A chat-path error naming the field as this request does (messages -> input, ...)."""
    for chat_name, name in _RENAMED:
        if err.param and err.param.startswith(chat_name):
            err.param = name + err.param[len(chat_name):]
            if err.message.startswith(chat_name):
                err.message = name + err.message[len(chat_name):]
            err.args = (err.message,)
            break
    return err


@dataclass(slots=True)
class ResponsesRequest:
    """One POST /v1/responses, translated: the chat ``plan`` and what the answer echoes and the store keeps."""

    plan: Plan
    items: list[Item]  # the conversation so far: the previous response's items, then this input
    echo: dict  # the request's settings as the response object reports them
    store: bool


def parse(body: Mapping, request_id: str, previous: list[Item] | None) -> ResponsesRequest:
    """The request (``previous``: the conversation of previous_response_id, looked up by the caller; None without
    one) as a chat plan, or a 400 naming the field as this request names it."""
    if not isinstance(body, Mapping):
        raise ApiError(400, "the request body must be a JSON object")
    screened = table.screen(body)
    instructions = body.get("instructions") or ""
    if not isinstance(instructions, str):
        raise bad("instructions", "must be a string")
    store = body.get("store", True)
    if not isinstance(store, bool | None):
        raise bad("store", f"{store!r} is not a boolean")
    items = [*(previous or []), *canonical_items(body.get("input"))]
    chat: dict = {k: body[k] for k in PASSED_ON if body.get(k) is not None}
    chat["messages"] = messages_of(instructions, items)
    chat["stream"] = bool(body.get("stream"))
    if body.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = body["max_output_tokens"]
    if body.get("tools"):
        chat["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    response_format = _response_format(body.get("text"))
    if response_format is not None:
        chat["response_format"] = response_format
    try:
        plan = parse_chat(chat, request_id)
    except ApiError as err:
        raise renamed(err) from None
    plan.screened = fields.Screened(screened.ignored, screened.unknown)
    text = {"format": dict(body["text"]["format"])} if isinstance(body.get("text"), Mapping) and \
        body["text"].get("format") else {"format": {"type": "text"}}
    echo = {"instructions": instructions or None, "max_output_tokens": body.get("max_output_tokens"),
            "metadata": _metadata(body.get("metadata")), "parallel_tool_calls": plan.parallel_tool_calls,
            "previous_response_id": body.get("previous_response_id"), "temperature": body.get("temperature"),
            "text": text, "tool_choice": body.get("tool_choice") or "auto", "tools": list(body.get("tools") or []),
            "top_p": body.get("top_p"), "user": body.get("user"), "store": store is not False}
    return ResponsesRequest(plan, items, echo, store is not False)


def previous_id(body) -> str | None:
    """previous_response_id, checked for its shape (None: absent)."""
    value = body.get("previous_response_id") if isinstance(body, Mapping) else None
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise bad("previous_response_id", "must be a response id (resp_...)")
    return value


# ---- the answer ------------------------------------------------------------------------------------------------
STATUS = {"stop": "completed", "tool_calls": "completed", "length": "incomplete", "abort": "failed"}


def message_item(item_id: str, text: str, status: str = "completed") -> dict:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [text_part(text)] if status != "in_progress" else []}


def text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str = "completed") -> dict:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def output_items(content: str | None, calls: list[dict]) -> list[dict]:
    """A finished answer's output items: its text (a message, also when empty and nothing was called), then its
    function calls (``calls``: chat tool calls, {id, function: {name, arguments}})."""
    items = [message_item(new_id("msg"), content or "")] if content or not calls else []
    for call in calls:
        hex_id = call["id"].rsplit("-", 1)[-1]
        items.append(call_item(f"fc_{hex_id}", f"call_{hex_id}", call["function"]["name"],
                               call["function"]["arguments"]))
    return items


def conversation_items(output: list[dict]) -> list[Item]:
    """Output items as canonical items (what a follow-up's previous_response_id brings back)."""
    out: list[Item] = []
    for item in output:
        if item["type"] == "message":
            out.append({"type": "message", "role": "assistant",
                        "content": "".join(p.get("text", "") for p in item["content"])})
        elif item["type"] == "function_call":
            out.append({"type": "function_call", "call_id": item["call_id"], "name": item["name"],
                        "arguments": item["arguments"]})
    return out


def usage_of(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": cached_tokens},
            "output_tokens": completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt_tokens + completion_tokens}


def response_body(rid: str, created: int, model: str, echo: dict, output: list[dict], status: str,
                  usage: dict | None = None, error: dict | None = None, completed: int | None = None) -> dict:
    """The response object (OpenAI's shape), ``status`` in_progress, completed, incomplete (max_output_tokens or the
    context ran out) or failed (``error``)."""
    return {"id": rid, "object": "response", "created_at": created, "status": status,
            "completed_at": completed if status == "completed" else None, "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "model": model, "output": output, "usage": usage, "background": False, "max_tool_calls": None,
            "reasoning": {"effort": None, "summary": None}, "service_tier": "default", "truncation": "disabled",
            "top_logprobs": 0, **echo}
