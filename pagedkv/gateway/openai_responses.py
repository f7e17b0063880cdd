"""pagedkv.api.v1 -> OpenAI answers, as pure functions: GenerateResponse messages become a ``Choice`` each, and
those the non-streamed body, the SSE chunks and the usage; what the scheduler says of each prompt (api.Prompt: its
size, and with echo or prompt_logprobs its ids, text and log-probabilities) comes in ``prompts``, one per prompt
(shared by its n choices). Log-probabilities take their shapes in logprobs.py."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from pagedkv import tool_calls
from pagedkv.api.v1 import api_pb2 as api
from pagedkv.gateway import logprobs as lp
from pagedkv.gateway.json_pieces import Lazy
from pagedkv.gateway.openai_requests import Plan

FINISH = {api.FINISH_REASON_STOP: "stop", api.FINISH_REASON_LENGTH: "length", api.FINISH_REASON_ABORT: "abort"}


@dataclass(slots=True)
class Choice:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[api.TopLogprobs] = field(default_factory=list)  # per token, with top_logprobs > 0
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    streamed_chars: int = 0  # characters of text streamed so far (the next chunk's text_offset)
    echoed: bool = False  # its prompt went out (streaming with echo)
    tools: tool_calls.ToolCallStream | None = None  # its text read into tool calls as it streams (a tool format)

    def add(self, msg: api.GenerateResponse) -> None:
        self.text += msg.text
        self.token_ids.extend(msg.token_ids)
        self.logprobs.extend(msg.logprobs)
        self.top_logprobs.extend(msg.top_logprobs)
        if msg.finish_reason:
            self.finish_reason = FINISH.get(msg.finish_reason, "stop")
            u = msg.usage
            self.prompt_tokens, self.completion_tokens, self.cached_tokens = (
                u.prompt_tokens, u.completion_tokens, u.cached_tokens)


def logprobs_body(plan: Plan, token_ids: Sequence[int], logprobs: Sequence[float],
                  tops: Sequence[api.TopLogprobs] = (), echo: api.Prompt | None = None, offset: int = 0) -> dict | None:
    """A choice's (or a chunk's) logprobs, None unless asked; ``echo``: the prompt, whose tokens come first
    (completions); ``offset``: the text_offset of the first token."""
    if not plan.logprobs:
        return None
    every: list[api.TopLogprobs | None] = list(tops) if tops else [None] * len(token_ids)
    if plan.chat:
        return lp.chat_logprobs(token_ids, logprobs, every, plan.top_logprobs, plan.token_text)
    ids: list[int] = list(token_ids)
    lps: list[float | None] = list(logprobs)
    if echo is not None:
        prompt_ids, prompt_lps, prompt_tops = lp.echoed(echo)
        ids, lps, every = prompt_ids + ids, prompt_lps + lps, prompt_tops + every
    return lp.completion_logprobs(ids, lps, every, plan.top_logprobs, plan.token_text, offset)


def usage_body(choices: list[Choice], num_prompts: int, n: int) -> dict:
    """Prompt tokens once per prompt (forks share the prompt), completion tokens of every fork."""
    prompt = sum(choices[p * n].prompt_tokens for p in range(num_prompts))
    cached = sum(choices[p * n].cached_tokens for p in range(num_prompts))
    completion = sum(c.completion_tokens for c in choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def choice_usage(prompt: api.Prompt, choice: Choice) -> dict:
    """stream_options.continuous_usage_stats: a chunk's usage, its choice's tokens so far (vLLM's)."""
    return {"prompt_tokens": prompt.num_tokens, "completion_tokens": len(choice.token_ids),
            "total_tokens": prompt.num_tokens + len(choice.token_ids)}


def tool_finish(finish_reason: str | None, called: bool) -> str | None:
    """A choice that called tools and stopped by itself finishes with "tool_calls" (OpenAI's); cut short, with
    "length"."""
    return "tool_calls" if called and finish_reason == "stop" else finish_reason


def chat_message(plan: Plan, c: Choice, fmt: str) -> tuple[dict, str | None]:
    """A non-streamed chat choice's message and finish reason: its text, or read into tool calls (``fmt``: the
    scheduler's tool_call_format) with what is not a call as content (null when there is none)."""
    if not fmt:
        return {"role": "assistant", "content": c.text, "refusal": None, "tool_calls": []}, c.finish_reason
    out = tool_calls.extract(fmt, c.text, True, plan.tool_function, plan.parallel_tool_calls)
    message = {"role": "assistant", "content": out.content or (None if out.calls else ""), "refusal": None,
               "tool_calls": tool_calls.message_calls(out.calls)}
    return message, tool_finish(c.finish_reason, bool(out.calls))


def response_body(plan: Plan, rid: str, created: int, model: str, choices: list[Choice],
                  prompts: Sequence[api.Prompt] = (), lazy: bool = False) -> dict:
    """The non-streamed answer (``prompts``: one per prompt, for echo and prompt_logprobs); ``lazy``: its choices
    made one at a time as they are written (json_pieces.Lazy)."""

    def choice(i: int) -> dict:
        c = choices[i]
        prompt = prompts[i // plan.n] if prompts else api.Prompt()
        echo = prompt if plan.echo else None
        logprobs = logprobs_body(plan, c.token_ids, c.logprobs, c.top_logprobs, echo)
        if plan.chat:
            message, finish = chat_message(plan, c, prompt.tool_call_format)
            return {"index": i, "message": message, "logprobs": logprobs, "finish_reason": finish}
        out = {"index": i, "text": (prompt.text if echo else "") + c.text, "logprobs": logprobs,
               "finish_reason": c.finish_reason}
        if plan.prompt_logprobs is not None:  # (vLLM's: per choice in completions)
            out["prompt_logprobs"] = lp.prompt_logprobs_body(prompt, plan.prompt_logprobs, plan.token_text)
        return out

    out = Lazy(len(choices), choice) if lazy else [choice(i) for i in range(len(choices))]
    body = {"id": rid, "object": "chat.completion" if plan.chat else "text_completion", "created": created,
            "model": model, "choices": out, "usage": usage_body(choices, len(plan.requests), plan.n),
            "system_fingerprint": None}
    if plan.chat and plan.prompt_logprobs is not None:  # (vLLM's: once, beside the choices in chat)
        body["prompt_logprobs"] = lp.prompt_logprobs_body(prompts[0] if prompts else api.Prompt(),
                                                          plan.prompt_logprobs, plan.token_text)
    return body


def chunk_body(plan: Plan, rid: str, created: int, model: str, index: int, text: str | None,
               token_ids=(), logprobs=(), finish_reason: str | None = None, role: bool = False,
               tops: Sequence[api.TopLogprobs] = (), echo: api.Prompt | None = None, offset: int = 0,
               usage: dict | None = None, tool_call_deltas: list[dict] | None = None) -> dict:
    """One SSE chunk for one choice; ``echo``: the prompt, on the choice's first chunk (completions: its text before
    ``text``, its tokens before ``token_ids``); ``offset``: the text streamed before (text_offset); ``usage``: with
    continuous usage stats; ``tool_call_deltas``: chat's tool_calls deltas (ToolCallStream's)."""
    shown = logprobs_body(plan, token_ids, logprobs, tops, echo, offset) if token_ids or echo is not None else None
    if plan.chat:
        delta: dict = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
        if tool_call_deltas:
            delta["tool_calls"] = tool_call_deltas
        choice = {"index": index, "delta": delta, "logprobs": shown, "finish_reason": finish_reason}
    else:
        text = (echo.text if echo is not None else "") + (text or "")
        choice = {"index": index, "text": text, "logprobs": shown, "finish_reason": finish_reason}
    body = {"id": rid, "object": "chat.completion.chunk" if plan.chat else "text_completion", "created": created,
            "model": model, "choices": [choice], "system_fingerprint": None}
    if plan.include_usage:
        body["usage"] = usage
    return body


def usage_chunk(plan: Plan, rid: str, created: int, model: str, choices: list[Choice]) -> dict:
    return {"id": rid, "object": "chat.completion.chunk" if plan.chat else "text_completion", "created": created,
            "model": model, "choices": [], "usage": usage_body(choices, len(plan.requests), plan.n),
            "system_fingerprint": None}


def now() -> int:
    return int(time.time())
