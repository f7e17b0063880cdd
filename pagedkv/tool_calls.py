"""Tool calls: what a request's tools make the model write, and how its output is read back into calls.

A chat request with ``tools`` gets one of these *formats* (the scheduler decides it and says so in the stream's first
message, ``api.Prompt.tool_call_format``; the gateway reads the output with it):

- ``named`` (tool_choice names a function): the output is constrained to the function's parameters schema; all of
  it is that call's arguments.
- ``required``: the output is constrained to a JSON array of ``{"name": ..., "parameters": {...}}`` objects, at least
  one (at most one with parallel_tool_calls false), each naming one of the tools with arguments valid against its
  schema (vLLM's form, ``required_schema``).
- ``hermes``, ``llama3_json``, ``mistral`` (tool_choice auto): the model writes freely and the family's markup is
  parsed (``<tool_call>{"name", "arguments"}</tool_call>``; ``{"name", "parameters"}`` objects separated by ``;``,
  optionally after ``<|python_tag|>``; ``[TOOL_CALLS][{"name", "arguments"}, ...]``). The parser is the scheduler's
  --tool-call-parser: a name, ``none`` (tool_choice auto refused), or ``auto`` (the default): the one the chat
  template's markup names (``detect_parser``; ``server_parser`` says which at start-up).

``extract(fmt, text, final)`` reads an output so far. It is *monotone*: as ``text`` grows, the content and each call's
arguments only grow and calls are only appended, so a stream sends the difference (``ToolCallStream``) and its pieces
add up to exactly what a non-streamed answer holds. Forced formats (named, required) stream arguments as they are
written (the grammar makes them valid); an auto format's call goes out once its markup is complete and parses, and
markup that never does stays content (nothing the model wrote is dropped).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from pagedkv.json_scan import skip_ws, string_end, value_end

PARSERS = ("hermes", "llama3_json", "mistral")  # tool_choice auto's
AUTO, NONE = "auto", "none"  # --tool-call-parser's: found from the chat template; no parser (auto refused)
PARSER_CHOICES = (AUTO, NONE, *PARSERS)
FORMATS = ("named", "required", *PARSERS)
NAME = re.compile(r"[A-Za-z0-9_.:-]{1,64}")  # a function's name (OpenAI's rule, with '.' and ':' as vLLM takes)

HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
MISTRAL_TAG = "[TOOL_CALLS]"


def detect_parser(template: str | None) -> str | None:
    """The auto parser a chat template's markup names (None: it writes no tool calls that we read)."""
    if not template:
        return None
    if HERMES_START in template:
        return "hermes"
    if MISTRAL_TAG in template:
        return "mistral"
    if PYTHON_TAG in template or ("ipython" in template and '"parameters"' in template):
        return "llama3_json"
    return None


def server_parser(flag: str, template) -> tuple[str | None, str]:
    """(the parser tool_choice auto gets with the model's own template, where that came from) for
    --tool-call-parser ``flag`` and the model's chat template(s) (a string, a dict by name, or None)."""
    if flag == NONE:
        return None, "--tool-call-parser none"
    if flag != AUTO:
        return flag, "--tool-call-parser"
    if isinstance(template, dict):
        template = template.get("default")
    found = detect_parser(template)
    if found is not None:
        return found, "the chat template's markup"
    return None, "the chat template writes no tool-call markup" if template else "the model has no chat template"


def auto_refusal(field: str, flag: str) -> str:
    """Why tool_choice auto (the default with tools) is refused, and the fixes: --tool-call-parser ``flag``."""
    if flag == NONE:
        why = "this server was started with --tool-call-parser none"
    else:
        why = (f"--tool-call-parser {AUTO} found no parser: the chat template writes no tool-call markup this server "
               f"reads (hermes {HERMES_START}, llama3_json {PYTHON_TAG}, mistral {MISTRAL_TAG})")
    return (f"{field}: auto (the default with tools) needs a tool-call parser, and {why}; start the scheduler (or "
            f"pagedkv serve) with --tool-call-parser {'|'.join(PARSERS)}, the format the model was trained to "
            "write, or send tool_choice required or a named function (the grammar then writes the calls) or none")


def required_schema(tools: list[tuple[str, dict]], parallel: bool = True) -> dict:
    """The JSON Schema of tool_choice required's output: an array of 1 (to 1 without ``parallel``) objects, each
    ``{"name": <one tool>, "parameters": <its schema>}`` and nothing else, name first (so that a stream knows the
    name before its arguments)."""
    items = [{"type": "object", "properties": {"name": {"type": "string", "enum": [name]}, "parameters": params},
              "required": ["name", "parameters"], "additionalProperties": False} for name, params in tools]
    schema: dict = {"type": "array", "minItems": 1, "items": items[0] if len(items) == 1 else {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


@dataclass(slots=True)
class Call:
    name: str
    arguments: str  # JSON text, possibly still being written (forced formats)


@dataclass(slots=True)
class Extracted:
    content: str = ""  # the text that is not a call (stripped)
    calls: list[Call] = field(default_factory=list)


def _required(text: str, final: bool, memo: dict | None = None) -> Extracted:
    """``[{"name": "f", "parameters": {...}}, ...]`` read as far as it goes: a call is known once its name is, its
    arguments are its parameters' text so far. Anything unexpected ends the reading (the grammar allows none)."""
    out = Extracted()
    i = skip_ws(text, 0)
    if i >= len(text) or text[i] != "[":
        if final and text.strip():
            out.content = text.strip()  # (not the array the grammar writes: cut short before it began)
        return out
    i += 1
    while True:
        i = skip_ws(text, i)
        if i >= len(text) or text[i] != "{":
            return out
        i += 1
        name, args = None, None
        while True:
            i = skip_ws(text, i)
            if i >= len(text) or text[i] != '"':
                break
            key_end = string_end(text, i)
            if key_end is None:
                break
            key = json.loads(text[i:key_end])
            i = skip_ws(text, key_end)
            if i >= len(text) or text[i] != ":":
                break
            start = skip_ws(text, i + 1)
            end = value_end(text, start, final, memo)
            if key == "name" and end is not None:
                value = json.loads(text[start:end])
                name = value if isinstance(value, str) else None
            elif key in ("parameters", "arguments"):
                args = text[start:end if end is not None else len(text)]
            if end is None:
                break
            i = skip_ws(text, end)
            if i < len(text) and text[i] == ",":
                i += 1
                continue
            break
        if name is not None:
            out.calls.append(Call(name, (args or "").strip()))
        if i >= len(text) or text[i] != "}":
            return out
        i = skip_ws(text, i + 1)
        if i < len(text) and text[i] == ",":
            i += 1
            continue
        return out


def _call_of(obj, args_keys=("arguments", "parameters")) -> Call | None:
    """A parsed ``{"name": ..., "arguments" | "parameters": {...}}``, or None when it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = next((obj[k] for k in args_keys if k in obj), {})
    if isinstance(args, str):  # (some models write the arguments as JSON text)
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return Call(obj["name"], json.dumps(args, ensure_ascii=False))


def _held(text: str, tag: str) -> int:
    """Where a suffix of ``text`` that may be the start of ``tag`` begins (len(text): none)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return len(text) - k
    return len(text)


def _hermes(text: str, final: bool) -> Extracted:
    out, content, i = Extracted(), [], 0
    while True:
        start = text.find(HERMES_START, i)
        if start < 0:
            rest = text[i:]
            content.append(rest if final else rest[:_held(rest, HERMES_START)])
            break
        content.append(text[i:start])
        end = text.find(HERMES_END, start)
        if end < 0:
            if final:
                content.append(text[start:])  # (never closed: what the model wrote stays)
            break
        call = None
        try:
            call = _call_of(json.loads(text[start + len(HERMES_START):end]))
        except ValueError:
            pass
        i = end + len(HERMES_END)
        if call is None:
            content.append(text[start:i])
        else:
            out.calls.append(call)
    out.content = "".join(content).strip()
    return out


def _whole(text: str, final: bool, tag: str, opens: str, read) -> Extracted:
    """An auto format whose calls are the whole output (llama3_json, mistral): held while it may be one, read at the
    end; text that is not one is content."""
    body = text.lstrip()
    maybe = body.startswith(tag) or tag.startswith(body) or body.startswith(opens) or opens.startswith(body)
    if not final:
        return Extracted() if maybe else Extracted(content=text.strip())
    if maybe:
        calls = read(body.removeprefix(tag).strip())
        if calls:
            return Extracted(calls=calls)
    return Extracted(content=text.strip())


def _llama3(body: str) -> list[Call] | None:
    decoder, calls, i = json.JSONDecoder(), [], 0
    while i < len(body):
        try:
            obj, i = decoder.raw_decode(body, i)
        except ValueError:
            return None
        call = _call_of(obj, ("parameters", "arguments"))
        if call is None:
            return None
        calls.append(call)
        i = skip_ws(body, i)
        if i < len(body):
            if body[i] != ";":
                return None
            i = skip_ws(body, i + 1)
    return calls


def _mistral(body: str) -> list[Call] | None:
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if isinstance(value, dict):
        value = [value]
    if not isinstance(value, list) or not value:
        return None
    calls = [_call_of(v) for v in value]
    return None if any(c is None for c in calls) else calls


def extract(fmt: str, text: str, final: bool, function: str = "", parallel: bool = True,
            memo: dict | None = None) -> Extracted:
    """What ``text`` (an output so far; ``final``: all of it) holds in format ``fmt``: its content and calls
    (monotone in ``text``: see the module's doc). ``function``: the named format's tool; without ``parallel`` only
    the first call is kept (auto formats; required's grammar writes one); ``memo``: the reading of an earlier,
    shorter text of the same output (a stream's), kept for the next."""
    if fmt == "named":
        out = Extracted(calls=[Call(function, text.strip())])
    elif fmt == "required":
        out = _required(text, final, memo)
    elif fmt == "hermes":
        out = _hermes(text, final)
    elif fmt == "llama3_json":
        out = _whole(text, final, PYTHON_TAG, "{", _llama3)
    elif fmt == "mistral":
        out = _whole(text, final, MISTRAL_TAG, "[{", _mistral)
    else:
        raise ValueError(f"unknown tool-call format {fmt!r}; one of {', '.join(FORMATS)}")
    if not parallel:
        del out.calls[1:]
    return out


def call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def message_calls(calls: list[Call]) -> list[dict]:
    """A non-streamed message's tool_calls (OpenAI's shape, fresh ids)."""
    return [{"id": call_id(), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in calls]


class ToolCallStream:
    """One choice's output, read as it streams: ``feed`` takes the next text and answers what to send (a content
    delta, and OpenAI's ``tool_calls`` deltas: a new call with its id, type and name, then pieces of its
    arguments); ``feed(..., final=True)`` at the end sends the rest. The pieces add up to ``extract(final=True)``."""

    def __init__(self, fmt: str, function: str = "", parallel: bool = True) -> None:
        self.fmt, self.function, self.parallel = fmt, function, parallel
        self.text, self.content = "", ""
        self.sent: list[list[str]] = []  # per call: [name, arguments sent]
        self.memo: dict = {}  # (required's JSON, read once: extract)

    @property
    def called(self) -> bool:
        return bool(self.sent)

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[dict]]:
        self.text += delta
        now = extract(self.fmt, self.text, final, self.function, self.parallel, self.memo)
        content = ""
        if now.content.startswith(self.content):  # (always, extract being monotone)
            content, self.content = now.content[len(self.content):], now.content
        deltas = []
        for index, call in enumerate(now.calls):
            if index == len(self.sent):
                self.sent.append([call.name, call.arguments])
                deltas.append({"index": index, "id": call_id(), "type": "function",
                               "function": {"name": call.name, "arguments": call.arguments}})
                continue
            sent = self.sent[index]
            if len(call.arguments) > len(sent[1]) and call.arguments.startswith(sent[1]):
                deltas.append({"index": index, "function": {"arguments": call.arguments[len(sent[1]):]}})
                sent[1] = call.arguments
        return content, deltas
