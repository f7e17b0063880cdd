"""pagedkv.api.v1 -> OpenAI answers, as pure functions: GenerateResponse messages become a ``Choice`` each, and
those the non-streamed body, the SSE chunks and the usage."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pagedkv.api.v1 import api_pb2 as api
from pagedkv.gateway.openai_requests import Plan

FINISH = {api.FINISH_REASON_STOP: "stop", api.FINISH_REASON_LENGTH: "length", api.FINISH_REASON_ABORT: "abort"}


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
