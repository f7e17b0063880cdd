"""HTTP errors name the OpenAI request's fields, never the scheduler's gRPC paths (#48): every field path of
GenerateRequest and TokenizeRequest (walked from api.proto's descriptors: all the scheduler's refusals can name),
and every literal path in the scheduler's sources, refused through ``from_grpc`` in a chat and a completions request,
gives a message and a ``param`` in OpenAI's names (pagedkv/gateway/grpc_fields.py's table)."""

from __future__ import annotations

import re
from pathlib import Path

import grpc
import pytest

from pagedkv.api.v1 import api_pb2 as api
from pagedkv.gateway import fields, grpc_fields
from pagedkv.gateway.errors import from_grpc, prompt_too_long

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
# What a gRPC path looks like in a message; "prompt" and "prompt[3]" are also OpenAI's (completions): its dotted forms
GRPC_PATH = re.compile(r"(?<![\w.\-])(?:(?:sampling|continuation|retain_kv|constraint)\b|prompt\.|chat[.\[]|^text:)")
PSEUDO = {grpc_fields.RESUMED, "store", "x-request-id"}  # (set by the gateway or the Responses API, not the body)


def _paths(descriptor, prefix: str = "", depth: int = 0) -> list[str]:
    """Every field path under ``descriptor``, as the scheduler names them: a repeated field with an index, the
    GenerateRequest's prompt oneof under ``prompt.`` (prompt.text, prompt.chat.tools[3].function.name)."""
    out = []
    for f in descriptor.fields:
        group = f.containing_oneof
        oneof = group.name + "." if group is not None and not group.name.startswith("_") and not depth else ""
        is_map = f.message_type is not None and f.message_type.GetOptions().map_entry
        path = f"{prefix}{oneof}{f.name}" + ("[3]" if f.is_repeated and not is_map else "")
        out.append(path)
        if f.message_type is not None and not is_map and depth < 6:
            out += _paths(f.message_type, path + ".", depth + 1)
    if not depth and oneof_heads(descriptor):
        out += oneof_heads(descriptor)
    return out


def oneof_heads(descriptor) -> list[str]:
    return [o.name for o in descriptor.oneofs if not o.name.startswith("_")]


NAMED = re.compile(r"(?<![\w{.])(?:sampling|prompt|continuation)(?:\.[a-z_]+)+(?![\w,(])")


def _messages_paths() -> set[str]:
    """The literal paths in the scheduler's refusals (``InvalidRequest("sampling.n: ...``, ``needs
    sampling.logprobs``), indices dropped."""
    found = set()
    for py in (ROOT / "scheduler_svc").glob("*.py"):
        for line in py.read_text(encoding="utf-8").splitlines():
            if line.lstrip().startswith(("raise InvalidRequest(", "f\"", "\"")):
                found |= {m.group(0) for m in NAMED.finditer(line)}
    return found


PATHS = sorted({*_paths(api.GenerateRequest.DESCRIPTOR), *_paths(api.TokenizeRequest.DESCRIPTOR)})


def test_the_walk_finds_the_fields_the_scheduler_names():
    for path in ("prompt.chat.tools[3].function.parameters", "prompt.chat.messages[3].tool_calls[3].function."
                 "arguments", "sampling.constraint.json_schema", "sampling.max_tokens", "continuation.forks[3]."
                 "draw_offset", "prompt.chat.tool_choice.mode", "sampling.logit_bias", "truncate_prompt_tokens",
                 "prompt.text", "prompt", "chat.tools[3].function.name", "text"):
        assert path in PATHS
    walked = {re.sub(r"\[\d+\]", "", p) for p in PATHS}
    named = _messages_paths()
    assert len(named) > 20 and named <= walked, sorted(named - walked)


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize("path", PATHS)
def test_no_http_error_names_a_grpc_field(path, chat):
    names = {f.name for f in fields.FIELDS}  # (a chat path in a completions request: /tokenize's)
    for code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION,
                 grpc.StatusCode.RESOURCE_EXHAUSTED):
        also = f" (see {path})" if "." in path else ""  # (a bare head is a field only before the ':')
        err = from_grpc(code, f"{path}: 7; must be less{also}", chat=chat)
        assert not GRPC_PATH.search(err.message), err.message
        assert not (chat and re.match(r"prompt\b", err.message)), err.message
        assert err.param is None or err.param in names | PSEUDO, (path, err.param)
    assert not GRPC_PATH.search(prompt_too_long(f"{path}: 9 bytes; at most 8", chat).message)


@pytest.mark.parametrize("details, chat, message, param", [
    ("prompt.chat.tools[0].function.parameters: JSON nested more than 32 levels deep", True,
     "tools[0].function.parameters: JSON nested more than 32 levels deep", "tools"),
    ("prompt.chat.messages[2].tool_calls[0].function.arguments: not valid JSON", True,
     "messages[2].tool_calls[0].function.arguments: not valid JSON", "messages"),
    ("prompt.chat.tool_choice.function: 'f' is none of prompt.chat.tools", True,
     "tool_choice.function.name: 'f' is none of tools", "tool_choice"),
    ("sampling.top_logprobs: 5 needs sampling.logprobs set", True, "top_logprobs: 5 needs logprobs set",
     "top_logprobs"),
    ("sampling.top_logprobs: 30; must be in [0, 20]", False, "logprobs: 30; must be in [0, 20]", "logprobs"),
    ("sampling.max_tokens: -1; must be > 0", False, "max_tokens: -1; must be > 0", "max_tokens"),
    ("sampling.constraint.regex: not usable (x)", False, "structured_outputs.regex: not usable (x)",
     "structured_outputs"),
    ("prompt.text: 70000 bytes of UTF-8; at most 65536 (--max-prompt-bytes)", False,
     "prompt: 70000 bytes of UTF-8; at most 65536 (--max-prompt-bytes)", "prompt"),
    ("prompt: 9 tokens (prompt_logprobs)", True, "messages: 9 tokens (prompt_logprobs)", "messages"),
])
def test_messages_read_in_the_requests_names(details, chat, message, param):
    err = from_grpc(grpc.StatusCode.INVALID_ARGUMENT, details, chat=chat)
    assert (err.message, err.param) == (message, param)


def test_a_bare_word_in_a_sentence_is_left_alone():
    text = "sampling.max_tokens: prompt (12) + max_tokens (600) = 612 exceeds the length"
    assert grpc_fields.openai_text(text, chat=True) == "max_tokens: prompt (12) + max_tokens (600) = 612 exceeds " \
        "the length"
