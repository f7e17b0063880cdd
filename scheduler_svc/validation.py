"""Checks of what a client sent against the model and its context: the prompt's token ids and the sampling
(``check_generation``, the sampling stage of a request's way in, scheduler_svc/intake.py), and the limits they are
checked against (``Limits``). Each failure names the field and the limit. The bounds that need no model (sizes,
ranges, a chat's size, a request's id and priority), which the gateway applies too, are pagedkv/bounds.py's."""

from __future__ import annotations

import math
import secrets
from collections.abc import Callable, Collection
from dataclasses import dataclass

from pagedkv.api.v1 import api_pb2 as api
from pagedkv.bounds import (
    MAX_LOGIT_BIAS,
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_PENALTY,
    InvalidRequest,
    check_bad_words,
    check_forks,
    default_max_prompt_bytes,
)
from scheduler_svc.request import Sampling

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
DEFAULT_MAX_LOGPROBS = 20  # --max-logprobs: top_logprobs and prompt_logprobs at most (vLLM's default)


@dataclass(frozen=True, slots=True)
class SamplingDefaults:
    """What a request gets for sampling.temperature, top_p, top_k, repetition_penalty and min_p when it leaves them
    unset, as vLLM takes it: the checkpoint's generation_config.json, else OpenAI's and vLLM's defaults (the
    executor's Describe says: executor_svc/generation_config.py)."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    repetition_penalty: float = 1.0
    min_p: float = 0.0

    @classmethod
    def of(cls, describe) -> SamplingDefaults:
        return cls(temperature=describe.default_temperature, top_p=describe.default_top_p or 1.0,
                   top_k=describe.default_top_k, repetition_penalty=describe.default_repetition_penalty or 1.0,
                   min_p=describe.default_min_p)


@dataclass(frozen=True, slots=True)
class Limits:
    max_model_len: int
    vocab_size: int
    max_len_name: str = "max_model_len"  # what sets max_model_len (a tenant's quota can lower it)
    max_prompt_bytes: int = 0  # UTF-8 bytes of text taken before tokenizing (0: default_max_prompt_bytes)
    sampling_defaults: SamplingDefaults = SamplingDefaults()
    max_logprobs: int = DEFAULT_MAX_LOGPROBS  # top_logprobs and prompt_logprobs at most (--max-logprobs)
    max_retain_ttl_s: int = 3600  # retain_kv.ttl_s at most (--kv-retention-max-ttl)

    @property
    def prompt_bytes(self) -> int:
        return self.max_prompt_bytes or default_max_prompt_bytes(self.max_model_len)


def check_prompt_ids(ids: list[int], limits: Limits) -> None:
    if not ids:
        raise InvalidRequest("prompt: must not be empty")
    if len(ids) >= limits.max_model_len:
        raise InvalidRequest(f"prompt: {len(ids)} tokens; must be shorter than {limits.max_len_name}="
                             f"{limits.max_model_len} (at least one token must be generated)")
    bad = next((t for t in ids if not 0 <= t < limits.vocab_size), None)
    if bad is not None:
        raise InvalidRequest(f"prompt.token_ids: id {bad} outside the vocabulary [0, {limits.vocab_size})")


def check_logits_controls(p: api.SamplingParams, max_tokens: int, limits: Limits) -> dict:
    """The penalties, min_p, min_tokens and logit_bias of ``p`` as Sampling's fields, refused out of range;
    repetition_penalty and min_p left unset take the model's defaults."""
    defaults = limits.sampling_defaults
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(p, name)
        if not -MAX_PENALTY <= value <= MAX_PENALTY:  # (NaN fails it)
            raise InvalidRequest(f"sampling.{name}: {value}; must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}] "
                                 "(0: no penalty)")
    repetition = (p.repetition_penalty or 1.0) if p.HasField("repetition_penalty") else defaults.repetition_penalty
    if not (math.isfinite(repetition) and repetition > 0):
        raise InvalidRequest(f"sampling.repetition_penalty: {p.repetition_penalty}; must be a finite number > 0 "
                             "(1 or 0: no penalty)")
    min_p = p.min_p if p.HasField("min_p") else defaults.min_p
    if not 0 <= min_p <= 1:
        raise InvalidRequest(f"sampling.min_p: {p.min_p}; must be in [0, 1] (0: no min-p filter)")
    if not 0 <= p.min_tokens <= max_tokens:
        raise InvalidRequest(f"sampling.min_tokens: {p.min_tokens}; must be in [0, max_tokens={max_tokens}]")
    if p.min_tokens and p.stop:  # (vLLM skips the stop strings until min_tokens; the detokenizer cannot yet)
        raise InvalidRequest(f"sampling.min_tokens: {p.min_tokens} with sampling.stop strings is not supported "
                             "(a stop string would end the request before min_tokens); send one or the other")
    if len(p.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise InvalidRequest(f"sampling.logit_bias: {len(p.logit_bias)} entries; at most {MAX_LOGIT_BIAS_ENTRIES}")
    for token, value in p.logit_bias.items():
        if not 0 <= token < limits.vocab_size:
            raise InvalidRequest(f"sampling.logit_bias: id {token} outside the vocabulary [0, {limits.vocab_size})")
        if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            raise InvalidRequest(f"sampling.logit_bias: {value} for id {token}; each value must be in "
                                 f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")
    if len(p.allowed_token_ids) > limits.vocab_size:
        raise InvalidRequest(f"sampling.allowed_token_ids: {len(p.allowed_token_ids)} ids; at most the vocabulary's "
                             f"size {limits.vocab_size}")
    bad = next((t for t in p.allowed_token_ids if not 0 <= t < limits.vocab_size), None)
    if bad is not None:
        raise InvalidRequest(f"sampling.allowed_token_ids: id {bad} outside the vocabulary [0, {limits.vocab_size})")
    check_bad_words(list(p.bad_words))
    return {"presence_penalty": float(p.presence_penalty), "frequency_penalty": float(p.frequency_penalty),
            "repetition_penalty": float(repetition), "min_p": float(min_p), "min_tokens": p.min_tokens,
            "logit_bias": dict(p.logit_bias), "allowed_token_ids": list(p.allowed_token_ids)}


def check_logprobs(p: api.SamplingParams, limits: Limits) -> dict:
    """top_logprobs (with logprobs), prompt_logprobs and echo of ``p`` as Sampling's fields, refused past
    --max-logprobs (and the vocabulary)."""
    most = min(limits.max_logprobs, limits.vocab_size)
    why = f"--max-logprobs={limits.max_logprobs}" if most == limits.max_logprobs else "the vocabulary's size"
    prompt = p.prompt_logprobs if p.HasField("prompt_logprobs") else None
    for name, value in (("top_logprobs", p.top_logprobs), ("prompt_logprobs", prompt)):
        if value is not None and not 0 <= value <= most:
            raise InvalidRequest(f"sampling.{name}: {value}; must be in [0, {most}] ({why})")
    if p.top_logprobs and not p.logprobs:
        raise InvalidRequest(f"sampling.top_logprobs: {p.top_logprobs} needs sampling.logprobs set (the sampled "
                             "tokens' log-probabilities, which the top ones go with)")
    return {"top_logprobs": p.top_logprobs, "prompt_logprobs": prompt, "echo": p.echo}


def bad_words_token_ids(words: list[str], encode: Callable[[str], list[int]]) -> list[list[int]]:
    """The token sequences the sampler masks for ``words`` (vLLM's rule): each word, spaces on its left stripped,
    tokenized as is, and with a leading space when that gives a different first token and as many tokens (the word
    inside a sentence). ``encode``: text -> ids, without special tokens."""
    out: list[list[int]] = []
    for word in words:
        plain = encode(word.lstrip())
        if plain:
            out.append(plain)
        spaced = encode(" " + word.lstrip())
        if spaced and (not plain or (spaced[0] != plain[0] and len(spaced) == len(plain))):
            out.append(spaced)
    return out


def check_sampling(p: api.SamplingParams, prompt_len: int, limits: Limits,
                   eos_token_ids: Collection[int] = ()) -> Sampling:
    """The request's sampling, checked; ``eos_token_ids``: the model's (masked, with stop_token_ids, until
    min_tokens are generated unless ignore_eos)."""
    room = limits.max_model_len - prompt_len
    if p.max_tokens < 0:
        raise InvalidRequest(f"sampling.max_tokens: {p.max_tokens}; must be > 0 (or 0 for 'up to max_model_len')")
    max_tokens = p.max_tokens or room
    if max_tokens > room:
        raise InvalidRequest(
            f"sampling.max_tokens: prompt ({prompt_len}) + max_tokens ({max_tokens}) = {prompt_len + max_tokens} "
            f"exceeds {limits.max_len_name}={limits.max_model_len}")
    # NOTE: unset is not 0 here: an unset field takes the checkpoint's default, a 0 means what it always meant.
    defaults = limits.sampling_defaults
    temperature = p.temperature if p.HasField("temperature") else defaults.temperature
    if math.isnan(temperature) or temperature < 0 or math.isinf(temperature):
        raise InvalidRequest(f"sampling.temperature: {p.temperature}; must be a finite number >= 0 (0: greedy)")
    top_p = p.top_p if p.HasField("top_p") else defaults.top_p
    top_p = top_p if top_p != 0 else 1.0
    if math.isnan(top_p) or not 0 < top_p <= 1:
        raise InvalidRequest(f"sampling.top_p: {p.top_p}; must be in (0, 1]")
    top_k = p.top_k if p.HasField("top_k") else defaults.top_k
    if top_k < 0:
        raise InvalidRequest(f"sampling.top_k: {p.top_k}; must be >= 0 (0 disables top-k)")
    if len(p.stop) > MAX_STOP_STRINGS:
        raise InvalidRequest(f"sampling.stop: {len(p.stop)} strings; at most {MAX_STOP_STRINGS}")
    for s in p.stop:
        if not s or len(s) > MAX_STOP_STRING_CHARS:
            raise InvalidRequest(f"sampling.stop: a stop string of {len(s)} characters; "
                                 f"each must have 1 to {MAX_STOP_STRING_CHARS}")
    if len(p.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidRequest(f"sampling.stop_token_ids: {len(p.stop_token_ids)} ids; at most {MAX_STOP_TOKEN_IDS}")
    bad = next((t for t in p.stop_token_ids if not 0 <= t < limits.vocab_size), None)
    if bad is not None:
        raise InvalidRequest(f"sampling.stop_token_ids: id {bad} outside the vocabulary [0, {limits.vocab_size})")
    check_forks(p.n)
    controls = check_logits_controls(p, max_tokens, limits)
    stop_ids = list(p.stop_token_ids) + ([] if p.ignore_eos else [t for t in eos_token_ids
                                                                    if t not in p.stop_token_ids])
    return Sampling(
        max_tokens=max_tokens, temperature=float(temperature), top_p=float(top_p), top_k=top_k,
        seed=p.seed if p.HasField("seed") else secrets.randbits(63),
        stop=list(p.stop), stop_token_ids=list(p.stop_token_ids), ignore_eos=p.ignore_eos,
        logprobs=p.logprobs, include_stop_str_in_output=p.include_stop_str_in_output,
        min_tokens_stop_ids=stop_ids if p.min_tokens else [], **controls, **check_logprobs(p, limits),
    )


def check_generation(p: api.SamplingParams, ids: list[int], limits: Limits, eos_token_ids: Collection[int],
                     bad_words_ids: list[list[int]]) -> Sampling:
    """The sampling stage of a Generate request's way in (scheduler_svc/intake.py): its prompt's ids and its
    sampling against the model and the context (``limits``: max_model_len lowered to what its tenant's pages hold),
    with its bad words' token sequences (each id in the vocabulary)."""
    check_prompt_ids(ids, limits)
    sampling = check_sampling(p, len(ids), limits, eos_token_ids)
    if any(not 0 <= t < limits.vocab_size for w in bad_words_ids for t in w):
        raise InvalidRequest(f"sampling.bad_words: a word's token outside the model's vocabulary [0, "
                             f"{limits.vocab_size}) (the tokenizer and the model disagree)")
    sampling.bad_words_ids = list(bad_words_ids)
    return sampling
