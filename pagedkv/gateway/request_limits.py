"""What the scheduler takes in one request (``RequestLimits``: its prompt bytes, max_model_len, the longest body the
gateway reads), and a translated request (openai_requests.py's ``Plan``) checked against it before anything is sent
(``check_sizes``): the scheduler checks again, with the same rules (pagedkv/bounds.py), so a refusal here reads as
its own."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagedkv.bounds import (
    InvalidRequest,
    check_chat_size,
    check_text_bytes,
    default_max_prompt_bytes,
    max_message_bytes,
)
from pagedkv.gateway.errors import bad, context_length_exceeded, prompt_too_long

if TYPE_CHECKING:
    from pagedkv.gateway.openai_requests import Plan


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """What the scheduler takes in one request, checked here before anything is sent (it checks again): prompt
    text, or a chat's contents together, of at most ``prompt_bytes`` bytes of UTF-8; fewer than ``max_model_len``
    token ids; and ``body_bytes``, the longest request body the gateway reads."""

    max_model_len: int
    prompt_bytes: int
    body_bytes: int
    max_logprobs: int = 0  # top and prompt log-probabilities at most (the scheduler's; 0: not known)

    @classmethod
    def of(cls, max_model_len: int, prompt_bytes: int = 0, body_bytes: int = 0,
           max_logprobs: int = 0) -> RequestLimits:
        """0: the scheduler's own defaults for this max_model_len (its --max-prompt-bytes, and its request limit:
        that text or a full context of token ids, plus 64 KiB), so that no body is read only to be refused."""
        prompt_bytes = prompt_bytes or default_max_prompt_bytes(max_model_len)
        return cls(max_model_len, prompt_bytes, body_bytes or max_message_bytes(prompt_bytes, max_model_len),
                   max_logprobs)

    def describe(self) -> str:
        return (f"a prompt of at most {self.prompt_bytes} bytes of UTF-8 text or {self.max_model_len - 1} token "
                "ids")


def check_sizes(plan: Plan, limits: RequestLimits) -> None:
    """Refuses (400, naming prompt or messages and the limit) a prompt the scheduler would refuse for its size."""
    for i, req in enumerate(plan.requests):
        name = "prompt" if len(plan.requests) == 1 else f"prompt[{i}]"
        kind = req.WhichOneof("prompt")
        keep = req.truncate_prompt_tokens
        if keep > limits.max_model_len:
            raise bad("truncate_prompt_tokens", f"{keep}; must be in [1, max_model_len={limits.max_model_len}] (the "
                      "prompt tokens kept: the last ones)")
        if kind == "text":
            try:
                check_text_bytes(req.text, name, limits.prompt_bytes)
            except InvalidRequest as err:
                raise prompt_too_long(str(err), chat=False) from None
        elif kind == "token_ids" and (count := min(len(req.token_ids.ids), keep or 2**31)) >= limits.max_model_len:
            kept = f" (truncate_prompt_tokens={keep})" if keep else ""
            raise context_length_exceeded(limits.max_model_len, count, None, chat=False,
                                          detail=f"{name}: {count} token ids{kept}; must be fewer than "
                                          f"max_model_len={limits.max_model_len} (at least one token must be "
                                          "generated)")
        elif kind == "chat":
            try:  # (the scheduler's own check: contents, names, ids and tool calls together)
                check_chat_size(req.chat, "messages", limits.prompt_bytes)
            except InvalidRequest as err:
                raise prompt_too_long(str(err), chat=True) from None
