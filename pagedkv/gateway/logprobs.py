"""Log-probabilities in OpenAI's shapes, as vLLM's OpenAI server writes them, from the scheduler's (pagedkv.api.v1:
GenerateResponse.logprobs and top_logprobs per token, Prompt's for the prompt):

- completions (``completion_logprobs``): ``{tokens, token_logprobs, top_logprobs, text_offset}``; each position's
  ``top_logprobs`` is ``{token: logprob}`` of the sampled (or prompt) token and the ``logprobs=N`` most likely ones
  (N or N + 1 entries); with echo the prompt's tokens come first, the first of them with null; ``text_offset`` counts
  the characters of the token strings from where the chunk's text starts;
- chat (``chat_logprobs``): ``{content: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}``, the
  ``top_logprobs=N`` most likely tokens, most likely first (OpenAI's: vLLM puts the sampled token first there);
- ``prompt_logprobs`` (vLLM's extension, ``prompt_logprobs_body``): per prompt token, null for the first, else
  ``{token_id: {logprob, rank, decoded_token}}`` for the token itself and its N most likely alternatives.

Tokens are named by their text (``TokenNames``: the gateway's --tokenizer, ``decode([id])`` with SentencePiece's
stripped leading spaces put back, as vLLM does), else ``token_id:N``; ``bytes`` are the name's UTF-8 (a piece of a
multi-byte character reads as U+FFFD, as in vLLM). A log-probability of -inf is written -9999.0 (JSON has no inf).
"""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from pagedkv.api.v1 import api_pb2 as api
from pagedkv.gateway.errors import bad

if TYPE_CHECKING:
    from pagedkv.gateway.openai_requests import Plan

TokenText = Callable[[int], str]
FLOOR = -9999.0  # what -inf is written as (OpenAI's, vLLM's)


def check_limits(plan: Plan, max_logprobs: int) -> None:
    """Refuses (400, naming the field and the limit) more top or prompt log-probabilities than the scheduler gives
    (its ModelInfo's max_logprobs; 0: not known, the scheduler refuses them itself)."""
    top = "top_logprobs" if plan.chat else "logprobs"
    for name, value in ((top, plan.top_logprobs), ("prompt_logprobs", plan.prompt_logprobs)):
        if max_logprobs and value is not None and value > max_logprobs:
            raise bad(name, f"{value}; at most {max_logprobs} (the server's --max-logprobs)")


def token_name(token_id: int, token_text: TokenText | None = None) -> str:
    """How a token is named in logprobs: its text with a tokenizer (--tokenizer), else ``token_id:N`` (vLLM's
    return_tokens_as_token_ids)."""
    return token_text(token_id) if token_text else f"token_id:{token_id}"


def _lp(value: float) -> float:
    return max(value, FLOOR)


def completion_logprobs(token_ids: Sequence[int], logprobs: Sequence[float | None],
                        tops: Sequence[api.TopLogprobs | None], n: int, token_text: TokenText | None,
                        offset: int = 0) -> dict:
    """The legacy completions' logprobs of ``token_ids`` (None in ``logprobs``: the echoed prompt's first token, which
    has no context); ``tops[i]``: position i's most likely tokens (None or shorter: fewer), of which ``n`` are
    shown; ``offset``: the text_offset of the first token (the characters of the choice's text before it)."""
    names, top_dicts, offsets = [], [], []
    for token, lp, top in zip(token_ids, logprobs, tops):
        name = token_name(token, token_text)
        offsets.append(offset)
        offset += len(name)
        names.append(name)
        if lp is None:
            top_dicts.append(None)
            continue
        entry = {name: _lp(lp)}
        if top is not None:
            for other, value in zip(top.token_ids[:n], top.logprobs[:n]):
                entry.setdefault(token_name(other, token_text), _lp(value))
        top_dicts.append(entry)
    return {"tokens": names, "token_logprobs": [None if lp is None else _lp(lp) for lp in logprobs],
            "top_logprobs": top_dicts, "text_offset": offsets}


def _chat_entry(token: int, lp: float, token_text: TokenText | None) -> dict:
    name = token_name(token, token_text)
    return {"token": name, "logprob": _lp(lp), "bytes": list(name.encode("utf-8", "replace")) if token_text else None}


def chat_logprobs(token_ids: Sequence[int], logprobs: Sequence[float], tops: Sequence[api.TopLogprobs | None],
                  n: int, token_text: TokenText | None) -> dict:
    """The chat completions' logprobs: each token with its ``n`` most likely alternatives (top_logprobs)."""
    content = []
    for token, lp, top in zip(token_ids, logprobs, tops):
        entry = _chat_entry(token, lp, token_text)
        entry["top_logprobs"] = ([_chat_entry(t, v, token_text) for t, v in zip(top.token_ids[:n], top.logprobs[:n])]
                                 if top is not None else [])
        content.append(entry)
    return {"content": content, "refusal": None}


def prompt_logprobs_body(prompt: api.Prompt, n: int, token_text: TokenText | None) -> list:
    """vLLM's prompt_logprobs: null for the first prompt token, then per token {id: {logprob, rank, decoded_token}}
    of itself and its ``n`` most likely alternatives (ranks 1 to n)."""
    out: list = [None]
    ranks = list(prompt.ranks)
    for i, lp in enumerate(prompt.logprobs):
        token = prompt.token_ids[i + 1]
        entry = {str(token): {"logprob": _lp(lp), "rank": ranks[i] if i < len(ranks) else None,
                              "decoded_token": token_name(token, token_text)}}
        if i < len(prompt.top_logprobs):
            top = prompt.top_logprobs[i]
            for rank, (other, value) in enumerate(zip(top.token_ids[:n], top.logprobs[:n]), 1):
                entry.setdefault(str(other), {"logprob": _lp(value), "rank": rank,
                                              "decoded_token": token_name(other, token_text)})
        out.append(entry)
    return out


def echoed(prompt: api.Prompt) -> tuple[list[int], list[float | None], list[api.TopLogprobs | None]]:
    """The echoed prompt's tokens, log-probabilities (the first None) and most likely tokens, as completion_logprobs
    takes them before the choice's own."""
    tops: list[api.TopLogprobs | None] = [None, *prompt.top_logprobs]
    tops += [None] * (len(prompt.token_ids) - len(tops))
    return list(prompt.token_ids), [None, *prompt.logprobs], tops


# ---- token names ------------------------------------------------------------------------------------
SPIECE_SPACE = "\u2581"  # SentencePiece's word-start marker, which decode() turns into a space it then strips


def token_string(tokenizer, token_id: int) -> str:
    """``decode([token_id])`` (vLLM's name of a token), with the leading spaces SentencePiece's decode strips put back
    from the vocabulary's piece: '▁the' reads ' the', as the token does inside a text."""
    text = tokenizer.decode([token_id])
    piece = tokenizer.convert_ids_to_tokens(token_id)
    if isinstance(piece, str) and piece.startswith(SPIECE_SPACE):
        missing = (len(piece) - len(piece.lstrip(SPIECE_SPACE))) - (len(text) - len(text.lstrip(" ")))
        if missing > 0:
            text = " " * missing + text
    return text


def load_token_text(path: str) -> TokenText:
    """--tokenizer: a token id -> its name (cached). ``path``: a tokenizer (or model) directory, or a built-in model's
    name (resolved as the executor resolves --model: built or fetched on first use)."""
    return load_token_names(path)[0]


def load_token_names(path: str) -> tuple[TokenText, int]:
    """load_token_text's function, and the most bytes a token's name takes inside a JSON string (the longest token
    of the vocabulary, escapes counted: response_budget.py bounds answers with it)."""
    from transformers import AutoTokenizer

    from pagedkv.hub_models import is_repo_id
    from pagedkv.models import BUILTIN_MODELS, resolve_model

    hub = is_repo_id(path) and not Path(path).exists()  # ORG/NAME: the hub's cache, as the executor's --model
    directory = resolve_model(path) if path in BUILTIN_MODELS or hub else Path(path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(directory))
    except (OSError, ValueError) as err:
        raise ValueError(f"--tokenizer {path}: cannot load a tokenizer there: {err}") from None
    longest = max((len(json.dumps(token_string(tokenizer, i), ensure_ascii=False).encode("utf-8", "surrogatepass"))
                   - 2 for i in range(len(tokenizer))), default=1)
    return functools.lru_cache(maxsize=1 << 16)(lambda token_id: token_string(tokenizer, token_id)), longest


class TokenNames:
    """The gateway's --tokenizer, loaded off the event loop once the gateway listens (a built-in model may still be
    building beside it under ``pagedkv serve``); ``get`` waits for it. A failed load is logged once and answered
    as a 503 to the requests that need token names (logprobs); the others never wait for it."""

    def __init__(self, path: str, log=None) -> None:
        from pagedkv.models import BUILTIN_MODELS

        if path not in BUILTIN_MODELS and not Path(path).is_dir():
            raise ValueError(f"--tokenizer {path}: not a directory, nor a built-in model's name")
        self.path, self.log = path, log
        self._task: asyncio.Future | None = None

    def start(self) -> None:
        self._task = asyncio.ensure_future(asyncio.to_thread(load_token_names, self.path))
        self._task.add_done_callback(self._loaded)

    @property
    def longest(self) -> int | None:
        """The most bytes a token's name takes in JSON, once the tokenizer is loaded (None before, or if it failed)."""
        task = self._task
        if task is None or not task.done() or task.cancelled() or task.exception() is not None:
            return None
        return task.result()[1]

    def _loaded(self, task: asyncio.Future) -> None:
        if self.log is not None and not task.cancelled() and task.exception() is not None:
            self.log.error("tokenizer_failed", path=self.path, error=str(task.exception()))

    async def get(self) -> TokenText:
        if self._task is None:
            self.start()
        return (await asyncio.shield(self._task))[0]
