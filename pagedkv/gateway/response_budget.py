"""The most bytes an answer can take, worked out from what its request asks before anything is sent
(``estimate``), and the refusal of a request whose answer could pass --max-response-bytes (``check``). Issue 46
(F4): an 8 KB request (4 prompts of 2,000 characters, echo, logprobs=20, prompt_logprobs=20, n=16) got a 229 MB
answer that the gateway built in memory (RSS +1.5 GB) and encoded on its event loop (another tenant waited 8 s).

What bounds what, for each prompt (its n choices share it):

  prompt tokens P      <= the text's UTF-8 bytes + PROMPT_EXTRA_TOKENS (a byte-level BPE, WordPiece or
                          SentencePiece token covers at least one byte of text; BOS and the like on top), or its
                          token ids; truncate_prompt_tokens; max_model_len - 1. A chat's: max_model_len - 1 (its
                          template is rendered by the scheduler)
  completion tokens C  <= max_tokens (a chat without it: the context), and P + C <= max_model_len
  a token's name       <= TokenSizes.name bytes inside a JSON string; its text in a choice's text TokenSizes.text

Each part is counted as logprobs.py and openai_responses.py write it (compact JSON, ensure_ascii=False), with the
longest number JSON writes for a float (FLOAT_BYTES) and an integer's (INT_BYTES) in every numeric slot; the unit
tests build the worst case through the real encoder and check the estimate is not below it. A stream's total is
bounded the same, its SSE framing counted per token (see ``estimate``)."""

from __future__ import annotations

import json
from dataclasses import dataclass

from pagedkv.gateway.errors import ApiError
from pagedkv.gateway.openai_requests import Plan

DEFAULT_MAX_RESPONSE_BYTES = 32 << 20
MIN_MAX_RESPONSE_BYTES = 64 << 10  # --max-response-bytes at least this: any one small answer fits
PROMPT_EXTRA_TOKENS = 8  # tokens a tokenizer may add to a text prompt (BOS, EOS, a SentencePiece word-start)
# NOTE: without a tokenizer the gateway cannot measure a token's text. The longest token of the vocabularies seen
# here: SmolLM2's 82 bytes as JSON ('\n' + 80 spaces), tiny-llama's 6 ('\u0000'); --tokenizer replaces this with
# the loaded vocabulary's own longest (logprobs.TokenNames.longest).
FALLBACK_TOKEN_BYTES = 128
ID_NAME_BYTES = len("token_id:2147483647")  # a token named by its id (no --tokenizer; return_tokens_as_token_ids)
FLOAT_BYTES = len("-1.2345678901234567e-308")  # the longest repr json writes for a float
INT_BYTES = len("-2147483648")  # token ids, ranks, text offsets, counts (and null, 4, fits)
TOOL_TEXT_FACTOR = 5  # a chat with tools: arguments re-written by json.dumps (1e15 -> 1000000000000000.0, 4.5x)
TOOL_CALL_BYTES = len('{"id":"chatcmpl-tool-0123456789abcdef0123456789abcdef","type":"function","function":'
                      '{"name":"","arguments":""}},"index":2147483648,')  # a call per token at most
# A choice's own JSON, apart from its text and log-probabilities (the larger of a completion's and a chat's).
CHOICE_BYTES = max(
    len('{"index":2147483648,"text":"","logprobs":{"tokens":[],"token_logprobs":[],"top_logprobs":[],'
        '"text_offset":[]},"finish_reason":"length","prompt_logprobs":[null]},'),
    len('{"index":2147483648,"message":{"role":"assistant","content":"","refusal":null,"tool_calls":[]},'
        '"logprobs":{"content":[],"refusal":null},"finish_reason":"tool_calls"},'))
# The body around the choices (id and model added), and one SSE chunk around its text and tokens (id and model
# added; its usage with continuous_usage_stats, an empty logprobs object with logprobs).
USAGE_BYTES = len('{"prompt_tokens":2147483648,"completion_tokens":2147483648,"total_tokens":2147483648,'
                  '"prompt_tokens_details":{"cached_tokens":2147483648}}')
BODY_BYTES = len('{"id":"","object":"chat.completion","created":2147483648,"model":"","choices":[],"usage":,'
                 '"system_fingerprint":null,"prompt_logprobs":[null]}') + USAGE_BYTES
CHUNK_BYTES = max(
    len('data: {"id":"","object":"text_completion","created":2147483648,"model":"","choices":[{"index":2147483648,'
        '"text":"","logprobs":null,"finish_reason":"length"}],"system_fingerprint":null,"usage":null}\n\n'),
    len('data: {"id":"","object":"chat.completion.chunk","created":2147483648,"model":"","choices":[{"index":'
        '2147483648,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":"tool_calls"}],'
        '"system_fingerprint":null,"usage":null}\n\n'))
LOGPROBS_BYTES = len('{"tokens":[],"token_logprobs":[],"top_logprobs":[],"text_offset":[]}')  # (chat's is shorter)
STREAM_END_BYTES = len("data: [DONE]\n\n")


@dataclass(frozen=True, slots=True)
class TokenSizes:
    """The most bytes one token takes: ``name`` as logprobs name it inside a JSON string, ``text`` what it adds to
    a choice's text as JSON writes it."""

    name: int
    text: int


def token_sizes(longest: int | None, by_id: bool) -> TokenSizes:
    """``longest``: the loaded vocabulary's longest token as JSON (None: not known, FALLBACK_TOKEN_BYTES);
    ``by_id``: logprobs name tokens token_id:N. A token's text may add one byte more (a space between special
    tokens)."""
    longest = longest or FALLBACK_TOKEN_BYTES
    return TokenSizes(ID_NAME_BYTES if by_id else longest, longest + 1)


# ---- one position's log-probabilities, as logprobs.py writes them (k alternatives) -----------------------------
def completion_position(k: int, name: int) -> int:
    """completions: its token, token_logprob, top_logprobs dict (itself and k others) and text_offset."""
    return (name + 3) + (FLOAT_BYTES + 1) + (3 + (k + 1) * (name + FLOAT_BYTES + 4)) + (INT_BYTES + 1)


def chat_entry(name: int) -> int:
    """chat: {token, logprob, bytes}; a name's UTF-8 bytes are at most its JSON bytes, each written as 'nnn,'."""
    return len('{"token":"","logprob":,"bytes":[]},') + name + FLOAT_BYTES + 4 * name


def chat_position(k: int, name: int) -> int:
    return chat_entry(name) + len(',"top_logprobs":[]') + k * chat_entry(name)


def prompt_position(k: int, name: int) -> int:
    """prompt_logprobs: {id: {logprob, rank, decoded_token}} for the token and k others."""
    return 3 + (k + 1) * (len('"":{"logprob":,"rank":,"decoded_token":""},') + 2 * INT_BYTES + FLOAT_BYTES + name)


def _json_bytes(text: str) -> int:
    return len(json.dumps(text, ensure_ascii=False).encode("utf-8", "surrogatepass"))


@dataclass(frozen=True, slots=True)
class Estimate:
    """An answer's most bytes (``total``), and what each request field drives (``parts``: field -> bytes)."""

    total: int
    parts: dict[str, int]

    def driver(self) -> str:
        """The field that drives the most bytes."""
        return max(self.parts, key=self.parts.__getitem__)


def _prompt_tokens(req, max_model_len: int) -> int:
    kind = req.WhichOneof("prompt")
    most = max_model_len - 1
    if kind == "text":
        most = min(most, len(req.text.encode("utf-8", "surrogatepass")) + PROMPT_EXTRA_TOKENS)
    elif kind == "token_ids":
        most = min(most, len(req.token_ids.ids))
    if req.truncate_prompt_tokens:
        most = min(most, req.truncate_prompt_tokens)
    return max(most, 1)


def _fill(per_prompt: int, per_completion: int, prompt: int, completion: int, max_model_len: int) -> tuple[int, int]:
    """The prompt and completion lengths that cost most, with prompt + completion <= max_model_len (the scheduler
    refuses more): the dearer kind of token first."""
    if per_prompt >= per_completion:
        return prompt, max(0, min(completion, max_model_len - prompt))
    completion = min(completion, max_model_len - 1)
    return max(1, min(prompt, max_model_len - completion)), completion


def estimate(plan: Plan, max_model_len: int, sizes: TokenSizes, rid: str = "", model: str = "") -> Estimate:
    """The most bytes ``plan``'s answer can take: the JSON body, or a stream's SSE chunks in all (each token may come
    in a chunk of its own, plus a role, an echo and a finish chunk a choice, the usage and [DONE])."""
    n, name, k = plan.n, sizes.name, plan.top_logprobs
    tokens_field = "logprobs" if not plan.chat or not k else "top_logprobs"
    parts = dict.fromkeys(("echo", "prompt_logprobs", tokens_field, "max_tokens", "n"), 0)
    framing = _json_bytes(rid) + _json_bytes(model)
    chunk = CHUNK_BYTES + framing + (USAGE_BYTES if plan.continuous_usage else 0) + (LOGPROBS_BYTES if plan.logprobs
                                                                                    else 0)
    per_text = sizes.text * (TOOL_TEXT_FACTOR if plan.chat and plan.requests[0].chat.tools else 1)
    per_text += TOOL_CALL_BYTES if plan.chat and plan.requests[0].chat.tools else 0
    per_token = per_text + (chunk if plan.stream else 0)
    per_logprob = 0
    if plan.logprobs:
        per_logprob = chat_position(k, name) if plan.chat else completion_position(k, name)
    echo_logprob = completion_position(k, name) if plan.echo and plan.logprobs else 0
    plp = prompt_position(plan.prompt_logprobs, name) if plan.prompt_logprobs is not None else 0
    plp_copies = 1 if plan.chat else n  # (chat: once beside the choices; completions: in each choice)
    for req in plan.requests:
        echo_text = plan.echo and (req.WhichOneof("prompt") != "text" or req.truncate_prompt_tokens > 0)
        per_prompt = n * (echo_logprob + (sizes.text if echo_text else 0)) + plp_copies * plp
        max_tokens = req.sampling.max_tokens or max_model_len
        prompt, completion = _fill(per_prompt, n * (per_token + per_logprob), _prompt_tokens(req, max_model_len),
                                   max_tokens, max_model_len)
        exact_echo = _json_bytes(req.text) if plan.echo and not echo_text else 0
        parts["echo"] += n * (exact_echo + prompt * (echo_logprob + (sizes.text if echo_text else 0)))
        parts["prompt_logprobs"] += plp_copies * prompt * plp
        parts[tokens_field] += n * completion * per_logprob
        parts["max_tokens"] += n * completion * per_token
    parts["n"] = plan.num_choices * (3 * chunk if plan.stream else CHOICE_BYTES) + BODY_BYTES + framing
    parts["n"] += STREAM_END_BYTES if plan.stream else 0
    return Estimate(sum(parts.values()), parts)


def check(plan: Plan, max_model_len: int, limit: int, sizes: TokenSizes, rid: str = "",
          model: str = "") -> Estimate:
    """``plan``'s estimate, or a 400 naming the field that drives it most, the estimate and the limit."""
    est = estimate(plan, max_model_len, sizes, rid, model)
    if est.total <= limit:
        return est
    asked = {"echo": "echo", "prompt_logprobs": f"prompt_logprobs={plan.prompt_logprobs}",
             "logprobs": f"logprobs={plan.top_logprobs}" if not plan.chat else "logprobs",
             "top_logprobs": f"top_logprobs={plan.top_logprobs}", "max_tokens": "the tokens' text (max_tokens)",
             "n": "each choice's own JSON"}
    ranked = sorted((f for f in est.parts if est.parts[f]), key=est.parts.__getitem__, reverse=True)
    shares = ", ".join(f"{asked[f]} {est.parts[f]}" for f in ranked)
    lower = [f for f in ranked if f not in ("n", "max_tokens")] + ["max_tokens"]
    lower += ["n"] if plan.n > 1 else []
    lower += ["the number of prompts"] if len(plan.requests) > 1 else []
    field = est.driver()
    raise ApiError(400, f"{field}: the answer could take up to {est.total} bytes ({len(plan.requests)} prompt(s) x "
                   f"n={plan.n}{', streamed' if plan.stream else ''}: {shares}); this gateway answers at most {limit} "
                   f"bytes a request (--max-response-bytes); lower {', '.join(lower)}", param=field,
                   code="response_too_large")
