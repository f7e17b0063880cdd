"""The trace kv_strategies.py runs through every strategy: seeded, ShareGPT-like mixed lengths, some requests
starting with one of a few shared system prompts; and its statistics."""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import dataclass
from typing import Any

BOS_ID, FIRST_ID = 1, 3


# ---- the trace ------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class TraceConfig:
    num_requests: int = 1000
    seed: int = 0
    max_model_len: int = 2048
    prompt_mean: float = 161.0
    output_mean: float = 338.0
    sigma: float = 1.0
    shared_fraction: float = 0.5
    num_prefixes: int = 4
    prefix_len: int = 256
    vocab_size: int = 32000


@dataclass(frozen=True, slots=True)
class TraceRequest:
    index: int
    prompt: list[int]
    output_len: int
    prefix: int  # shared system prompt index, -1: none


def _lognormal(rng: random.Random, mean: float, sigma: float) -> int:
    return max(1, round(rng.lognormvariate(math.log(mean) - sigma * sigma / 2, sigma)))


def make_trace(cfg: TraceConfig) -> list[TraceRequest]:
    """Prompts: BOS + random ids (a shared request: its system prompt, then its own tokens); outputs
    log-normal. Capped: prompt <= max_model_len - 1, then output <= max_model_len - prompt."""
    if cfg.prefix_len >= cfg.max_model_len - 1 or cfg.num_requests < 1 or not 0 <= cfg.shared_fraction <= 1:
        raise ValueError("trace: need 1 <= num_requests, 0 <= shared_fraction <= 1, prefix_len < max_model_len - 1")
    rng = random.Random(cfg.seed)
    ids = (FIRST_ID, cfg.vocab_size)
    prefixes = [[BOS_ID] + [rng.randrange(*ids) for _ in range(cfg.prefix_len - 1)] for _ in range(cfg.num_prefixes)]
    shared = set(rng.sample(range(cfg.num_requests), round(cfg.shared_fraction * cfg.num_requests)))
    out = []
    for i in range(cfg.num_requests):
        prefix = rng.randrange(cfg.num_prefixes) if i in shared else -1
        head = prefixes[prefix] if prefix >= 0 else [BOS_ID]
        own = min(_lognormal(rng, cfg.prompt_mean, cfg.sigma), cfg.max_model_len - 1 - len(head))
        prompt = head + [rng.randrange(*ids) for _ in range(own)]
        output = min(_lognormal(rng, cfg.output_mean, cfg.sigma), cfg.max_model_len - len(prompt))
        out.append(TraceRequest(i, prompt, output, prefix))
    return out


def trace_stats(trace: list[TraceRequest]) -> dict[str, Any]:
    p = [len(r.prompt) for r in trace]
    o = [r.output_len for r in trace]
    held = [sum(len(r.prompt) + k for k in range(r.output_len)) / r.output_len for r in trace]
    life = [r.output_len for r in trace]
    return {"requests": len(trace), "prompt_mean": statistics.fmean(p), "prompt_p50": statistics.median(p),
            "prompt_max": max(p), "output_mean": statistics.fmean(o), "output_p50": statistics.median(o),
            "output_max": max(o), "with_shared_prefix": sum(1 for r in trace if r.prefix >= 0),
            # tokens a running request holds, averaged over its life and weighted by how long it runs: what a
            # paged allocator must hold per concurrent request
            "time_weighted_tokens_held": sum(h * n for h, n in zip(held, life)) / sum(life)}
