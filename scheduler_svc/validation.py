"""Checks on what a client sent. Each failure names the field and the limit. The bounds and checks the gateway
applies too (sizes, ranges, a chat's size) are pagedkv/bounds.py's."""

from __future__ import annotations

import math
import secrets
from collections.abc import Callable, Collection
from dataclasses import dataclass

from pagedkv.api.v1 import api_pb2 as api
from pagedkv.bounds import (
    MAX_FORKS,
    MAX_LOGIT_BIAS,
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_PENALTY,
    MAX_PRIORITY,
    InvalidRequest,
    default_max_prompt_bytes,
)
from pagedkv.tenancy import Tenant
from pagedkv.trusted_hop import OBJECTIVE_HEADER
from scheduler_svc.fit import pages_for
from scheduler_svc.request import Sampling

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_REQUEST_ID_CHARS = 256
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


MAX_BAD_WORDS = 100
MAX_BAD_WORD_CHARS = 256


def check_bad_words(words: list[str]) -> None:
    """sampling.bad_words: at most MAX_BAD_WORDS, each 1 to MAX_BAD_WORD_CHARS characters (checked before they are
    tokenized)."""
    if len(words) > MAX_BAD_WORDS:
        raise InvalidRequest(f"sampling.bad_words: {len(words)} words; at most {MAX_BAD_WORDS}")
    for w in words:
        if not 0 < len(w.strip()) <= MAX_BAD_WORD_CHARS:
            raise InvalidRequest(f"sampling.bad_words: a word of {len(w)} characters; each must have 1 to "
                                 f"{MAX_BAD_WORD_CHARS} (spaces around it aside)")


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
    if p.n < 0 or p.n > MAX_FORKS:
        raise InvalidRequest(f"sampling.n: {p.n}; must be in [1, {MAX_FORKS}] (0 means 1)")
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


def check_continuation(c: api.Continuation, n: int, prompt_len: int, sampling: Sampling, limits: Limits,
                       stop_ids: Collection[int], budget_pages: int = 0,
                       block_size: int = 1) -> list[tuple[int, list[int]]]:
    """The forks a continuation resumes, as (fork index, token ids received), unfinished ones only, in fork order.
    One entry per fork; each fork's draw_offset is the number of its ids (draws are numbered by output position);
    every id in the vocabulary; an unfinished fork holds none of what would have ended it: max_tokens reached
    (``sampling``: checked against the context, max_model_len lowered by the tenant's capacity, as any request's), a
    stop token (``stop_ids``: sampling.stop_token_ids, and EOS unless ignore_eos), more pages than ``budget_pages``
    (a page budget with the 'stop' policy; 0: none). Stop strings are found when the ids are replayed through the
    detokenizer (the API)."""
    if len(c.forks) != n:
        raise InvalidRequest(f"continuation.forks: {len(c.forks)} entries; must be one per fork: {n} (sampling.n)")
    resumed = []
    for i, fork in enumerate(c.forks):
        field, ids = f"continuation.forks[{i}]", list(fork.token_ids)
        if fork.draw_offset != len(ids):
            raise InvalidRequest(f"{field}.draw_offset: {fork.draw_offset}; must equal the number of token_ids "
                                 f"received ({len(ids)}): draws are numbered by output position")
        bad = next((t for t in ids if not 0 <= t < limits.vocab_size), None)
        if bad is not None:
            raise InvalidRequest(f"{field}.token_ids: id {bad} outside the vocabulary [0, {limits.vocab_size})")
        if fork.finished:
            continue
        ended = f"a fork that reached it has finished: set {field}.finished"
        # (prompt + max_tokens <= max_model_len: check_sampling)
        if len(ids) >= sampling.max_tokens:
            raise InvalidRequest(f"{field}.token_ids: {len(ids)} tokens; an unfinished fork has fewer than "
                                 f"sampling.max_tokens={sampling.max_tokens} ({ended})")
        at = next((j for j, t in enumerate(ids) if t in stop_ids), None)
        if at is not None:
            raise InvalidRequest(f"{field}.token_ids: id {ids[at]} at position {at} is a stop token "
                                 f"(sampling.stop_token_ids, or EOS without ignore_eos): the fork ended there "
                                 f"(set {field}.finished)")
        if budget_pages and pages_for(prompt_len + len(ids), block_size) > budget_pages:
            raise InvalidRequest(f"{field}.token_ids: prompt ({prompt_len}) + {len(ids)} tokens need "
                                 f"{pages_for(prompt_len + len(ids), block_size)} pages; the page budget is "
                                 f"{budget_pages} pages (overflow policy 'stop'; {ended})")
        resumed.append((i, ids))
    if not resumed:
        raise InvalidRequest("continuation.forks: every fork finished; nothing is left to resume")
    return resumed


def check_request_id(request_id: str) -> None:
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidRequest(f"request_id: {len(request_id)} characters; at most {MAX_REQUEST_ID_CHARS}")


def check_priority(priority: int, tenant: Tenant | None = None, from_hop: bool = False) -> None:
    """A request's priority: in the range, and not more important than its tenant may ask for (``from_hop``: the
    priority of a trusted hop's GIE objective, not the request's own field: the same limit holds)."""
    if not -MAX_PRIORITY <= priority <= MAX_PRIORITY:
        raise InvalidRequest(f"priority: {priority}; must be in [-{MAX_PRIORITY}, {MAX_PRIORITY}]")
    if tenant is not None and priority < tenant.max_priority:
        source = f" (the objective in {OBJECTIVE_HEADER})" if from_hop else ""
        raise InvalidRequest(f"priority: {priority}{source}; tenant {tenant.id} may ask for "
                             f"{tenant.max_priority} or more (its max_priority in the tenants file; lower is more "
                             "important)")
