"""The public API's bounds, and the checks both the scheduler (scheduler_svc/validation.py, chat.py) and the
gateway (pagedkv/gateway/) apply: request sizes, the ranges of the numbers a request carries, a chat's messages and
tools counted against --max-prompt-bytes, a run-time adapter's name and path. Each refusal is an ``InvalidRequest``
that names the field and the limit. The scheduler's checks that need its model (vocabulary, context, tenants'
quotas) stay in scheduler_svc/."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from pagedkv.api.v1 import api_pb2 as api

if TYPE_CHECKING:  # (pagedkv/tenancy.py imports this module)
    from pagedkv.tenancy import Tenant

MAX_FORKS = 16  # sampling.n, the gateway's n too
MAX_PRIORITY = 1000  # a request's priority is in [-MAX_PRIORITY, MAX_PRIORITY]; lower is more important
PROMPT_BYTES_PER_TOKEN = 16  # default --max-prompt-bytes per token of max_model_len (UTF-8 runs 1-6 bytes a token)
MIN_PROMPT_BYTES = 64 << 10  # the default's floor, so that short contexts still take a page of text
MAX_PROMPT_BYTES = 1 << 30  # --max-prompt-bytes ceiling (gRPC message lengths are 32-bit)
TOKEN_ID_WIRE_BYTES = 5  # a token id in a packed repeated int32: a varint of at most 5 bytes
# Everything in a GenerateRequest other than the prompt, with room to spare: 16 stop strings of 256 characters
# (4 UTF-8 bytes each), 64 stop token ids, the request id, the sampling numbers and the field tags.
MESSAGE_SLACK_BYTES = 64 << 10
MAX_PENALTY = 2.0  # presence_penalty and frequency_penalty: [-MAX_PENALTY, MAX_PENALTY] (vLLM's, OpenAI's)
MAX_LOGIT_BIAS_ENTRIES = 300  # (OpenAI's)
MAX_LOGIT_BIAS = 100.0


class InvalidRequest(ValueError):
    pass


def default_max_prompt_bytes(max_model_len: int) -> int:
    return max(MIN_PROMPT_BYTES, PROMPT_BYTES_PER_TOKEN * max_model_len)


def max_message_bytes(max_prompt_bytes: int, max_model_len: int) -> int:
    """The largest new request (no continuation; the gateway's body limit by default): the longest text, or a
    full context of token ids, plus everything else a request carries."""
    return max(max_prompt_bytes, max_model_len * TOKEN_ID_WIRE_BYTES) + MESSAGE_SLACK_BYTES


def max_request_bytes(max_prompt_bytes: int, max_model_len: int) -> int:
    """The largest public request the server reads (gRPC's max_receive_message_length): a new request's
    (``max_message_bytes``) plus a continuation's token ids, at most a full context for each of MAX_FORKS forks.
    Anything larger is refused by gRPC with RESOURCE_EXHAUSTED as its length prefix arrives, before the message is
    read."""
    return max_message_bytes(max_prompt_bytes, max_model_len) + MAX_FORKS * max_model_len * TOKEN_ID_WIRE_BYTES


def check_text_bytes(text: str, field: str, limit: int) -> None:
    """Refuses text of more than ``limit`` UTF-8 bytes, before any tokenizing (the one check that must be cheap:
    a character is 1 to 4 bytes, so only text of limit/4 to limit characters is encoded to count)."""
    if len(text) * 4 <= limit:
        return
    size = len(text) if len(text) > limit else len(text.encode("utf-8", "surrogatepass"))
    if size > limit:
        more = "at least " if len(text) > limit else ""
        raise InvalidRequest(f"{field}: {more}{size} bytes of UTF-8; at most {limit} (--max-prompt-bytes; send "
                             "a shorter text, or token ids)")


# ---- a chat's size ------------------------------------------------------------------------------
MAX_CHAT_MESSAGES = 1024
MAX_TOOLS = 128  # in one request (OpenAI's limit)


def chat_text(m: api.ChatMessage) -> list[str]:
    """The texts of a message that count against --max-prompt-bytes."""
    texts = [m.content, m.name, m.tool_call_id]
    for call in m.tool_calls:
        texts += [call.id, call.function.name, call.function.arguments]
    return texts


def _texts(chat: api.Chat):
    """Every text of a chat that counts against --max-prompt-bytes: the messages', then the tools' (their names,
    descriptions and schemas reach the template too), each list with whether it is a tool's."""
    for m in chat.messages:
        yield False, chat_text(m)
    for t in chat.tools:
        yield True, [t.function.name, t.function.description, t.function.parameters]


def _message_bytes(chat: api.Chat) -> int:
    return sum(len(t.encode("utf-8", "surrogatepass")) for tool, texts in _texts(chat) if not tool for t in texts)


def _over_bytes(name: str, size: int, limit: int, tools: bool, exact: bool) -> InvalidRequest:
    """The refusal of a chat's text over --max-prompt-bytes: ``tools``, the tools' text took it over (the messages
    alone fit), which names the tools' field."""
    if tools:
        return InvalidRequest(f"{name.removesuffix('messages')}tools: their text takes the chat's to "
                              f"{'' if exact else 'at least '}{size} bytes of UTF-8 (the messages alone fit); at most "
                              f"{limit} in all (--max-prompt-bytes; send fewer tools or shorter descriptions and "
                              "parameters)")
    return InvalidRequest(f"{name}: text of {'' if exact else 'at least '}{size} bytes of UTF-8; at most {limit} in "
                          "all (--max-prompt-bytes; send fewer or shorter messages)")


def check_chat_size(chat: api.Chat, name: str, limit: int) -> None:
    """1 to MAX_CHAT_MESSAGES messages, their texts together (contents, names, ids, tool calls) and the tools' at
    most ``limit`` UTF-8 bytes (--max-prompt-bytes), counted in characters first so that nothing big is encoded just
    to be refused. ``name``: the messages' field, as the refusal names it (the tools' field, ``name`` with tools for
    messages, where the tools are too many or their text took the chat over)."""
    n = len(chat.messages)
    if not 0 < n <= MAX_CHAT_MESSAGES:
        raise InvalidRequest(f"{name}: {n} messages; must be 1 to {MAX_CHAT_MESSAGES}")
    if len(chat.tools) > MAX_TOOLS:
        raise InvalidRequest(f"{name.removesuffix('messages')}tools: {len(chat.tools)} tools; at most {MAX_TOOLS}")
    chars = 0
    for tool, texts in _texts(chat):
        chars += sum(map(len, texts))
        if chars > limit:  # a character is at least one byte (the messages', here at most ``limit``, are encoded)
            raise _over_bytes(name, chars, limit, tool and _message_bytes(chat) <= limit, exact=False)
    if chars * 4 > limit:
        messages = _message_bytes(chat)
        size = messages + sum(len(t.encode("utf-8", "surrogatepass")) for tool, texts in _texts(chat) if tool
                              for t in texts)
        if size > limit:
            raise _over_bytes(name, size, limit, messages <= limit, exact=True)


# ---- a Generate request's own bounds: checked first, before its prompt is rendered or tokenized ------------
MAX_REQUEST_ID_CHARS = 256
MAX_BAD_WORDS = 100
MAX_BAD_WORD_CHARS = 256
MAX_ADAPTER_CHARS = 256  # a LoRA adapter's name (GenerateRequest.adapter)


def check_request_id(request_id: str) -> None:
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidRequest(f"request_id: {len(request_id)} characters; at most {MAX_REQUEST_ID_CHARS}")


def check_priority(priority: int, tenant: Tenant | None = None, from_hop: str = "") -> None:
    """A request's priority: in the range, and not more important than its tenant may ask for (``from_hop``: the
    header of the trusted hop's GIE objective it came from, "" for the request's own field: the same limit holds)."""
    if not -MAX_PRIORITY <= priority <= MAX_PRIORITY:
        raise InvalidRequest(f"priority: {priority}; must be in [-{MAX_PRIORITY}, {MAX_PRIORITY}]")
    if tenant is not None and priority < tenant.max_priority:
        source = f" (the objective in {from_hop})" if from_hop else ""
        raise InvalidRequest(f"priority: {priority}{source}; tenant {tenant.id} may ask for "
                             f"{tenant.max_priority} or more (its max_priority in the tenants file; lower is more "
                             "important)")


def check_forks(n: int) -> None:
    if n < 0 or n > MAX_FORKS:
        raise InvalidRequest(f"sampling.n: {n}; must be in [1, {MAX_FORKS}] (0 means 1)")


def check_bad_words(words: list[str]) -> None:
    """sampling.bad_words: at most MAX_BAD_WORDS, each 1 to MAX_BAD_WORD_CHARS characters (checked before they are
    tokenized)."""
    if len(words) > MAX_BAD_WORDS:
        raise InvalidRequest(f"sampling.bad_words: {len(words)} words; at most {MAX_BAD_WORDS}")
    for w in words:
        if not 0 < len(w.strip()) <= MAX_BAD_WORD_CHARS:
            raise InvalidRequest(f"sampling.bad_words: a word of {len(w)} characters; each must have 1 to "
                                 f"{MAX_BAD_WORD_CHARS} (spaces around it aside)")


def check_adapter_name(name: str) -> None:
    if len(name) > MAX_ADAPTER_CHARS:
        raise InvalidRequest(f"adapter: a name of {len(name)} characters; at most {MAX_ADAPTER_CHARS} (ModelInfo "
                             "lists the adapters served)")


def check_generate(request: api.GenerateRequest, tenant: Tenant, priority: int, from_hop: str = "") -> None:
    """A Generate request's bounds that need no model, the first stage of its way in (scheduler_svc/intake.py): its
    id, its priority (``priority``: the request's own, or a trusted hop's from the header ``from_hop``), n, and its
    bad words' count and lengths, and its adapter name's length."""
    check_request_id(request.request_id)
    check_priority(priority, tenant, from_hop)
    check_forks(request.sampling.n)
    check_bad_words(list(request.sampling.bad_words))
    check_adapter_name(request.adapter)


# ---- LoadAdapter / UnloadAdapter (the gateway's /v1/load_lora_adapter and /v1/unload_lora_adapter) -----------
MAX_LOADED_NAME_CHARS = 64  # a name loaded at run time (a --lora-modules name may have up to 128)
LOADED_NAME_RULE = re.compile(rf"[A-Za-z0-9._-]{{1,{MAX_LOADED_NAME_CHARS}}}")
MAX_ADAPTER_PATH_CHARS = 4096  # PATH_MAX
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def check_loaded_name(name: str) -> None:
    """LoadAdapterRequest.name and UnloadAdapterRequest.name: 1 to MAX_LOADED_NAME_CHARS of [A-Za-z0-9._-]."""
    if not LOADED_NAME_RULE.fullmatch(name):
        shown = repr(name) if len(name) <= MAX_LOADED_NAME_CHARS else f"a name of {len(name)} characters"
        raise InvalidRequest(f"name: {shown}; must be 1 to {MAX_LOADED_NAME_CHARS} characters of A-Z a-z 0-9 . _ -")


def check_load_adapter(request: api.LoadAdapterRequest) -> None:
    """A LoadAdapter request's bounds that need no executor: its name, and a path of 1 to MAX_ADAPTER_PATH_CHARS
    characters without control characters (where it points is the executors' to check, under --lora-root)."""
    check_loaded_name(request.name)
    path = request.path
    where = "a PEFT adapter directory under the executors' --lora-root"
    if not 0 < len(path) <= MAX_ADAPTER_PATH_CHARS:
        raise InvalidRequest(f"path: {len(path)} characters; must be 1 to {MAX_ADAPTER_PATH_CHARS} ({where})")
    if control := _CONTROL.search(path):
        raise InvalidRequest(f"path: a control character ({control.group()!r}) at {control.start()}; a path has "
                             f"none ({where})")
