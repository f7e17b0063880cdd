"""vLLM's /tokenize and /detokenize, as pure functions: a body -> the scheduler's Tokenize or Detokenize request
(``tokenize_request``, ``detokenize_request``), and its answer -> vLLM's body (``tokenize_body``).

  POST /tokenize    {"model"?, "prompt", "add_special_tokens"?, "return_token_strs"?}
                    or {"model"?, "messages", "add_generation_prompt"?, "continue_final_message"?, "chat_template"?,
                        "chat_template_kwargs"?, "tools"?, "return_token_strs"?}
                    -> {"count", "max_model_len", "tokens", "token_strs"}
  POST /detokenize  {"model"?, "tokens": [ids]} -> {"prompt"}

``model`` may be left out (vLLM's); when given it must be one /v1/models lists. The ids are the ones Generate runs
(the scheduler's one BOS rule: a text gets BOS unless add_special_tokens is false, a chat's template writes its own).
Everything is bounded before it is sent: the body (guards.read_json), a prompt's bytes and a conversation's texts
(the scheduler's --max-prompt-bytes), at most max_model_len ids to detokenize."""

from __future__ import annotations

from collections.abc import Mapping

from pagedkv.api.v1 import api_pb2 as api
from pagedkv.bounds import InvalidRequest, check_chat_size, check_text_bytes
from pagedkv.gateway.chat_requests import chat_of
from pagedkv.gateway.errors import ApiError, bad, prompt_too_long
from pagedkv.gateway.request_limits import RequestLimits

TOKENIZE_FIELDS = {"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt",
                   "continue_final_message", "chat_template", "chat_template_kwargs", "return_token_strs", "tools"}
DETOKENIZE_FIELDS = {"model", "tokens"}


def _object(body) -> Mapping:
    if not isinstance(body, Mapping):
        raise ApiError(400, "the request body must be a JSON object")
    return body


def _model(body: Mapping) -> str | None:
    model = body.get("model")
    if model is not None and (not isinstance(model, str) or not model):
        raise bad("model", "must be the model's name (GET /v1/models lists it), or left out")
    return model


def _flag(body: Mapping, name: str) -> bool | None:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise bad(name, f"{value!r} is not a boolean")
    return value


def unknown_fields(body: Mapping, known: set[str]) -> list[str]:
    return [name for name in body if name not in known]


def tokenize_request(body, limits: RequestLimits) -> tuple[str | None, api.TokenizeRequest, bool]:
    """(model or None, the Tokenize request, whether token strings are wanted)."""
    body = _object(body)
    model = _model(body)
    strs = bool(_flag(body, "return_token_strs"))
    special = _flag(body, "add_special_tokens")
    if body.get("tools") is not None and "messages" not in body:
        raise bad("tools", "only with messages (the chat template renders them); a prompt is tokenized as it is")
    if "messages" in body:
        if "prompt" in body:
            raise bad("prompt", "send prompt or messages, not both")
        if special:
            raise bad("add_special_tokens", "True is not supported for messages (the chat template places the "
                      "special tokens); send false or leave it out")
        req = api.TokenizeRequest(chat=chat_of(body))
        try:
            check_chat_size(req.chat, "messages", limits.prompt_bytes)
        except InvalidRequest as err:
            raise prompt_too_long(str(err), chat=True) from None
        return model, req, strs
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise bad("prompt", "required: a string (or send messages)")
    try:
        check_text_bytes(prompt, "prompt", limits.prompt_bytes)
    except InvalidRequest as err:
        raise prompt_too_long(str(err), chat=False) from None
    req = api.TokenizeRequest(text=prompt)
    if special is not None:
        req.add_special_tokens = special
    return model, req, strs


def tokenize_body(r: api.TokenizeResponse, max_model_len: int, strs: bool) -> dict:
    return {"count": len(r.token_ids), "max_model_len": max_model_len, "tokens": list(r.token_ids),
            "token_strs": list(r.tokens) if strs else None}


def detokenize_request(body, limits: RequestLimits) -> tuple[str | None, api.DetokenizeRequest]:
    body = _object(body)
    model = _model(body)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise bad("tokens", "required: a list of token ids")
    if len(tokens) > limits.max_model_len:
        raise bad("tokens", f"{len(tokens)} ids; at most max_model_len={limits.max_model_len}")
    if any(not 0 <= t < 2**31 for t in tokens):
        raise bad("tokens", "token ids must be in [0, 2^31)")
    return model, api.DetokenizeRequest(token_ids=tokens)
