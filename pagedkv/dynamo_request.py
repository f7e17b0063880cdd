"""NVIDIA Dynamo's pre-tokenized request (its ``PreprocessedRequest``, a dict) as a pagedkv ``GenerateRequest``, and
pagedkv's stream back as Dynamo's chunks. Pure functions, no Dynamo import: ``pagedkv.dynamo_worker`` calls them
and turns a ``Refused`` into Dynamo's ``InvalidArgument`` (HTTP 400).

Every field Dynamo 1.6's frontend sends is either mapped exactly or refused with a message naming it (docs/design.md
decision 12). Dynamo owns tokenization, the chat template, detokenization and stop strings: ``stop`` is applied by
its frontend (it closes the stream, which aborts the request in pagedkv), as are ``skip_special_tokens`` and
``include_stop_str_in_output``, which are about text. A field Dynamo sends as null or at its neutral value is
accepted whatever it is.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from pagedkv.api.v1 import api_pb2 as api

PRIORITY_LIMIT = 1000  # GenerateRequest.priority's range is [-1000, 1000]

# (section, field) Dynamo may send that pagedkv reads; anything else that is set is refused.
_READ = {
    "sampling_options": {"n", "best_of", "presence_penalty", "frequency_penalty", "repetition_penalty",
                         "temperature", "top_p", "top_k", "min_p", "use_beam_search", "length_penalty", "seed",
                         "include_stop_str_in_output", "guided_decoding"},
    "stop_conditions": {"max_tokens", "stop", "stop_token_ids", "stop_token_ids_visible", "stop_token_ids_hidden",
                        "min_tokens", "ignore_eos", "max_thinking_tokens"},
    "output_options": {"logprobs", "prompt_logprobs", "skip_special_tokens", "formatted_prompt",
                       "return_tokens_as_token_ids"},
    "routing": {"dp_rank", "cache_salt", "priority", "priority_jump", "backend_instance_id", "prefill_worker_id",
                "decode_worker_id", "lora_name", "expected_output_tokens", "allowed_worker_ids"},
}
# Top-level keys of the request that carry no generation semantics pagedkv could miss (routing and bookkeeping of
# the frontend, the model name, annotations) or that are mapped below.
_TOP_LEVEL = {"token_ids", "model", "sampling_options", "stop_conditions", "output_options", "routing",
              "extra_args", "eos_token_ids", "mdc_sum", "annotations", "router_config_override", "batch_token_ids",
              "tracker", "request_timestamp_ms", "require_reasoning", "backend_instance_id", "mm_routing_info",
              "nvext"}
# Top-level keys whose presence (non-empty) means work pagedkv cannot do here.
_REFUSED_TOP_LEVEL = {
    "multi_modal_data": "multimodal inputs are not supported by pagedkv",
    "mm_processor_kwargs": "multimodal inputs are not supported by pagedkv",
    "encoder_result": "multimodal inputs are not supported by pagedkv",
    "prefill_result": "disaggregated prefill/decode is not supported by pagedkv (run its workers aggregated)",
    "bootstrap_info": "disaggregated prefill/decode is not supported by pagedkv (run its workers aggregated)",
    "prompt_embeds": "prompt embeddings are not supported by pagedkv",
}
_GUIDED_KINDS = ("json", "regex", "choice", "grammar")
_GUIDED_NEUTRAL = {"backend", "whitespace_pattern", "structural_tag"}


class Refused(ValueError):
    """A request field pagedkv cannot honour; ``field`` names it as Dynamo's request spells it."""

    def __init__(self, field: str, why: str) -> None:
        super().__init__(f"{field}: {why}")
        self.field = field


def _set(value: Any) -> bool:
    return value is not None and value != [] and value != {} and value != ""


def _int(section: str, key: str, value: Any, lo: int | None = None, hi: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not float(value).is_integer():
        raise Refused(f"{section}.{key}", f"must be an integer, got {value!r}")
    value = int(value)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise Refused(f"{section}.{key}", f"{value} is out of range [{lo}, {hi}]")
    return value


def _str(section: str, key: str, value: Any) -> str:
    if not isinstance(value, str):
        raise Refused(f"{section}.{key}", f"must be a string, got {type(value).__name__}")
    return value


def _float(section: str, key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise Refused(f"{section}.{key}", f"must be a finite number, got {value!r}")
    return float(value)


def _ids(section: str, key: str, value: Any) -> list[int]:
    if value is None:
        return []
    if not isinstance(value, (list, tuple)):
        raise Refused(f"{section}.{key}", f"must be a list of token ids, got {type(value).__name__}")
    return [_int(section, key, v, 0) for v in value]


def _section(request: Mapping[str, Any], name: str) -> dict[str, Any]:
    value = request.get(name) or {}
    if not isinstance(value, Mapping):
        raise Refused(name, f"must be an object, got {type(value).__name__}")
    unknown = sorted(k for k, v in value.items() if k not in _READ[name] and _set(v))
    if unknown:
        raise Refused(f"{name}.{unknown[0]}", "not supported by pagedkv's Dynamo worker")
    return dict(value)


def token_ids_of(request: Mapping[str, Any]) -> list[int]:
    """The prompt's token ids (Dynamo may pack them as little-endian u32 bytes)."""
    ids = request.get("token_ids")
    if isinstance(ids, (bytes, bytearray, memoryview)):
        raw = bytes(ids)
        if len(raw) % 4:
            raise Refused("token_ids", f"{len(raw)} packed bytes is not a whole number of u32 ids")
        return [int.from_bytes(raw[i:i + 4], "little") for i in range(0, len(raw), 4)]
    if not isinstance(ids, (list, tuple)) or not ids:
        raise Refused("token_ids", "the prompt's token ids are missing or empty")
    return [_int("request", "token_ids", v, 0) for v in ids]


def constraint_of(guided: Any) -> api.Constraint | None:
    """``sampling_options.guided_decoding`` (json | regex | choice | grammar) as pagedkv's Constraint."""
    if guided is None:
        return None
    if not isinstance(guided, Mapping):
        raise Refused("sampling_options.guided_decoding", f"must be an object, got {type(guided).__name__}")
    where = "sampling_options.guided_decoding"
    for key, value in guided.items():
        if key in _GUIDED_KINDS:
            continue
        if key == "backend" or not _set(value):
            continue  # which library compiles it: pagedkv's is xgrammar, whatever is named
        if key in ("whitespace_pattern", "structural_tag"):
            raise Refused(f"{where}.{key}", "not supported by pagedkv (JSON is written compact; no structural tags)")
        raise Refused(f"{where}.{key}", "unknown guided decoding kind")
    kinds = [k for k in _GUIDED_KINDS if guided.get(k) is not None]
    if not kinds:
        return None
    if len(kinds) > 1:
        raise Refused(where, f"more than one kind set ({', '.join(kinds)}); give one")
    kind, value = kinds[0], guided[kinds[0]]
    if kind == "json":
        return api.Constraint(json_schema=value if isinstance(value, str) else json.dumps(value))
    if kind == "choice":
        if not isinstance(value, (list, tuple)) or not all(isinstance(c, str) for c in value):
            raise Refused(f"{where}.choice", "must be a list of strings")
        return api.Constraint(choice=api.Choices(choices=list(value)))
    if not isinstance(value, str):
        raise Refused(f"{where}.{kind}", f"must be a string, got {type(value).__name__}")
    return api.Constraint(**{kind: value})


def _stop_ids(stop: Mapping[str, Any], eos_ids: Iterable[int], ignore_eos: bool) -> list[int]:
    """Every stop token id: stop_token_ids, the visible and hidden ones (Dynamo lists EOS among the hidden); EOS
    left out when ignore_eos (pagedkv stops at EOS itself unless ignore_eos, and a stop id always stops)."""
    ids: list[int] = []
    for key in ("stop_token_ids", "stop_token_ids_visible"):
        ids += _ids("stop_conditions", key, stop.get(key))
    eos = set(eos_ids)
    ids += [t for t in _ids("stop_conditions", "stop_token_ids_hidden", stop.get("stop_token_ids_hidden"))
            if not (ignore_eos and t in eos)]
    return list(dict.fromkeys(ids))


def _sampling(options: Mapping[str, Any], stop: Mapping[str, Any], output: Mapping[str, Any],
              eos_ids: Sequence[int]) -> api.SamplingParams:
    s = api.SamplingParams()
    so = "sampling_options"
    if options.get("use_beam_search"):
        raise Refused(f"{so}.use_beam_search", "beam search is not supported by pagedkv")
    length_penalty = options.get("length_penalty")
    if length_penalty is not None and _float(so, "length_penalty", length_penalty) != 1.0:
        raise Refused(f"{so}.length_penalty", "applies to beam search only, which pagedkv does not do")
    n = 1 if options.get("n") is None else _int(so, "n", options["n"], 1)
    if n > 1:
        # NOTE: measured on 1.6.1 (/v1/completions and /v1/chat/completions, n = 2, with and without migration):
        # the frontend ends the response at the first chunk of any choice that carries a finish_reason; the
        # other choice lost its last token and was reported "stop" whatever ended it. pagedkv's forks (n > 1 on the
        # gRPC API) would map one to one; what Dynamo makes of them would not be exact.
        raise Refused(f"{so}.n", f"n = {n}: Dynamo's frontend (1.6.1) ends a response when its first choice "
                      "finishes, so the other choices would lose their last tokens and their finish reasons; send "
                      "n requests, each with its own seed")
    best_of = options.get("best_of")
    if best_of is not None and _int(so, "best_of", best_of, 1) != 1:
        raise Refused(f"{so}.best_of", f"best_of {best_of} != n 1: pagedkv returns every sample it draws")
    for key in ("temperature", "top_p", "repetition_penalty", "min_p"):
        if options.get(key) is not None:
            setattr(s, key, _float(so, key, options[key]))
    if options.get("top_k") is not None:
        top_k = _int(so, "top_k", options["top_k"], -1)
        s.top_k = 0 if top_k == -1 else top_k  # Dynamo's (and vLLM's) -1 is pagedkv's 0: no top-k filter
    for key in ("presence_penalty", "frequency_penalty"):
        if options.get(key) is not None:
            setattr(s, key, _float(so, key, options[key]))
    if options.get("seed") is not None:
        s.seed = _int(so, "seed", options["seed"], 0, 2**64 - 1)
    constraint = constraint_of(options.get("guided_decoding"))
    if constraint is not None:
        s.constraint.CopyFrom(constraint)

    sc = "stop_conditions"
    if stop.get("max_thinking_tokens") is not None:
        raise Refused(f"{sc}.max_thinking_tokens", "a thinking budget is not supported by pagedkv")
    if stop.get("max_tokens") is not None:
        s.max_tokens = _int(sc, "max_tokens", stop["max_tokens"], 0, 2**31 - 1)
    s.ignore_eos = bool(stop.get("ignore_eos"))
    if stop.get("min_tokens") is not None:
        s.min_tokens = _int(sc, "min_tokens", stop["min_tokens"], 0, 2**31 - 1)
    s.stop_token_ids.extend(_stop_ids(stop, eos_ids, s.ignore_eos))

    oo = "output_options"
    logprobs = output.get("logprobs")
    if logprobs is not None:
        s.logprobs = True
        s.top_logprobs = _int(oo, "logprobs", logprobs, 0, 2**31 - 1)  # the scheduler bounds it (--max-logprobs)
    prompt_logprobs = output.get("prompt_logprobs")
    if prompt_logprobs is not None:
        s.prompt_logprobs = _int(oo, "prompt_logprobs", prompt_logprobs, 0, 2**31 - 1)
    return s


def generate_request(request: Mapping[str, Any], request_id: str) -> api.GenerateRequest:
    """Dynamo's ``PreprocessedRequest`` as pagedkv's GenerateRequest (token ids, sampling, priority). Raises
    Refused naming the first field that cannot map."""
    for key, why in _REFUSED_TOP_LEVEL.items():
        if _set(request.get(key)):
            raise Refused(key, why)
    unknown = sorted(k for k, v in request.items() if k not in _TOP_LEVEL and k not in _REFUSED_TOP_LEVEL
                     and _set(v))
    if unknown:
        raise Refused(unknown[0], "not supported by pagedkv's Dynamo worker")
    options = _section(request, "sampling_options")
    stop = _section(request, "stop_conditions")
    output = _section(request, "output_options")
    routing = _section(request, "routing")
    eos_ids = _ids("request", "eos_token_ids", request.get("eos_token_ids"))
    req = api.GenerateRequest(sampling=_sampling(options, stop, output, eos_ids), request_id=request_id)
    req.token_ids.ids.extend(token_ids_of(request))
    if routing.get("lora_name"):  # (Dynamo's LoRA routing: the adapter pagedkv serves under that name)
        req.adapter = _str("routing", "lora_name", routing["lora_name"])
    if routing.get("priority") is not None:
        # Dynamo's priority: higher is sooner (its router queue's priority_jump); pagedkv's: lower is more important.
        req.priority = -_int("routing", "priority", routing["priority"], -PRIORITY_LIMIT, PRIORITY_LIMIT)
    return req


# ---- pagedkv's stream back as Dynamo's chunks ----------------------------------------------------------------------
FINISH = {api.FINISH_REASON_STOP: "stop", api.FINISH_REASON_LENGTH: "length", api.FINISH_REASON_ABORT: "cancelled"}


def top_logprobs_of(top: Sequence[api.TopLogprobs], decode) -> list[list[dict[str, Any]]]:
    """pagedkv's per-position TopLogprobs as Dynamo's ``top_logprobs`` (``[{rank, token_id, token, logprob}]``,
    most likely first, rank 1 the most likely). ``decode``: token id -> its text."""
    return [[{"rank": rank, "token_id": tok, "token": decode(tok), "logprob": float(lp)}
             for rank, (tok, lp) in enumerate(zip(pos.token_ids, pos.logprobs), start=1)] for pos in top]


def prompt_logprobs_of(prompt: api.Prompt, decode) -> list[dict[str, dict[str, Any]] | None]:
    """pagedkv's Prompt log-probabilities as Dynamo's ``engine_data.prompt_logprobs``: position 0 None, then per
    prompt token a map ``str(token id) -> {logprob, rank, decoded_token}`` with the token itself and its most likely
    alternatives."""
    out: list[dict[str, dict[str, Any]] | None] = [None]
    ids = list(prompt.token_ids)
    for i, lp in enumerate(prompt.logprobs):
        tok = ids[i + 1]
        entry = {str(tok): {"logprob": float(lp), "rank": int(prompt.ranks[i]) if i < len(prompt.ranks) else 0,
                            "decoded_token": decode(tok)}}
        if i < len(prompt.top_logprobs):
            top = prompt.top_logprobs[i]
            for rank, (alt, alt_lp) in enumerate(zip(top.token_ids, top.logprobs), start=1):
                entry.setdefault(str(alt), {"logprob": float(alt_lp), "rank": rank, "decoded_token": decode(alt)})
        out.append(entry)
    return out


def chunk_of(msg: api.GenerateResponse, want_logprobs: bool, decode) -> dict[str, Any]:
    """One GenerateResponse as a Dynamo chunk ``{token_ids, index}`` (+ ``log_probs``/``top_logprobs`` when asked
    for; the last message of a fork + ``finish_reason`` and ``completion_usage`` with cached tokens)."""
    chunk: dict[str, Any] = {"token_ids": list(msg.token_ids), "index": msg.index}
    if want_logprobs and msg.token_ids:
        chunk["log_probs"] = [float(x) for x in msg.logprobs]
        if msg.top_logprobs:
            chunk["top_logprobs"] = top_logprobs_of(msg.top_logprobs, decode)
    if msg.finish_reason:
        chunk["finish_reason"] = FINISH.get(msg.finish_reason, "stop")
        u = msg.usage
        chunk["completion_usage"] = {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
                                     "total_tokens": u.prompt_tokens + u.completion_tokens,
                                     "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}
    return chunk

