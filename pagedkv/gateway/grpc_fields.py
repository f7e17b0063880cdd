"""The scheduler's field paths (api.proto's GenerateRequest, as its refusals name them: ``prompt.chat.tools[0].
function.parameters``, ``sampling.max_tokens``) in the OpenAI request's names (``tools[0].function.parameters``,
``max_tokens``): one table (``PATHS``), so that an HTTP error never names a gRPC field (#48).

A path is looked up by its longest prefix in the table (indices dropped for the lookup, kept in the answer): the
rest of the path follows the OpenAI name, whose nesting is the same (``messages[2].tool_calls[0].function.
arguments``). ``openai_text`` rewrites every path in a message: a dotted one anywhere, a bare head (``prompt``,
``sampling``) only where it names the field the message is about (before the first ':')."""

from __future__ import annotations

import re

_SAME = ("temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "ignore_eos", "include_stop_str_in_output",
         "n", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "min_tokens", "logit_bias",
         "allowed_token_ids", "bad_words", "logprobs", "prompt_logprobs", "echo", "max_tokens")
_CHAT_SAME = ("messages", "tools", "tool_choice", "parallel_tool_calls", "add_generation_prompt",
              "continue_final_message", "chat_template", "chat_template_kwargs")
PARAMETERS = "the request's parameters"  # (the scheduler's whole SamplingParams)
RESUMED = "resumed_stream"  # (continuation: set by the gateway when it resumes a stream, never by the client)

# gRPC path (indices dropped) -> (its name in a completions request, in a chat request)
PATHS: dict[str, tuple[str, str]] = {
    "prompt": ("prompt", "messages"),
    "prompt.text": ("prompt", "messages"),  # (a chat request's prompt is its messages)
    "prompt.token_ids": ("prompt", "messages"),
    "prompt.token_ids.ids": ("prompt", "messages"),
    "prompt.chat": ("messages", "messages"),
    **{f"prompt.chat.{name}": (name, name) for name in _CHAT_SAME},
    "prompt.chat.tool_choice.mode": ("tool_choice", "tool_choice"),
    "prompt.chat.tool_choice.function": ("tool_choice.function.name", "tool_choice.function.name"),
    # Tokenize's (vLLM's /tokenize: prompt or messages, tools, chat_template...)
    "text": ("prompt", "messages"),
    "chat": ("messages", "messages"),
    **{f"chat.{name}": (name, name) for name in _CHAT_SAME},
    "chat.tool_choice.mode": ("tool_choice", "tool_choice"),
    "chat.tool_choice.function": ("tool_choice.function.name", "tool_choice.function.name"),
    "sampling": (PARAMETERS, PARAMETERS),
    **{f"sampling.{name}": (name, name) for name in _SAME},
    "sampling.top_logprobs": ("logprobs", "top_logprobs"),  # (completions' logprobs=N is the N most likely)
    "sampling.constraint": ("response_format", "response_format"),  # (or structured_outputs, guided_*)
    "sampling.constraint.json_schema": ("response_format.json_schema.schema", "response_format.json_schema.schema"),
    "sampling.constraint.json_object": ("response_format", "response_format"),
    "sampling.constraint.strict": ("response_format.json_schema.strict", "response_format.json_schema.strict"),
    "sampling.constraint.regex": ("structured_outputs.regex", "structured_outputs.regex"),
    "sampling.constraint.choice": ("structured_outputs.choice", "structured_outputs.choice"),
    "sampling.constraint.choice.choices": ("structured_outputs.choice", "structured_outputs.choice"),
    "sampling.constraint.grammar": ("structured_outputs.grammar", "structured_outputs.grammar"),
    "continuation": (RESUMED, RESUMED),
    "adapter": ("model", "model"),  # (the OpenAI model field names a LoRA adapter)
    "retain_kv": ("store", "store"),
    "retain_kv.key": ("store", "store"),
    "retain_kv.ttl_s": ("store", "store"),
}
_HEADS = sorted({path.split(".")[0] for path in PATHS if path.split(".")[0] not in _SAME})
# A path: a head (not inside another name: --max-prompt-bytes, prompt_logprobs), then .name or [i] parts
PATH = re.compile(r"(?<![\w.\-])(" + "|".join(_HEADS) + r")\b((?:\.[A-Za-z_]\w*|\[\d+\])*)")
_INDEX = re.compile(r"\[\d+\]")


def openai_path(path: str, chat: bool) -> str:
    """``path`` (a gRPC field path) in the OpenAI request's names; a path outside the table is returned as is."""
    parts = re.findall(r"\.?([A-Za-z_]\w*(?:\[\d+\])*)", path)
    for cut in range(len(parts), 0, -1):
        key = ".".join(_INDEX.sub("", p) for p in parts[:cut])
        if key in PATHS:
            name = PATHS[key][chat]
            last_index = "".join(_INDEX.findall(parts[cut - 1]))
            rest = "".join("." + p for p in parts[cut:])
            return name + last_index + rest
    return path


def openai_text(text: str, chat: bool) -> str:
    """``text`` (a scheduler's refusal) with every gRPC field path in it named as in the OpenAI request."""
    head = text.split(":", 1)[0] if ":" in text else ""

    def name(m: re.Match) -> str:
        dotted = bool(m.group(2))
        if not dotted and not (m.start() == 0 and m.group(0) == head):
            return m.group(0)  # (a bare word in a sentence: "prompt (12) + max_tokens (5)")
        return openai_path(m.group(0), chat)

    return PATH.sub(name, text)


def param(text: str, chat: bool) -> str | None:
    """The OpenAI request's top-level field a refusal is about (its ``param``): the field before the first ':'."""
    m = PATH.match(text or "")
    if not m or text[m.end():m.end() + 1] != ":":
        return None
    name = re.split(r"[.\[]", openai_path(m.group(0), chat))[0]
    return None if name in (RESUMED, PARAMETERS) else name
