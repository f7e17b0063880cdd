"""Every request field of OpenAI's completions and chat APIs and of vLLM's extensions, each honoured, refused or
ignored by design (``FIELDS``): a field this server does not implement is refused (400 naming it), never silently
dropped. ``screen`` applies the table to a body before it is translated (openai_requests.py):

- honoured: translated into the GenerateRequest (or the answer's shape); openai_requests.py reads it;
- refused: 400 naming the field, unless absent or at a value that changes nothing (its default: ``accepted``);
- ignored by design: cannot change the output (``user``, ``metadata``, ...); named in a debug log line;
- a field not in the table (unknown): accepted, named in a warning log line and in the IGNORED_FIELDS_HEADER of
  the answer (vLLM logs "fields were present in the request but ignored").

The nested fields that matter have tables of their own: ``STREAM_OPTIONS`` and ``MESSAGE_FIELDS`` (a chat
message's: what the scheduler's ChatMessage carries to the chat template)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from pagedkv.gateway.errors import bad

IGNORED_FIELDS_HEADER = "x-pagedkv-ignored-fields"
HONOURED, REFUSED, IGNORED = "honoured", "refused", "ignored by design"
BOTH, COMPLETIONS, CHAT = "both", "completions", "chat"


@dataclass(frozen=True, slots=True)
class Field:
    """One request field: ``where`` it belongs (both endpoints, completions or chat); what pagedkv does with it
    (``kind``); the values a refused field is accepted at (``accepted``: its defaults, which change nothing);
    ``example``, a value that is not the default (the table's test sends it); ``note``: where an honoured field
    goes, or why a field is refused."""

    name: str
    where: str
    kind: str
    example: object
    accepted: tuple = (None,)
    note: str = ""

    def accepts(self, value: object) -> bool:
        # (True == 1 in Python: a bool is accepted only as a bool)
        return any(value == a and isinstance(value, bool) == isinstance(a, bool) for a in self.accepted)


def _honoured(name: str, where: str, example: object, note: str) -> Field:
    return Field(name, where, HONOURED, example, note=note)


def _refused(name: str, where: str, example: object, accepted: tuple = (), note: str = "") -> Field:
    return Field(name, where, REFUSED, example, (None, *accepted), note)


def _ignored(name: str, where: str, example: object, note: str = "") -> Field:
    return Field(name, where, IGNORED, example, note=note)


_NO_SAMPLER = "not implemented by the executor's sampler"
_STRUCTURED = "sampling.constraint (structured.py)"
_NOT_TO_TEMPLATE = "not passed to the chat template (chat_template_kwargs can carry it)"
_LEGACY_FUNCTIONS = "OpenAI's deprecated function calling: send tools and tool_choice"

FIELDS: tuple[Field, ...] = (
    # -- honoured: where each goes (GenerateRequest fields; plan: the answer's shape) --
    _honoured("model", BOTH, "m2", "checked against GET /v1/models (plan.model); an adapter's name there selects it "
              "(GenerateRequest.adapter)"),
    _honoured("prompt", COMPLETIONS, "other", "text or token_ids, one request per prompt"),
    _honoured("messages", CHAT, [{"role": "user", "content": "other"}], "chat.messages (role, content)"),
    _honoured("max_tokens", BOTH, 7, "sampling.max_tokens"),
    _honoured("max_completion_tokens", CHAT, 7, "sampling.max_tokens"),
    _honoured("temperature", BOTH, 0.5, "sampling.temperature (unset: the model's default, else 1; 0: greedy)"),
    _honoured("top_p", BOTH, 0.5, "sampling.top_p (unset: the model's default, else 1)"),
    _honoured("top_k", BOTH, 5, "sampling.top_k (-1: off; unset: the model's default, else off)"),
    _honoured("seed", BOTH, 7, "sampling.seed"),
    _honoured("stop", BOTH, ["x"], "sampling.stop"),
    _honoured("stop_token_ids", BOTH, [3], "sampling.stop_token_ids"),
    _honoured("ignore_eos", BOTH, True, "sampling.ignore_eos"),
    _honoured("include_stop_str_in_output", BOTH, True, "sampling.include_stop_str_in_output"),
    _honoured("n", BOTH, 2, "sampling.n (at most the scheduler's MAX_FORKS, 16)"),
    _honoured("logprobs", COMPLETIONS, 3, "sampling.logprobs, top_logprobs=N: the sampled token's and the N most "
              "likely (at most the scheduler's --max-logprobs)"),
    _honoured("logprobs", CHAT, True, "sampling.logprobs (the sampled token's)"),
    _honoured("top_logprobs", CHAT, 2, "sampling.top_logprobs (with logprobs: true; at most --max-logprobs)"),
    _honoured("prompt_logprobs", BOTH, 1, "sampling.prompt_logprobs (vLLM's: each prompt token's and its N most "
              "likely; not streamed)"),
    _honoured("echo", COMPLETIONS, True, "sampling.echo: the prompt's text (with logprobs, its tokens') first"),
    _honoured("return_tokens_as_token_ids", BOTH, True, "logprobs name tokens token_id:N (vLLM's; plan)"),
    _honoured("stream", BOTH, True, "SSE chunks (plan.stream)"),
    _honoured("stream_options", BOTH, {"include_usage": True}, "its fields: STREAM_OPTIONS"),
    _honoured("priority", BOTH, 3, "priority"),
    _honoured("page_budget", BOTH, 4, "page_budget (pagedkv's)"),
    _honoured("request_id", BOTH, "my-id", "request_id (as X-Request-Id; the header wins)"),
    _honoured("add_generation_prompt", CHAT, False, "chat.add_generation_prompt"),
    _honoured("continue_final_message", CHAT, True, "chat.continue_final_message (with add_generation_prompt: false)"),
    _honoured("chat_template", CHAT, "{{ messages }}", "chat.chat_template (a template: only with the scheduler's "
              "--trust-request-chat-template; the name of one of the model's templates: always)"),
    _honoured("chat_template_kwargs", CHAT, {"enable_thinking": False}, "chat.chat_template_kwargs (the template's "
              "variables)"),
    _honoured("truncate_prompt_tokens", BOTH, 4, "truncate_prompt_tokens (the last N prompt tokens, after tokenizing)"),
    _honoured("presence_penalty", BOTH, 0.5, "sampling.presence_penalty"),
    _honoured("frequency_penalty", BOTH, 0.5, "sampling.frequency_penalty"),
    _honoured("repetition_penalty", BOTH, 1.2, "sampling.repetition_penalty (unset: the model's default, else 1)"),
    _honoured("min_p", BOTH, 0.1, "sampling.min_p (unset: the model's default, else 0)"),
    _honoured("min_tokens", BOTH, 3, "sampling.min_tokens"),
    _honoured("logit_bias", BOTH, {"5": 10}, "sampling.logit_bias (keys: token ids)"),
    _honoured("allowed_token_ids", BOTH, [1, 2], "sampling.allowed_token_ids"),
    _honoured("bad_words", BOTH, ["x"], "sampling.bad_words (tokenized by the scheduler)"),
    _honoured("response_format", BOTH, {"type": "json_object"}, f"{_STRUCTURED}: json_object, json_schema"),
    _honoured("structured_outputs", BOTH, {"choice": ["yes", "no"]}, f"{_STRUCTURED}: json, regex, choice, grammar"),
    _honoured("guided_json", BOTH, {"type": "object"}, f"{_STRUCTURED}: json_schema, strict"),
    _honoured("guided_regex", BOTH, "a+", f"{_STRUCTURED}: regex"),
    _honoured("guided_choice", BOTH, ["yes", "no"], f"{_STRUCTURED}: choice"),
    _honoured("guided_grammar", BOTH, "root ::= \"a\"", f"{_STRUCTURED}: grammar (xgrammar's EBNF)"),
    _honoured("tools", CHAT, [{"type": "function", "function": {"name": "f"}}],
              "chat.tools (the template's tools; calls read from the output: pagedkv/tool_calls.py)"),
    _honoured("tool_choice", CHAT, "required", "chat.tool_choice (required and named: the grammar writes the calls; "
              "auto: --tool-call-parser or the template's markup; none: text)"),
    _honoured("parallel_tool_calls", CHAT, False, "chat.parallel_tool_calls (false: one call at most)"),
    # -- refused unless at their defaults --
    _refused("logits_processors", BOTH, ["a.b"], ([],), _NO_SAMPLER),
    _refused("echo", CHAT, True, (False,), "vLLM's chat echo (the last message's content first) is not implemented"),

    _refused("best_of", BOTH, 2, (1,), "one sample per choice"),
    _refused("use_beam_search", BOTH, True, (False,), "beam search is not implemented"),
    _refused("length_penalty", BOTH, 0.5, (1,), "beam search is not implemented"),
    _refused("suffix", COMPLETIONS, "x", ("",), "insertion is not implemented"),
    _refused("guided_decoding_backend", BOTH, "outlines", ("xgrammar", "auto"), "structured outputs use xgrammar"),
    _refused("guided_whitespace_pattern", BOTH, " ", (), "JSON is written compact (no whitespace pattern)"),
    _refused("structural_tag", BOTH, "{}", (), "structural tags are not implemented"),
    _refused("functions", CHAT, [{"name": "f"}], ([],), _LEGACY_FUNCTIONS),
    _refused("function_call", CHAT, "auto", ("none",), _LEGACY_FUNCTIONS),
    _refused("add_special_tokens", COMPLETIONS, False, (True,), "a text prompt is tokenized with BOS"),
    _refused("add_special_tokens", CHAT, True, (False,), "the chat template places the special tokens"),
    _refused("skip_special_tokens", BOTH, False, (True,), "the text skips special tokens"),
    _refused("spaces_between_special_tokens", BOTH, False, (True,), "the text skips special tokens"),
    _refused("documents", CHAT, [{"text": "x"}], ([],), _NOT_TO_TEMPLATE),
    _refused("reasoning_effort", CHAT, "low", (), _NOT_TO_TEMPLATE),
    _refused("include_reasoning", CHAT, False, (True,), "no reasoning parser: reasoning stays in the text"),
    _refused("verbosity", CHAT, "low", (), _NOT_TO_TEMPLATE),
    _refused("audio", CHAT, {"format": "wav"}, (), "text only"),
    _refused("modalities", CHAT, ["audio"], (["text"],), "text only"),
    _refused("prediction", CHAT, {"type": "content", "content": "x"}, (), "predicted outputs are not implemented"),
    _refused("web_search_options", CHAT, {}, (), "web search is not implemented"),
    _refused("moderation", CHAT, {}, (), "moderation is not implemented"),
    _refused("prompt_embeds", COMPLETIONS, "AAAA", (), "embeddings as prompts are not implemented"),
    _refused("mm_processor_kwargs", BOTH, {"x": 1}, ({},), "text only"),
    _refused("cache_salt", BOTH, "salt", (), "the prefix cache is salted per tenant, not per request"),
    _refused("kv_transfer_params", BOTH, {"x": 1}, (), "disaggregated serving is not implemented"),
    _refused("vllm_xargs", BOTH, {"x": 1}, ({},), "no custom extensions"),
    # -- ignored by design: cannot change the output --
    _ignored("user", BOTH, "u1", "logged with the request"),
    _ignored("safety_identifier", CHAT, "s1"),
    _ignored("metadata", CHAT, {"k": "v"}),
    _ignored("store", CHAT, True),
    _ignored("service_tier", CHAT, "default"),
    _ignored("prompt_cache_key", CHAT, "k", "the prefix cache is automatic"),
    _ignored("prompt_cache_retention", CHAT, "24h", "the prefix cache is automatic"),
    _ignored("prompt_cache_options", CHAT, {}, "the prefix cache is automatic"),
)

# stream_options' fields; include_obfuscation pads chunks (OpenAI's), which changes no token
STREAM_OPTIONS: tuple[Field, ...] = (
    _honoured("include_usage", BOTH, True, "a final usage chunk"),
    _honoured("continuous_usage_stats", BOTH, True, "usage in every chunk (with include_usage; vLLM's)"),
    _ignored("include_obfuscation", BOTH, False),
)
# a chat message's fields: what the scheduler's ChatMessage carries to the chat template
_NOT_IN_MESSAGE = "the chat template gets role, content, name, tool_calls and tool_call_id only"
MESSAGE_FIELDS: tuple[Field, ...] = (
    _honoured("role", CHAT, "assistant", "chat.messages[].role"),
    _honoured("content", CHAT, "other", "chat.messages[].content (text parts)"),
    _honoured("name", CHAT, "bob", "chat.messages[].name"),
    _honoured("tool_calls", CHAT, [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
              "chat.messages[].tool_calls (arguments decoded to an object for the template, as vLLM does)"),
    _honoured("tool_call_id", CHAT, "c", "chat.messages[].tool_call_id"),
    _refused("function_call", CHAT, {"name": "f"}, (), _NOT_IN_MESSAGE),
    _refused("audio", CHAT, {"id": "a"}, (), "text only"),
    _refused("refusal", CHAT, "no", ("",), _NOT_IN_MESSAGE),
    _refused("reasoning_content", CHAT, "hm", ("",), _NOT_IN_MESSAGE),
)


def table(chat: bool, fields: tuple[Field, ...] = FIELDS) -> dict[str, Field]:
    """The fields of one endpoint, by name."""
    return {f.name: f for f in fields if f.where in (BOTH, CHAT if chat else COMPLETIONS)}


_TABLES = {False: table(False), True: table(True)}
_STREAM_OPTIONS, _MESSAGE_FIELDS = table(True, STREAM_OPTIONS), table(True, MESSAGE_FIELDS)


@dataclass(slots=True)
class Screened:
    """What ``screen`` found besides refusals: fields ignored by design, and unknown ones (dotted for a nested
    field: ``stream_options.x``, ``messages[0].x``)."""

    ignored: list[str]
    unknown: list[str]


def check_fields(fields: dict[str, Field], body: Mapping, prefix: str, found: Screened) -> None:
    """Screens ``body``'s keys against ``fields`` (names shown as ``prefix``+name): 400 for a refused value,
    ignored and unknown names added to ``found``. The chat/completions tables here, the Responses API's too."""
    for name, value in body.items():
        f = fields.get(name)
        if f is None:
            found.unknown.append(f"{prefix}{name}")
        elif f.kind == REFUSED and not f.accepts(value):
            shown = repr(value) if len(repr(value)) <= 64 else repr(value)[:61] + "..."
            allowed = " or ".join(repr(a) for a in f.accepted if a is not None)
            fix = f"send {allowed} or leave it out" if allowed else "leave it out"
            raise bad(f"{prefix}{name}", f"{shown} is not supported by this server ({f.note}); {fix}")
        elif f.kind == IGNORED:
            found.ignored.append(f"{prefix}{name}")


def screen(body: Mapping, chat: bool) -> Screened:
    """Refuses (400 naming it) a field the table refuses at its value; returns the fields ignored by design and
    the unknown ones. Types and ranges of honoured fields are openai_requests.py's to check."""
    found = Screened([], [])
    check_fields(_TABLES[chat], body, "", found)
    opts = body.get("stream_options")
    if isinstance(opts, Mapping):
        check_fields(_STREAM_OPTIONS, opts, "stream_options.", found)
    messages = body.get("messages") if chat else None
    if isinstance(messages, list):
        for i, m in enumerate(messages):
            if isinstance(m, Mapping):
                check_fields(_MESSAGE_FIELDS, m, f"messages[{i}].", found)
    return found


_SHOWN_NAME = re.compile(r"[\w.\[\]-]{1,64}", re.ASCII)
MAX_HEADER_NAMES = 16


def ignored_header(names: list[str]) -> str:
    """IGNORED_FIELDS_HEADER's value: the unknown fields' names, at most MAX_HEADER_NAMES of them, and only names
    that are safe in a header (word characters, '.', '[', ']', '-'); the rest counted."""
    shown = [n for n in names if _SHOWN_NAME.fullmatch(n)][:MAX_HEADER_NAMES]
    more = len(names) - len(shown)
    return ", ".join(shown + ([f"(+{more} more)"] if more else []))


# ---- the README's table ------------------------------------------------------------------------
def _shown(f: Field, prefix: str) -> str:
    where = "" if f.where == BOTH or prefix else f" ({f.where})"
    default = [a for a in f.accepted if a is not None]
    value = "=" + repr(default[0]).replace("'", '"') if f.kind == REFUSED and default else ""
    return f"`{prefix}{f.name}{value}`{where}"


def readme_table() -> str:
    """The "OpenAI fields" table of docs/openai.md, written from the tables above (tests/unit/test_gateway_fields.py
    checks that the page has it as written here): a row of honoured fields, one of refused fields per reason, one of
    fields ignored by design."""
    groups: dict[tuple[str, str], list[str]] = {}
    for prefix, table in (("", FIELDS), ("stream_options.", STREAM_OPTIONS), ("messages[].", MESSAGE_FIELDS)):
        for f in table:
            groups.setdefault((f.kind, f.note if f.kind == REFUSED else ""), []).append(_shown(f, prefix))
    rows = ["| fields | what the gateway does |", "|---|---|"]
    for (kind, note), names in sorted(groups.items(), key=lambda g: [HONOURED, REFUSED, IGNORED].index(g[0][0])):
        what = {HONOURED: "honoured", IGNORED: "ignored by design (they cannot change the output; logged at debug)",
                REFUSED: f"refused: {note}"}[kind]
        rows.append(f"| {', '.join(names)} | {what} |")
    return "\n".join(rows)


def counts() -> dict[str, int]:
    """Fields by kind, nested ones included (a field of both endpoints counted once)."""
    every = FIELDS + STREAM_OPTIONS + MESSAGE_FIELDS
    return {kind: sum(f.kind == kind for f in every) for kind in (HONOURED, REFUSED, IGNORED)}
