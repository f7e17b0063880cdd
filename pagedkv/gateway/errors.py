"""The gateway's errors in OpenAI's form: ``ApiError`` (an OpenAI error body with its HTTP status), and the
scheduler's gRPC refusals mapped to them (``from_grpc``; a prompt too long for the context in the words OpenAI
uses, which litellm and LangChain recognise: ``context_length_exceeded``), the fields they name in the OpenAI
request's names (grpc_fields.py), never the scheduler's."""

from __future__ import annotations

import re

import grpc

from pagedkv.gateway import grpc_fields
from pagedkv.grpc_common import QUEUE_FULL_PREFIX


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


def context_length_exceeded(max_len: int, prompt: int, completion: int | None, chat: bool, detail: str) -> ApiError:
    """OpenAI's refusal of a request longer than the context (code context_length_exceeded): ``completion`` None
    when the prompt alone is too long. ``detail``: the scheduler's words, which name what sets the limit (a
    tenant's pages may hold fewer tokens than max_model_len)."""
    field = "messages" if chat else "prompt"
    if completion is None:
        asked = f"your {field} resulted in {prompt} tokens. Please reduce the length of the {field}."
    else:
        asked = (f"you requested {prompt + completion} tokens ({prompt} in the {field}, {completion} in the "
                 f"completion). Please reduce the length of the {field} or completion.")
    return ApiError(400, f"This model's maximum context length is {max_len} tokens. However, {asked} ({detail})",
                    param=field, code="context_length_exceeded")


# The scheduler's refusals for length (its validation's check_prompt_ids, check_sampling), mapped
_PROMPT_TOO_LONG = re.compile(r"^prompt: (\d+) tokens; must be shorter than .*=(\d+) \(at least one token")
_OUTPUT_TOO_LONG = re.compile(r"^sampling\.max_tokens: prompt \((\d+)\) \+ max_tokens \((\d+)\) = \d+ "
                              r"exceeds .*=(\d+)$")


def _context_length(details: str, chat: bool) -> ApiError | None:
    said = grpc_fields.openai_text(details, chat)
    if m := _PROMPT_TOO_LONG.match(details):
        return context_length_exceeded(int(m.group(2)), int(m.group(1)), None, chat, said)
    if m := _OUTPUT_TOO_LONG.match(details):
        return context_length_exceeded(int(m.group(3)), int(m.group(1)), int(m.group(2)), chat, said)
    return None


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
# The scheduler's top-level fields outside grpc_fields.PATHS (its own names are OpenAI's) -> OpenAI's
_PROTO_PARAMS = {"request_id": "x-request-id", "token_ids": "prompt"}  # (Detokenize's: app.py names it tokens)
_FIELD = re.compile(r"^([A-Za-z_][\w.\[\]]*):")


def param_of(details: str, chat: bool) -> str | None:
    m = _FIELD.match(details or "")
    if not m:
        return None
    head = m.group(1).split("[")[0].split(".")[0]
    if grpc_fields.PATH.match(details):
        return grpc_fields.param(details, chat)
    return _PROTO_PARAMS.get(head, head)


def prompt_too_long(details: str, chat: bool) -> ApiError:
    """A prompt, or a chat, refused for its size before it is sent (the scheduler's own checks: pagedkv.bounds'
    check_text_bytes, check_chat_size) in OpenAI's terms: 400, code prompt_too_long, ``param`` the field the
    refusal names: tools where the tools drive it (too many, or their text took the chat over), else messages
    (a chat) or prompt."""
    return ApiError(400, grpc_fields.openai_text(details, chat),
                    param=param_of(details, chat) or ("messages" if chat else "prompt"), code="prompt_too_long")


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
        return ApiError(400, grpc_fields.openai_text(details, chat) or code.name, param=param_of(details, chat),
                        code="resource_exhausted")
    if code == grpc.StatusCode.INVALID_ARGUMENT and (err := _context_length(details or "", chat)):
        return err
    status, err_code = GRPC_STATUS.get(code, (500, None))
    if code == grpc.StatusCode.NOT_FOUND and (details or "").startswith("adapter:"):  # (an adapter not the caller's)
        return ApiError(404, grpc_fields.openai_text(details, chat), param="model", code="model_not_found")
    param = param_of(details, chat) if status == 400 else None
    return ApiError(status, grpc_fields.openai_text(details, chat) or code.name, param=param,
                    code=err_code or code.name.lower())
