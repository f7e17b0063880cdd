"""A chat request, checked before its template runs (``check_chat``), and rendered to prompt text (``render``).

The template sees what transformers' ``apply_chat_template`` passes it and what vLLM gives it from an OpenAI request:
``messages`` (role and content; name, tool_calls and tool_call_id where set), ``add_generation_prompt``, the named
special tokens, and the request's ``chat_template_kwargs`` as variables. An assistant's tool calls are
``{id, type: "function", function: {name, arguments}}`` with ``arguments`` decoded from its JSON text into an object,
as vLLM decodes them (transformers' templates expect a mapping; text that is not a JSON object becomes ``{}``, as in
vLLM). Every size is bounded before anything is parsed or rendered (the messages' and tools' count and text by
``pagedkv.bounds.check_chat_size``, which the gateway applies too); each refusal names the field and the limit.
A request's own template (--trust-request-chat-template) is rendered by a worker process with its own time, memory
and output bounds (``render_job``, template_pool.py); the model's render here (``render``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from pagedkv import tool_calls
from pagedkv.api.v1 import api_pb2 as api
from pagedkv.bounds import InvalidRequest, check_chat_size
from pagedkv.json_bounds import nests_deeper_than

CHAT_ROLES = ("system", "user", "assistant", "tool")
MAX_NAME_CHARS = 256  # name, tool_call_id, a tool call's id and function name
MAX_TOOL_CALLS = 128  # in one message
MAX_ARGUMENTS_DEPTH = 16  # arrays and objects in a tool call's arguments
MAX_CHAT_TEMPLATE_BYTES = 64 << 10  # real templates run 1-20 KiB
MAX_TEMPLATE_KWARGS_BYTES = 16 << 10
MAX_TEMPLATE_KWARGS_DEPTH = 8  # the top object counted
MAX_SCHEMA_DEPTH = 32  # arrays and objects in a tool's parameters schema
TOOL_CHOICES = ("none", "auto", "required")
# What the scheduler passes the template itself, and apply_chat_template's own arguments (the caller's, not the
# template's variables): a chat_template_kwargs key may be none of them.
OWN_TEMPLATE_ARGS = ("messages", "tools", "documents", "add_generation_prompt", "continue_final_message",
                     "chat_template", "tokenize", "return_dict", "return_assistant_tokens_mask", "return_tensors",
                     "padding", "truncation", "max_length", "tokenizer_kwargs", "sanitize_control_tokens",
                     "conversation")


class NoChatTemplate(Exception):
    """The model has no chat template and the request brought none: a chat prompt cannot be rendered
    (FAILED_PRECONDITION)."""


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    """A chat request as the template renderer takes it."""

    messages: list[dict]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    template: str | None = None  # the request's template, or the name of one of the model's; None: the model's
    kwargs: dict = field(default_factory=dict)
    tools: list[dict] | None = None  # the template's tools variable (None: the request has none)
    request_template: bool = False  # template is the request's own (rendered in a worker: template_pool.py)


def _too_long(value: str, name: str) -> None:
    if len(value) > MAX_NAME_CHARS:
        raise InvalidRequest(f"{name}: {len(value)} characters; at most {MAX_NAME_CHARS}")


def _arguments(text: str, name: str) -> dict:
    """A tool call's arguments as vLLM gives them to the template: the JSON object its text holds, else {}."""
    if not text:
        return {}
    if nests_deeper_than(text.encode("utf-8", "surrogatepass"), MAX_ARGUMENTS_DEPTH):
        raise InvalidRequest(f"{name}: JSON nested more than {MAX_ARGUMENTS_DEPTH} levels deep; at most "
                             f"{MAX_ARGUMENTS_DEPTH}")
    try:
        value = json.loads(text)
    except ValueError:  # (vLLM: malformed arguments in the history must not make every later turn fail)
        return {}
    return value if isinstance(value, dict) else {}


def _message(m: api.ChatMessage, where: str) -> dict:
    if m.role not in CHAT_ROLES:
        role = m.role if len(m.role) <= 32 else m.role[:32] + "..."
        raise InvalidRequest(f"{where}.role: {role!r}; must be one of {', '.join(CHAT_ROLES)}")
    out: dict = {"role": m.role, "content": m.content}
    if m.name:
        _too_long(m.name, f"{where}.name")
        out["name"] = m.name
    if m.tool_call_id:
        if m.role != "tool":
            raise InvalidRequest(f"{where}.tool_call_id: only a tool message answers a tool call (role is "
                                 f"{m.role!r})")
        _too_long(m.tool_call_id, f"{where}.tool_call_id")
        out["tool_call_id"] = m.tool_call_id
    if m.tool_calls:
        if m.role != "assistant":
            raise InvalidRequest(f"{where}.tool_calls: only an assistant message calls tools (role is {m.role!r})")
        if len(m.tool_calls) > MAX_TOOL_CALLS:
            raise InvalidRequest(f"{where}.tool_calls: {len(m.tool_calls)} calls; at most {MAX_TOOL_CALLS}")
        calls = []
        for j, call in enumerate(m.tool_calls):
            at = f"{where}.tool_calls[{j}]"
            if call.type not in ("", "function"):
                raise InvalidRequest(f"{at}.type: {call.type[:32]!r}; only 'function' tool calls are taken")
            _too_long(call.id, f"{at}.id")
            _too_long(call.function.name, f"{at}.function.name")
            arguments = _arguments(call.function.arguments, f"{at}.function.arguments")
            calls.append({"id": call.id, "type": "function",
                          "function": {"name": call.function.name, "arguments": arguments}})
        out["tool_calls"] = calls
    return out


def _json_object(text: str, where: str, depth: int, what: str) -> dict:
    """``text`` parsed as a JSON object, nested at most ``depth`` deep (counted before it is parsed); ``what`` says
    what the object is, in the refusal of anything else."""
    if nests_deeper_than(text.encode("utf-8", "surrogatepass"), depth):
        raise InvalidRequest(f"{where}: JSON nested more than {depth} levels deep; at most {depth}")
    try:
        value = json.loads(text)
    except ValueError as err:
        raise InvalidRequest(f"{where}: not valid JSON ({err})") from None
    if not isinstance(value, dict):
        raise InvalidRequest(f"{where}: must be a JSON object ({what})")
    return value


def _parameters(text: str, where: str) -> dict:
    """A tool's parameters schema (JSON text) as an object; none: an object with no properties (a function that
    takes no arguments)."""
    if not text:
        return {"type": "object", "properties": {}, "additionalProperties": False}
    return _json_object(text, where, MAX_SCHEMA_DEPTH, "a JSON Schema")


def _tools(chat: api.Chat, field: str) -> list[dict] | None:
    """The request's tools as the template takes them ({type, function: {name, description, parameters}}), checked:
    type function, names NAME and unique, parameters a JSON Schema object; tool_choice one of TOOL_CHOICES or one of
    the tools' names, and only with tools."""
    names: set[str] = set()
    tools = []
    for i, tool in enumerate(chat.tools):
        at = f"{field}.tools[{i}]"
        if tool.type not in ("", "function"):
            raise InvalidRequest(f"{at}.type: {tool.type[:32]!r}; only 'function' tools are taken")
        name = tool.function.name
        if not tool_calls.NAME.fullmatch(name):
            raise InvalidRequest(f"{at}.function.name: {name[:70]!r}; must be 1 to 64 characters of "
                                 "[A-Za-z0-9_.:-]")
        if name in names:
            raise InvalidRequest(f"{at}.function.name: {name!r} is given twice; tool names must be unique")
        names.add(name)
        function = {"name": name, "parameters": _parameters(tool.function.parameters, f"{at}.function.parameters")}
        if tool.function.description:
            function["description"] = tool.function.description
        tools.append({"type": "function", "function": function})
    choice = chat.tool_choice.WhichOneof("choice") if chat.HasField("tool_choice") else None
    if choice is not None and not tools:
        raise InvalidRequest(f"{field}.tool_choice: set only with {field}.tools")
    if choice == "mode" and chat.tool_choice.mode not in TOOL_CHOICES:
        raise InvalidRequest(f"{field}.tool_choice.mode: {chat.tool_choice.mode[:32]!r}; must be one of "
                             f"{', '.join(TOOL_CHOICES)}")
    if choice == "function" and chat.tool_choice.function not in names:
        raise InvalidRequest(f"{field}.tool_choice.function: {chat.tool_choice.function[:70]!r} is none of "
                             f"{field}.tools")
    if chat.HasField("parallel_tool_calls") and not tools:
        raise InvalidRequest(f"{field}.parallel_tool_calls: set only with {field}.tools")
    return tools or None


@dataclass(frozen=True, slots=True)
class ToolUse:
    """How a chat request's output is read (``fmt``: pagedkv.tool_calls' formats; "": plain text) and the
    constraint that makes it so (required and named tool choices)."""

    fmt: str = ""
    constraint: api.Constraint | None = None


def template_source(model_templates, requested: str) -> str | None:
    """The text of the template a request renders with: its own, one of the model's by name, or the model's."""
    if isinstance(model_templates, dict):
        if requested in model_templates:
            return model_templates[requested]
        return requested or model_templates.get("default")
    return requested or model_templates


def tool_use(chat: api.Chat, field: str, model_templates=None, parser: str = "") -> ToolUse:
    """The request's ToolUse (check_chat has checked its tools): none without tools or with tool_choice none; a
    named or required choice constrains the output, strict (the named tool's parameters; required_schema); auto reads it
    with ``parser`` (--tool-call-parser: a name; auto or '': the one the template's markup names) and is refused
    without one (none, or no markup)."""
    if not chat.tools:
        return ToolUse()
    choice = chat.tool_choice.WhichOneof("choice") if chat.HasField("tool_choice") else None
    mode = chat.tool_choice.mode if choice == "mode" else ("named" if choice == "function" else "auto")
    parallel = chat.parallel_tool_calls if chat.HasField("parallel_tool_calls") else True
    if mode == "none":
        return ToolUse()
    # (strict, whatever the tool's strict says: no property its schema does not name, as vLLM's xgrammar writes a
    # tool's arguments; a model would otherwise go on adding properties)
    schemas = {t.function.name: _parameters(t.function.parameters, "-") for t in chat.tools}
    if mode == "named":
        schema = schemas[chat.tool_choice.function]
        return ToolUse("named", api.Constraint(json_schema=json.dumps(schema, ensure_ascii=False), strict=True))
    if mode == "required":
        schema = tool_calls.required_schema(list(schemas.items()), parallel)
        return ToolUse("required", api.Constraint(json_schema=json.dumps(schema, ensure_ascii=False), strict=True))
    fmt = parser if parser not in ("", tool_calls.AUTO) else tool_calls.detect_parser(
        template_source(model_templates, chat.chat_template))
    if fmt is None or fmt == tool_calls.NONE:
        raise InvalidRequest(tool_calls.auto_refusal(f"{field}.tool_choice", parser or tool_calls.AUTO))
    return ToolUse(fmt)


def _template_kwargs(text: str, field: str) -> dict:
    if not text:
        return {}
    raw = text.encode("utf-8", "surrogatepass")
    if len(raw) > MAX_TEMPLATE_KWARGS_BYTES:
        raise InvalidRequest(f"{field}: {len(raw)} bytes of JSON; at most {MAX_TEMPLATE_KWARGS_BYTES}")
    kwargs = _json_object(text, field, MAX_TEMPLATE_KWARGS_DEPTH, "its keys are the template's variables")
    own = sorted(k for k in kwargs if k in OWN_TEMPLATE_ARGS)
    if own:
        raise InvalidRequest(f"{field}: {', '.join(own)} cannot be set here (messages, add_generation_prompt, "
                             "continue_final_message and chat_template are the request's own fields; the rest are "
                             "apply_chat_template's arguments, not the template's variables)")
    return kwargs


def check_chat(chat: api.Chat, field: str, limit: int, model_templates=None,
               trust_request_templates: bool = False) -> ChatPrompt:
    """``chat`` as the renderer takes it, checked before the template runs: 1 to MAX_CHAT_MESSAGES messages, each
    role one of CHAT_ROLES, their texts together at most ``limit`` UTF-8 bytes; names and ids of at most
    MAX_NAME_CHARS; tool calls on assistant messages only, tool_call_id on tool messages only; the template and its
    kwargs bounded. ``model_templates``: the model's chat template(s) (a string, or a dict by name); a request's
    own template is taken only with ``trust_request_templates`` (--trust-request-chat-template)."""
    check_chat_size(chat, f"{field}.messages", limit)
    messages = [_message(m, f"{field}.messages[{i}]") for i, m in enumerate(chat.messages)]
    generation_prompt = chat.add_generation_prompt if chat.HasField("add_generation_prompt") else True
    if chat.continue_final_message and generation_prompt:
        raise InvalidRequest(f"{field}.continue_final_message: cannot be set with add_generation_prompt "
                             f"({'true' if chat.HasField('add_generation_prompt') else 'true by default'}); set "
                             "add_generation_prompt to false to continue the last message")
    template = chat.chat_template or None
    named = isinstance(model_templates, dict) and template in model_templates
    if template is not None and not named:
        size = len(template.encode("utf-8", "surrogatepass"))
        if size > MAX_CHAT_TEMPLATE_BYTES:
            raise InvalidRequest(f"{field}.chat_template: {size} bytes; at most {MAX_CHAT_TEMPLATE_BYTES}")
        if not trust_request_templates:
            raise InvalidRequest(f"{field}.chat_template: a template from a request is refused (it is code the "
                                 "scheduler would run) unless the scheduler runs with --trust-request-chat-template; "
                                 "leave it out to use the model's")
    if template is None and not model_templates:
        raise NoChatTemplate(f"{field}: the model has no chat template (no chat_template in its "
                             "tokenizer_config.json); send text or token_ids, or a chat_template")
    return ChatPrompt(messages, generation_prompt, chat.continue_final_message, template,
                      _template_kwargs(chat.chat_template_kwargs, f"{field}.chat_template_kwargs"),
                      _tools(chat, field), request_template=template is not None and not named)


def render_job(prompt: ChatPrompt, special_tokens: dict[str, str], max_bytes: int) -> dict:
    """What a template worker is sent to render ``prompt``'s own template (template_sandbox.render_job's job): the
    template, the messages, tools and kwargs, the model's named special tokens (the template's bos_token and so on)
    and the bound on the rendered text, ``max_bytes`` (--max-prompt-bytes); nothing else."""
    return {"template": prompt.template, "messages": prompt.messages, "tools": prompt.tools, "kwargs": prompt.kwargs,
            "add_generation_prompt": prompt.add_generation_prompt,
            "continue_final_message": prompt.continue_final_message, "special_tokens": special_tokens,
            "max_bytes": max_bytes}


def render(tokenizer, prompt: ChatPrompt, field: str) -> str:
    """The prompt text ``tokenizer``'s apply_chat_template renders (transformers' arguments; the scheduler's
    FastTokenizer takes the same); a template's error (its raise_exception, or any other) is the request's."""
    try:
        return tokenizer.apply_chat_template(prompt.messages, tools=prompt.tools, tokenize=False,
                                             add_generation_prompt=prompt.add_generation_prompt,
                                             continue_final_message=prompt.continue_final_message,
                                             chat_template=prompt.template, **prompt.kwargs)
    except Exception as err:  # noqa: BLE001 -- a template's raise_exception, or any error it hits
        raise InvalidRequest(f"{field}: the chat template refused the messages: {err}") from None
