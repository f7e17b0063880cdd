"""OpenAI requests -> pagedkv.api.v1, as pure functions: a request body becomes GenerateRequests (a ``Plan``, or
an ApiError naming the field); request_limits.py checks their prompts against the scheduler's size limits. The
answers go back through openai_responses.py; app.py serves both.

Translation (OpenAI field -> GenerateRequest):
  prompt (str | [str, ...] | [int, ...] | [[int, ...], ...]) -> text / token_ids, one request per prompt
  messages -> chat (chat_requests.py; the scheduler renders the chat template), with add_generation_prompt,
  continue_final_message, chat_template and chat_template_kwargs; tools, tool_choice, parallel_tool_calls -> chat
  (the answer's tool calls read by pagedkv.tool_calls, in the format the scheduler names)
  max_tokens | max_completion_tokens -> sampling.max_tokens (completions default 16, as OpenAI; chat: none)
  temperature, top_p, top_k, seed, stop, n -> sampling.*; temperature, top_p, top_k, repetition_penalty and min_p
  unset -> the model's defaults (generation_config.json, else OpenAI's and vLLM's: temperature 1)
  logprobs (completions: N; chat: true, with top_logprobs N) -> sampling.logprobs and top_logprobs; echo
  (completions) -> sampling.echo (with logprobs, prompt_logprobs N too); prompt_logprobs -> sampling.prompt_logprobs
  extensions (extra body fields): page_budget, priority, ignore_eos, stop_token_ids, include_stop_str_in_output
  response_format, structured_outputs, guided_json/regex/choice/grammar -> sampling.constraint (structured.py)
Every other field is refused, ignored by design or unknown, as fields.py's table says (``fields.screen``).
The client's request id (X-Request-Id, else the body's request_id: ``client_request_id``) is the upstream one.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from pagedkv.api.v1 import api_pb2 as api
from pagedkv.bounds import MAX_FORKS, MAX_LOGIT_BIAS, MAX_LOGIT_BIAS_ENTRIES, MAX_PENALTY
from pagedkv.gateway import fields
from pagedkv.gateway.chat_requests import chat_of
from pagedkv.gateway.errors import ApiError, bad
from pagedkv.gateway.structured import constraint_of

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_PROMPTS = 32  # prompts in one /v1/completions request (each is a Generate call)
MAX_USER_CHARS = 256
MAX_CLIENT_ID_CHARS = 200  # X-Request-Id or request_id: the scheduler takes 256, and "-31" may be appended
_CLIENT_ID = re.compile(rf"[\x21-\x7e]{{1,{MAX_CLIENT_ID_CHARS}}}")  # printable ASCII, no space: safe to echo


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


def client_request_id(header: str | None, body: Mapping) -> str:
    """The client's id for this request: its X-Request-Id header (vLLM's rule: the header wins), else the body's
    request_id (vLLM's extension), else '' (the gateway makes one). A header that is not 1 to MAX_CLIENT_ID_CHARS
    printable ASCII characters is not used (a proxy may set it: the request goes on); such a request_id is refused."""
    if header is not None and _CLIENT_ID.fullmatch(header):
        return header
    value = body.get("request_id") if isinstance(body, Mapping) else None
    if value is None:
        return ""
    if not isinstance(value, str) or not _CLIENT_ID.fullmatch(value):
        raise bad("request_id", f"must be 1 to {MAX_CLIENT_ID_CHARS} printable ASCII characters without spaces")
    return value


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
    screened: fields.Screened | None = None  # the fields ignored by design, and the unknown ones
    client_id: str = ""  # the client's X-Request-Id or request_id (echoed in X-Request-Id)
    token_text: Callable[[int], str] | None = None  # names tokens in logprobs (the gateway's --tokenizer)
    top_logprobs: int = 0  # most likely tokens shown per position (completions' logprobs, chat's top_logprobs)
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs (None: not asked)
    echo: bool = False  # completions: the prompt before each choice's text
    continuous_usage: bool = False  # stream_options.continuous_usage_stats (with include_usage): usage in each chunk
    tokens_as_ids: bool = False  # return_tokens_as_token_ids: logprobs name tokens token_id:N
    tool_function: str = ""  # tool_choice's named function (its calls' name in the named format)
    parallel_tool_calls: bool = True  # false: one tool call at most

    @property
    def names_tokens(self) -> bool:
        """The answer names tokens by their text (logprobs, prompt_logprobs): it needs the gateway's tokenizer."""
        return (self.logprobs or self.prompt_logprobs is not None) and not self.tokens_as_ids

    @property
    def num_choices(self) -> int:
        return len(self.requests) * self.n


def _common(body: Mapping, chat: bool) -> tuple[api.SamplingParams, dict]:
    """Sampling and the request-level extensions shared by both endpoints (what is not implemented: refused by
    fields.screen)."""
    max_tokens = _int(body, "max_completion_tokens", 1, 2**31 - 1) if chat else None
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", 1, 2**31 - 1)
    if max_tokens is None and not chat:
        max_tokens = DEFAULT_COMPLETION_MAX_TOKENS
    # (n: the scheduler's own limit, MAX_FORKS, one constant for both)
    sampling = api.SamplingParams(max_tokens=max_tokens or 0, n=_int(body, "n", 1, MAX_FORKS) or 1)
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
    _logits_controls(body, sampling)
    constraint = constraint_of(body)  # (structured outputs: response_format, structured_outputs, guided_*)
    if constraint is not None:
        sampling.constraint.CopyFrom(constraint)
    if max_tokens and sampling.min_tokens > max_tokens:
        raise bad("min_tokens", f"{sampling.min_tokens}; must be at most max_tokens ({max_tokens})")
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
    ext = {"priority": _int(body, "priority", -(2**31), 2**31 - 1) or 0,
           "truncate_prompt_tokens": _int(body, "truncate_prompt_tokens", 1, 2**31 - 1) or 0,
           "page_budget": _int(body, "page_budget", 0, 2**31 - 1) or 0, **_logprobs(body, chat, sampling)}
    return sampling, ext


def _logprobs(body: Mapping, chat: bool, sampling: api.SamplingParams) -> dict:
    """logprobs, top_logprobs, prompt_logprobs and echo into ``sampling`` (vLLM's rules: chat's top_logprobs needs
    logprobs; no prompt_logprobs > 0 when streaming; echo with logprobs N asks for the prompt's, N of them); the
    limits (the scheduler's max_logprobs) are logprobs.check_limits'."""
    if chat:
        logprobs, top = bool(_bool(body, "logprobs")), _int(body, "top_logprobs", 0, 2**31 - 1) or 0
        if top and not logprobs:
            raise bad("top_logprobs", f"{top} needs logprobs: true (the most likely tokens go with the sampled "
                      "ones' log-probabilities)")
    else:
        n = _int(body, "logprobs", 0, 2**31 - 1)  # (N: the N most likely tokens, and the sampled one)
        logprobs, top = n is not None, n or 0
    prompt = _int(body, "prompt_logprobs", 0, 2**31 - 1)
    stream, echo = bool(body.get("stream")), not chat and bool(_bool(body, "echo"))
    if prompt and stream:
        raise bad("prompt_logprobs", f"{prompt}; not available with stream: true (as in vLLM; echo with logprobs "
                  "streams the prompt's log-probabilities)")
    sampling.logprobs, sampling.top_logprobs, sampling.echo = logprobs, top, echo
    if echo and logprobs:
        sampling.prompt_logprobs = max(top, prompt or 0)
    elif prompt is not None and not stream:
        sampling.prompt_logprobs = prompt
    return {"logprobs": logprobs, "top_logprobs": top, "echo": echo, "prompt_logprobs": None if stream else prompt,
            "tokens_as_ids": bool(_bool(body, "return_tokens_as_token_ids"))}


def _logits_controls(body: Mapping, sampling: api.SamplingParams) -> None:
    """presence_penalty, frequency_penalty, repetition_penalty, min_p, min_tokens, allowed_token_ids, bad_words and
    logit_bias (OpenAI's and vLLM's) into ``sampling``; the scheduler checks the ids against the vocabulary and
    tokenizes the bad words."""
    for name in ("presence_penalty", "frequency_penalty"):
        value = _float(body, name, -MAX_PENALTY, MAX_PENALTY)
        if value is not None:
            setattr(sampling, name, value)
    repetition = _float(body, "repetition_penalty", 0.0, math.inf)
    if repetition is not None:
        if repetition <= 0:
            raise bad("repetition_penalty", f"{repetition}; must be > 0 (1: no penalty)")
        sampling.repetition_penalty = repetition  # (set, even at 1: it wins over the model's default)
    min_p = _float(body, "min_p", 0.0, 1.0)
    if min_p is not None:
        sampling.min_p = min_p
    sampling.min_tokens = _int(body, "min_tokens", 0, 2**31 - 1) or 0
    allowed = body.get("allowed_token_ids")
    if allowed is not None:
        if _ids(allowed, "allowed_token_ids") is None:
            raise bad("allowed_token_ids", "must be a non-empty list of token ids")
        sampling.allowed_token_ids.extend(allowed)
    sampling.bad_words.extend(_strings(body, "bad_words"))
    bias = body.get("logit_bias")
    if bias is None:
        return
    if not isinstance(bias, Mapping):
        raise bad("logit_bias", "must be an object mapping token ids (as strings) to numbers")
    if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise bad("logit_bias", f"{len(bias)} entries; at most {MAX_LOGIT_BIAS_ENTRIES}")
    for key, value in bias.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and int(key) < 2**31):
            raise bad("logit_bias", f"key {str(key)[:32]!r} is not a token id")
        if (isinstance(value, bool) or not isinstance(value, int | float)
                or not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS):
            raise bad("logit_bias", f"{value!r} for token {key}; each value must be a number in "
                      f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")
        sampling.logit_bias[int(key)] = float(value)


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
    continuous = opts.get("continuous_usage_stats") if opts else None  # (vLLM's: with include_usage only)
    if continuous is not None and not isinstance(continuous, bool):
        raise bad("stream_options.continuous_usage_stats", f"{continuous!r} is not a boolean")
    user = body.get("user") or ""
    if not isinstance(user, str) or len(user) > MAX_USER_CHARS:
        raise bad("user", f"must be a string of at most {MAX_USER_CHARS} characters")
    return model, stream, (include_usage, include_usage and bool(continuous)), user


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
    screened = fields.screen(body, chat=False)
    model, stream, (include_usage, continuous), user = _model_and_stream(body)
    sampling, ext = _common(body, chat=False)
    requests = []
    prompts = _prompts(body.get("prompt"))
    for i, prompt in enumerate(prompts):
        req = api.GenerateRequest(sampling=sampling, priority=ext["priority"], page_budget=ext["page_budget"],
                                  truncate_prompt_tokens=ext["truncate_prompt_tokens"],
                                  request_id=request_id if len(prompts) == 1 else f"{request_id}-{i}")
        if isinstance(prompt, str):
            req.text = prompt
        else:
            req.token_ids.ids.extend(prompt)
        requests.append(req)
    return Plan(False, model, requests, sampling.n or 1, stream, include_usage, ext["logprobs"], user, screened,
                top_logprobs=ext["top_logprobs"], prompt_logprobs=ext["prompt_logprobs"], echo=ext["echo"],
                continuous_usage=continuous, tokens_as_ids=ext["tokens_as_ids"])


def parse_chat(body: Mapping, request_id: str) -> Plan:
    """POST /v1/chat/completions: the messages go to the scheduler, which applies the chat template."""
    if not isinstance(body, Mapping):
        raise ApiError(400, "the request body must be a JSON object")
    screened = fields.screen(body, chat=True)
    model, stream, (include_usage, continuous), user = _model_and_stream(body)
    chat = chat_of(body)
    sampling, ext = _common(body, chat=True)
    forced = chat.tool_choice.function or chat.tool_choice.mode == "required"
    if chat.tools and forced and sampling.HasField("constraint"):
        raise bad("tool_choice", f"{body['tool_choice'] if chat.tool_choice.mode else 'a named function'}: the "
                  "tool calls are the output's constraint; response_format (or structured_outputs, guided_*) cannot "
                  "be set beside it")
    req = api.GenerateRequest(chat=chat, sampling=sampling, request_id=request_id, priority=ext["priority"],
                              page_budget=ext["page_budget"], truncate_prompt_tokens=ext["truncate_prompt_tokens"])
    return Plan(True, model, [req], sampling.n or 1, stream, include_usage, ext["logprobs"], user, screened,
                top_logprobs=ext["top_logprobs"], prompt_logprobs=ext["prompt_logprobs"],
                continuous_usage=continuous, tokens_as_ids=ext["tokens_as_ids"],
                tool_function=chat.tool_choice.function,
                parallel_tool_calls=chat.parallel_tool_calls if chat.HasField("parallel_tool_calls") else True)
