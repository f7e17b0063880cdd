"""OpenAI's HTTP API <-> pagedkv.api.v1, as pure functions: a request body becomes GenerateRequests (or an
ApiError naming the field), their prompts are checked against the scheduler's size limits (RequestLimits),
GenerateResponse messages become OpenAI bodies and stream chunks, a gRPC status becomes an OpenAI error with its
HTTP status. pagedkv/gateway.py serves them.

Translation (OpenAI field -> GenerateRequest):
  prompt (str | [str, ...] | [int, ...] | [[int, ...], ...]) -> text / token_ids, one request per prompt
  messages -> chat (the scheduler renders the checkpoint's chat template)
  max_tokens | max_completion_tokens -> sampling.max_tokens (completions default 16, as OpenAI; chat: none)
  temperature, top_p, top_k, seed, stop, n -> sampling.*; unset -> the checkpoint's defaults
  logprobs -> sampling.logprobs (the sampled token's only: top-k alternatives are refused)
  extensions (extra body fields): page_budget, priority, ignore_eos, stop_token_ids, include_stop_str_in_output
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import grpc

from pagedkv.api.v1 import api_pb2 as api
from pagedkv.grpc_common import QUEUE_FULL_PREFIX
from scheduler_svc.validation import InvalidRequest, check_text_bytes, default_max_prompt_bytes, max_message_bytes

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_PROMPTS = 32  # prompts in one /v1/completions request (each is a Generate call)
MAX_USER_CHARS = 256
CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
FINISH = {api.FINISH_REASON_STOP: "stop", api.FINISH_REASON_LENGTH: "length", api.FINISH_REASON_ABORT: "abort"}
# Fields we cannot honour: refused (400, naming the field) unless absent or at their neutral value.
UNSUPPORTED_UNLESS_NEUTRAL = {
    "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0), "logit_bias": (None, {}),
    "best_of": (None, 1), "echo": (None, False), "suffix": (None, ""), "tools": (None, []),
    "functions": (None, []), "tool_choice": (None, "none"), "function_call": (None, "none"),
    "audio": (None,), "prediction": (None,), "modalities": (None, ["text"]),
}


class ApiError(Exception):
    """An OpenAI error body with its HTTP status (and, for a limit that clears, how long to wait: Retry-After)."""

    TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error", 409: "conflict_error",
             429: "rate_limit_error", 503: "service_unavailable", 504: "timeout"}  # other 4xx: invalid_request_error

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.retry_after = retry_after

    @property
    def type(self) -> str:
        default = "invalid_request_error" if 400 <= self.status < 500 else "server_error"
        return self.TYPES.get(self.status, default)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def headers(self) -> dict[str, str]:
        return {"retry-after": str(self.retry_after)} if self.retry_after is not None else {}


def bad(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param)


# ---- gRPC status -> HTTP ------------------------------------------------------------------------
GRPC_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, None), grpc.StatusCode.FAILED_PRECONDITION: (400, None),
    grpc.StatusCode.OUT_OF_RANGE: (400, None), grpc.StatusCode.UNAUTHENTICATED: (401, "invalid_api_key"),
    grpc.StatusCode.PERMISSION_DENIED: (403, None), grpc.StatusCode.NOT_FOUND: (404, None),
    grpc.StatusCode.ALREADY_EXISTS: (409, None), grpc.StatusCode.UNAVAILABLE: (503, None),
    grpc.StatusCode.CANCELLED: (503, None), grpc.StatusCode.DEADLINE_EXCEEDED: (504, None),
}  # RESOURCE_EXHAUSTED: 429, 413 or 400, by its message (from_grpc)
RETRY_AFTER_S = 1  # a 429's Retry-After: queue and stream limits clear as requests start and end
# gRPC's own words when a message is over a channel's size limit (received by the scheduler, or sent by us)
_TOO_LARGE = re.compile(r"message larger than max \((\d+) vs\. (\d+)\)")
# The scheduler's field names (before ':' in its messages) -> OpenAI's
_PROTO_PARAMS = {"prompt": "prompt", "text": "prompt", "token_ids": "prompt", "chat": "messages",
                 "request_id": "x-request-id"}
_FIELD = re.compile(r"^([A-Za-z_][\w.\[\]]*):")


def param_of(details: str, chat: bool) -> str | None:
    m = _FIELD.match(details or "")
    if not m:
        return None
    name = m.group(1).split("[")[0]
    head = name.split(".")[0]
    if head == "sampling":
        return name.split(".")[1] if "." in name else None
    if head in ("prompt", "text", "token_ids", "chat"):
        return "messages" if chat else "prompt"
    return _PROTO_PARAMS.get(head, head)


def from_grpc(code: grpc.StatusCode, details: str, chat: bool = False) -> ApiError:
    """The scheduler's refusal in OpenAI's terms. RESOURCE_EXHAUSTED means two things: a queue bound reached, a
    limit that clears as requests start and end (its message starts with QUEUE_FULL_PREFIX: 429 with Retry-After,
    the one status clients retry), and anything else, which a retry cannot cure: gRPC's own refusal of a message
    over the scheduler's size limit (413), or another limit (400)."""
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        if (details or "").startswith(QUEUE_FULL_PREFIX):
            return ApiError(429, details, code="rate_limit_exceeded", retry_after=RETRY_AFTER_S)
        too_large = _TOO_LARGE.search(details or "")
        if too_large:
            field = "messages" if chat else "prompt"
            return ApiError(413, f"{field}: the request is {too_large.group(1)} bytes on the wire; the scheduler "
                            f"takes at most {too_large.group(2)} (its --max-prompt-bytes of text or a full context "
                            "of token ids, plus a resume's token ids and 64 KiB)", param=field,
                            code="request_too_large")
        return ApiError(400, details or code.name, code="resource_exhausted")
    status, err_code = GRPC_STATUS.get(code, (500, None))
    param = param_of(details, chat) if status == 400 else None
    return ApiError(status, details or code.name, param=param, code=err_code or code.name.lower())


# ---- field readers -------------------------------------------------------------------------------
def _int(body: Mapping, name: str, lo: int, hi: int) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad(name, f"{v!r} is not an integer")
    if not lo <= v <= hi:
        raise bad(name, f"{v}; must be in [{lo}, {hi}]")
    return v


def _float(body: Mapping, name: str, lo: float, hi: float) -> float | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise bad(name, f"{v!r} is not a finite number")
    if not lo <= v <= hi:
        raise bad(name, f"{v}; must be in [{lo}, {hi}]")
    return float(v)


def _bool(body: Mapping, name: str) -> bool | None:
    v = body.get(name)
    if v is not None and not isinstance(v, bool):
        raise bad(name, f"{v!r} is not a boolean")
    return v


def _strings(body: Mapping, name: str) -> list[str]:
    v = body.get(name)
    if v is None:
        return []
    if isinstance(v, str):
        return [v]
    if isinstance(v, list) and all(isinstance(s, str) for s in v):
        return v
    raise bad(name, "must be a string or a list of strings")


def _ids(v, name: str) -> list[int] | None:
    if isinstance(v, list) and v and all(isinstance(i, int) and not isinstance(i, bool) for i in v):
        if any(not 0 <= i < 2**31 for i in v):
            raise bad(name, "token ids must be in [0, 2^31)")
        return v
    return None


# ---- requests ------------------------------------------------------------------------------------
@dataclass(slots=True)
class Plan:
    """One OpenAI request, translated: a GenerateRequest per prompt, n forks each."""

    chat: bool
    model: str
    requests: list[api.GenerateRequest]
    n: int
    stream: bool
    include_usage: bool
    logprobs: bool
    user: str = ""
    token_text: Callable[[int], str] | None = None  # names tokens in logprobs (the gateway's --tokenizer)

    @property
    def num_choices(self) -> int:
        return len(self.requests) * self.n


def _common(body: Mapping, chat: bool) -> tuple[api.SamplingParams, dict]:
    """Sampling and the request-level extensions shared by both endpoints."""
    for name, neutral in UNSUPPORTED_UNLESS_NEUTRAL.items():
        if body.get(name, None) not in neutral:
            raise bad(name, f"{body[name]!r} is not supported by this server (only {neutral[-1]!r} or absent)")
    if chat:
        fmt = body.get("response_format")
        if fmt not in (None, {"type": "text"}):
            raise bad("response_format", "only {\"type\": \"text\"} is supported")
    max_tokens = _int(body, "max_completion_tokens", 1, 2**31 - 1) if chat else None
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", 1, 2**31 - 1)
    if max_tokens is None and not chat:
        max_tokens = DEFAULT_COMPLETION_MAX_TOKENS
    sampling = api.SamplingParams(max_tokens=max_tokens or 0, n=_int(body, "n", 1, 128) or 1)
    for name, value in (("temperature", _float(body, "temperature", 0.0, 2.0)),
                        ("top_p", _float(body, "top_p", 0.0, 1.0)), ("top_k", _int(body, "top_k", -1, 2**31 - 1)),
                        ("seed", _int(body, "seed", -(2**63), 2**64 - 1))):
        if value is None:
            continue
        if name == "top_k" and value == -1:  # vLLM's spelling of "no top-k filter"
            value = 0
        if name == "seed" and value < 0:  # OpenAI takes signed seeds; the sampler's seed is 64 bits
            value += 2**64
        setattr(sampling, name, value)
    sampling.stop.extend(_strings(body, "stop"))
    stop_ids = body.get("stop_token_ids")
    if stop_ids is not None:
        if stop_ids == []:
            pass
        elif _ids(stop_ids, "stop_token_ids") is None:
            raise bad("stop_token_ids", "must be a list of token ids")
        else:
            sampling.stop_token_ids.extend(stop_ids)
    sampling.ignore_eos = bool(_bool(body, "ignore_eos"))
    sampling.include_stop_str_in_output = bool(_bool(body, "include_stop_str_in_output"))
    if chat:
        logprobs = bool(_bool(body, "logprobs"))
        top = _int(body, "top_logprobs", 0, 20)
        if top:
            raise bad("top_logprobs", f"{top}; this server returns the sampled token's log-probability only "
                      "(top_logprobs must be 0 or absent)")
    else:
        top = _int(body, "logprobs", 0, 5)
        if top:
            raise bad("logprobs", f"{top}; this server returns the sampled token's log-probability only "
                      "(logprobs must be 0 for that, or absent)")
        logprobs = top == 0
    sampling.logprobs = logprobs
    ext = {"priority": _int(body, "priority", -(2**31), 2**31 - 1) or 0,
           "page_budget": _int(body, "page_budget", 0, 2**31 - 1) or 0, "logprobs": logprobs}
    return sampling, ext


def _model_and_stream(body: Mapping) -> tuple[str, bool, bool, str]:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("model", "required: the model's name (GET /v1/models lists it)")
    stream = bool(_bool(body, "stream"))
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise bad("stream_options", "must be an object")
    include_usage = bool(_bool(opts, "include_usage")) if opts else False
    if opts and not stream:
        raise bad("stream_options", "only allowed with stream: true")
    user = body.get("user") or ""
    if not isinstance(user, str) or len(user) > MAX_USER_CHARS:
        raise bad("user", f"must be a string of at most {MAX_USER_CHARS} characters")
    return model, stream, include_usage, user


def _prompts(value) -> list[str | list[int]]:
    if isinstance(value, str):
        return [value]
    if _ids(value, "prompt") is not None:
        return [value]
    if isinstance(value, list) and value:
        out: list[str | list[int]] = []
        for p in value:
            if isinstance(p, str):
                out.append(p)
            elif _ids(p, "prompt") is not None:
                out.append(p)
            else:
                break
        else:
            if len(out) > MAX_PROMPTS:
                raise bad("prompt", f"{len(out)} prompts; at most {MAX_PROMPTS} in one request")
            return out
    raise bad("prompt", "required: a string, a list of strings, a list of token ids or a list of such lists")


def parse_completion(body: Mapping, request_id: str) -> Plan:
    """POST /v1/completions."""
    if not isinstance(body, Mapping):
        raise ApiError(400, "the request body must be a JSON object")
    model, stream, include_usage, user = _model_and_stream(body)
    sampling, ext = _common(body, chat=False)
    requests = []
    prompts = _prompts(body.get("prompt"))
    for i, prompt in enumerate(prompts):
        req = api.GenerateRequest(sampling=sampling, priority=ext["priority"], page_budget=ext["page_budget"],
                                  request_id=request_id if len(prompts) == 1 else f"{request_id}-{i}")
        if isinstance(prompt, str):
            req.text = prompt
        else:
            req.token_ids.ids.extend(prompt)
        requests.append(req)
    return Plan(False, model, requests, sampling.n or 1, stream, include_usage, ext["logprobs"], user)


def _content(value, i: int) -> str:
    if isinstance(value, str):
        return value
    if value is None:
        return ""
    if isinstance(value, list):
        parts = []
        for j, part in enumerate(value):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad(f"messages[{i}].content[{j}]", "only text parts ({\"type\": \"text\", \"text\": ...}) "
                          "are supported")
            parts.append(part["text"])
        return "".join(parts)
    raise bad(f"messages[{i}].content", "must be a string or a list of text parts")


def parse_chat(body: Mapping, request_id: str) -> Plan:
    """POST /v1/chat/completions: the messages go to the scheduler, which applies the chat template."""
    if not isinstance(body, Mapping):
        raise ApiError(400, "the request body must be a JSON object")
    model, stream, include_usage, user = _model_and_stream(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "required: a non-empty list of {role, content}")
    chat = api.Chat()
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}]", "must be an object with role and content")
        role = CHAT_ROLES.get(m.get("role"))
        if role is None:
            raise bad(f"messages[{i}].role", f"{m.get('role')!r}; must be one of {', '.join(CHAT_ROLES)}")
        chat.messages.append(api.ChatMessage(role=role, content=_content(m.get("content"), i)))
    agp = _bool(body, "add_generation_prompt")  # vLLM's extension; default true
    if agp is not None:
        chat.add_generation_prompt = agp
    sampling, ext = _common(body, chat=True)
    req = api.GenerateRequest(chat=chat, sampling=sampling, request_id=request_id, priority=ext["priority"],
                              page_budget=ext["page_budget"])
    return Plan(True, model, [req], sampling.n or 1, stream, include_usage, ext["logprobs"], user)


# ---- sizes -----------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class RequestLimits:
    """What the scheduler takes in one request, checked here before anything is sent (it checks again): prompt
    text, or a chat's contents together, of at most ``prompt_bytes`` bytes of UTF-8; fewer than ``max_model_len``
    token ids; and ``body_bytes``, the longest request body the gateway reads."""

    max_model_len: int
    prompt_bytes: int
    body_bytes: int

    @classmethod
    def of(cls, max_model_len: int, prompt_bytes: int = 0, body_bytes: int = 0) -> RequestLimits:
        """0: the scheduler's own defaults for this max_model_len (its --max-prompt-bytes, and its request limit:
        that text or a full context of token ids, plus 64 KiB), so that no body is read only to be refused."""
        prompt_bytes = prompt_bytes or default_max_prompt_bytes(max_model_len)
        return cls(max_model_len, prompt_bytes, body_bytes or max_message_bytes(prompt_bytes, max_model_len))

    def describe(self) -> str:
        return (f"a prompt of at most {self.prompt_bytes} bytes of UTF-8 text or {self.max_model_len - 1} token "
                "ids")


def check_sizes(plan: Plan, limits: RequestLimits) -> None:
    """Refuses (400, naming prompt or messages and the limit) a prompt the scheduler would refuse for its size."""
    for i, req in enumerate(plan.requests):
        name = "prompt" if len(plan.requests) == 1 else f"prompt[{i}]"
        kind = req.WhichOneof("prompt")
        if kind == "text":
            try:
                check_text_bytes(req.text, name, limits.prompt_bytes)
            except InvalidRequest as err:
                raise ApiError(400, str(err), param="prompt", code="prompt_too_long") from None
        elif kind == "token_ids" and len(req.token_ids.ids) >= limits.max_model_len:
            raise ApiError(400, f"{name}: {len(req.token_ids.ids)} token ids; must be fewer than max_model_len="
                           f"{limits.max_model_len} (at least one token must be generated)", param="prompt",
                           code="prompt_too_long")
        elif kind == "chat":
            contents = [m.content for m in req.chat.messages]
            size, more = sum(map(len, contents)), "at least "  # a character is 1 to 4 bytes
            if size <= limits.prompt_bytes < size * 4:
                size, more = sum(len(c.encode("utf-8", "surrogatepass")) for c in contents), ""
            if size > limits.prompt_bytes:
                raise ApiError(400, f"messages: contents of {more}{size} bytes of UTF-8; at most "
                               f"{limits.prompt_bytes} in all (--max-prompt-bytes; send fewer or shorter messages)",
                               param="messages", code="prompt_too_long")


# ---- responses -----------------------------------------------------------------------------------
@dataclass(slots=True)
class Choice:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    def add(self, msg: api.GenerateResponse) -> None:
        self.text += msg.text
        self.token_ids.extend(msg.token_ids)
        self.logprobs.extend(msg.logprobs)
        if msg.finish_reason:
            self.finish_reason = FINISH.get(msg.finish_reason, "stop")
            u = msg.usage
            self.prompt_tokens, self.completion_tokens, self.cached_tokens = (
                u.prompt_tokens, u.completion_tokens, u.cached_tokens)


def token_name(token_id: int, token_text: Callable[[int], str] | None = None) -> str:
    """How a token is named in logprobs: its text with a tokenizer (--tokenizer), else ``token_id:N`` (vLLM's
    return_tokens_as_token_ids)."""
    return token_text(token_id) if token_text else f"token_id:{token_id}"


def logprobs_body(chat: bool, token_ids, logprobs, token_text: Callable[[int], str] | None = None) -> dict:
    names = [token_name(t, token_text) for t in token_ids]
    if chat:
        return {"content": [{"token": name, "logprob": lp, "bytes": list(name.encode()) if token_text else None,
                             "top_logprobs": []} for name, lp in zip(names, logprobs)], "refusal": None}
    return {"tokens": names, "token_logprobs": list(logprobs), "top_logprobs": None, "text_offset": None}


def usage_body(choices: list[Choice], num_prompts: int, n: int) -> dict:
    """Prompt tokens once per prompt (forks share the prompt), completion tokens of every fork."""
    prompt = sum(choices[p * n].prompt_tokens for p in range(num_prompts))
    cached = sum(choices[p * n].cached_tokens for p in range(num_prompts))
    completion = sum(c.completion_tokens for c in choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def response_body(plan: Plan, rid: str, created: int, model: str, choices: list[Choice]) -> dict:
    """The non-streamed answer."""
    out = []
    for i, c in enumerate(choices):
        lp = logprobs_body(plan.chat, c.token_ids, c.logprobs, plan.token_text) if plan.logprobs else None
        if plan.chat:
            out.append({"index": i, "message": {"role": "assistant", "content": c.text, "refusal": None,
                                                 "tool_calls": []},
                        "logprobs": lp, "finish_reason": c.finish_reason})
        else:
            out.append({"index": i, "text": c.text, "logprobs": lp, "finish_reason": c.finish_reason})
    return {"id": rid, "object": "chat.completion" if plan.chat else "text_completion", "created": created,
            "model": model, "choices": out, "usage": usage_body(choices, len(plan.requests), plan.n),
            "system_fingerprint": None}


def chunk_body(plan: Plan, rid: str, created: int, model: str, index: int, text: str | None,
               token_ids=(), logprobs=(), finish_reason: str | None = None, role: bool = False) -> dict:
    """One SSE chunk for one choice."""
    lp = logprobs_body(plan.chat, token_ids, logprobs, plan.token_text) if plan.logprobs and token_ids else None
    if plan.chat:
        delta: dict = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
        choice = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish_reason}
    else:
        choice = {"index": index, "text": text or "", "logprobs": lp, "finish_reason": finish_reason}
    body = {"id": rid, "object": "chat.completion.chunk" if plan.chat else "text_completion", "created": created,
            "model": model, "choices": [choice], "system_fingerprint": None}
    if plan.include_usage:
        body["usage"] = None
    return body


def usage_chunk(plan: Plan, rid: str, created: int, model: str, choices: list[Choice]) -> dict:
    return {"id": rid, "object": "chat.completion.chunk" if plan.chat else "text_completion", "created": created,
            "model": model, "choices": [], "usage": usage_body(choices, len(plan.requests), plan.n),
            "system_fingerprint": None}


def now() -> int:
    return int(time.time())
