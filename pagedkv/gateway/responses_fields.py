"""Every request field of OpenAI's Responses API (``POST /v1/responses``), each honoured, refused or ignored by
design, by one table (``FIELDS``), as fields.py does for completions and chat: a field this server does not implement
is refused (400 naming it) unless absent or at a value that changes nothing; one not in the table is accepted, named
in a warning log line and in the IGNORED_FIELDS_HEADER of the answer. ``screen`` applies it to a body, and to its
``text`` and ``reasoning`` objects; responses_api.py translates what is honoured into a chat request."""

from __future__ import annotations

from collections.abc import Mapping

from pagedkv.gateway.errors import bad
from pagedkv.gateway.fields import HONOURED, IGNORED, REFUSED, Field, Screened, check_fields

RESPONSES = "responses"


def _honoured(name: str, example: object, note: str) -> Field:
    return Field(name, RESPONSES, HONOURED, example, note=note)


def _refused(name: str, example: object, accepted: tuple = (), note: str = "") -> Field:
    return Field(name, RESPONSES, REFUSED, example, (None, *accepted), note)


def _ignored(name: str, example: object, note: str = "") -> Field:
    return Field(name, RESPONSES, IGNORED, example, note=note)


_CHAT = "the chat request's"
FIELDS: tuple[Field, ...] = (
    _honoured("model", "m2", "checked against GET /v1/models; an adapter's name there selects it (adapter)"),
    _honoured("input", "hi", "a string (one user message) or input items: messages (input_text / output_text "
              "parts), function_call and function_call_output items -> chat.messages"),
    _honoured("instructions", "be brief", "a system message first (not carried over by previous_response_id)"),
    _honoured("previous_response_id", "resp_0", "the stored response's conversation (its input and output "
              "items) before input; the caller's tenant's only"),
    _honoured("store", False, "kept for GET /v1/responses/{id} and previous_response_id (default true), its KV "
              "retained for --responses-kv-ttl"),
    _honoured("stream", True, "typed SSE events (response.created ... response.completed)"),
    _honoured("max_output_tokens", 7, "sampling.max_tokens"),
    _honoured("temperature", 0.5, f"{_CHAT} temperature"),
    _honoured("top_p", 0.5, f"{_CHAT} top_p"),
    _honoured("tools", [{"type": "function", "name": "f"}], f"{_CHAT} tools (function tools only)"),
    _honoured("tool_choice", "required", f"{_CHAT} tool_choice"),
    _honoured("parallel_tool_calls", False, f"{_CHAT} parallel_tool_calls"),
    _honoured("text", {"format": {"type": "json_object"}}, f"text.format -> {_CHAT} response_format"),
    _honoured("metadata", {"k": "v"}, "kept with the response and echoed (at most 16 string pairs)"),
    _honoured("reasoning", {"effort": None}, "its fields: REASONING_FIELDS (accepted when it asks for none)"),
    # vLLM-style extensions: the chat request's own
    _honoured("seed", 7, "sampling.seed"),
    _honoured("top_k", 5, "sampling.top_k"),
    _honoured("min_p", 0.1, "sampling.min_p"),
    _honoured("repetition_penalty", 1.2, "sampling.repetition_penalty"),
    _honoured("presence_penalty", 0.5, "sampling.presence_penalty"),
    _honoured("frequency_penalty", 0.5, "sampling.frequency_penalty"),
    _honoured("stop", ["x"], "sampling.stop"),
    _honoured("priority", 3, "priority"),
    _honoured("request_id", "my-id", "request_id (as X-Request-Id; the header wins)"),
    _refused("include", ["message.output_text.logprobs"], ([],), "no extra output is included (logprobs, "
             "reasoning, search results)"),
    _refused("top_logprobs", 2, (0,), "log-probabilities are not in the Responses answer here (chat has them)"),
    _refused("background", True, (False,), "background responses are not implemented"),
    _refused("conversation", "conv_1", (), "the Conversations API is not implemented: use previous_response_id"),
    _refused("prompt", {"id": "pmpt_1"}, (), "stored prompt templates are not implemented"),
    _refused("max_tool_calls", 3, (), "hosted tools are not implemented"),
    _refused("truncation", "auto", ("disabled",), "a conversation longer than the context is refused, not cut"),
    _refused("context_management", [{"type": "compaction"}], ([],), "compaction is not implemented"),
    _refused("moderation", {"model": "x"}, (), "moderation is not implemented"),
    _refused("stream_options", {"include_obfuscation": True}, ({}, {"include_obfuscation": False}),
             "no obfuscation padding"),
    _ignored("user", "u1", "logged with the request"),
    _ignored("safety_identifier", "s1"),
    _ignored("service_tier", "default"),
    _ignored("prompt_cache_key", "k", "the prefix cache is automatic (salted per tenant)"),
    _ignored("prompt_cache_retention", "24h", "stored responses' KV is retained for --responses-kv-ttl"),
    _ignored("prompt_cache_options", {}, "the prefix cache is automatic"),
)
# reasoning: accepted when it asks for nothing (this server has no reasoning parser)
REASONING_FIELDS: tuple[Field, ...] = (
    _refused("effort", "high", ("none",), "no reasoning parser: reasoning stays in the text"),
    _refused("summary", "auto", (), "no reasoning parser: reasoning stays in the text"),
    _refused("generate_summary", "auto", (), "no reasoning parser: reasoning stays in the text"),
)
TEXT_FIELDS: tuple[Field, ...] = (
    _honoured("format", {"type": "json_object"}, "text, json_object or json_schema (name, schema, strict)"),
    _refused("verbosity", "low", ("medium",), "not passed to the chat template"),
)

_TABLES = {name: {f.name: f for f in table} for name, table in
           (("", FIELDS), ("reasoning.", REASONING_FIELDS), ("text.", TEXT_FIELDS))}


def screen(body: Mapping) -> Screened:
    """Refuses (400 naming it) a field the table refuses at its value; returns the fields ignored by design and the
    unknown ones. Types and ranges of honoured fields are responses_api.py's (and the chat path's) to check."""
    found = Screened([], [])
    check_fields(_TABLES[""], body, "", found)
    reasoning = body.get("reasoning")
    if reasoning is not None:
        if not isinstance(reasoning, Mapping):
            raise bad("reasoning", "must be an object (or null)")
        check_fields(_TABLES["reasoning."], reasoning, "reasoning.", found)
    text = body.get("text")
    if text is not None:
        if not isinstance(text, Mapping):
            raise bad("text", 'must be an object such as {"format": {"type": "json_object"}}')
        check_fields(_TABLES["text."], text, "text.", found)
    return found


def counts() -> dict[str, int]:
    """Fields by kind, nested ones included."""
    every = FIELDS + REASONING_FIELDS + TEXT_FIELDS
    return {kind: sum(f.kind == kind for f in every) for kind in (HONOURED, REFUSED, IGNORED)}
