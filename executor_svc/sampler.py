"""Sampling: greedy, temperature, top-k, top-p, with a per-request seed stream.

Draw number i of a request uses a generator seeded from (seed, i) alone, so what a request samples
depends neither on the other requests in the batch nor on whether it was preempted and recomputed
(or, later, migrated): the same seed gives the same tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_MASK64 = (1 << 64) - 1
# Temperatures below this sample greedily (as vLLM does): dividing logits by a tiny temperature overflows to
# inf, softmax turns inf - inf into NaN, and the draw then always picks token 0.
GREEDY_TEMPERATURE = 1e-5


@dataclass(frozen=True, slots=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    logprobs: bool = False

    @property
    def greedy(self) -> bool:
        return not self.temperature >= GREEDY_TEMPERATURE  # NaN too (the executor refuses it before this)


def draw_seed(seed: int, draw: int) -> int:
    """splitmix64 of (seed, draw): independent, reproducible generator seeds per draw."""
    z = (seed * 0x9E3779B97F4A7C15 + draw + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """logits [V] (already divided by temperature) with the tokens outside top-k / top-p set to -inf."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        drop = cum - torch.softmax(sorted_logits, dim=-1) >= top_p  # keep the smallest set reaching top_p
        drop[0] = False
        logits = logits.clone()
        logits[order[drop]] = float("-inf")
    return logits


def sample_one(logits: torch.Tensor, params: SamplingParams, draw: int) -> int:
    if params.greedy:
        return int(torch.argmax(logits))
    scaled = filter_logits(logits / params.temperature, params.top_k, params.top_p)
    probs = torch.softmax(scaled, dim=-1)
    gen = torch.Generator(device=logits.device).manual_seed(draw_seed(params.seed, draw))
    noise = torch.empty_like(probs).exponential_(generator=gen)
    return int(torch.argmax(probs / noise))  # an exponential race: exact sampling from probs


def sample(logits: torch.Tensor, params: list[SamplingParams], draws: list[int]) -> tuple[list[int], list[float]]:
    """logits [B, V] fp32 -> (token ids, log-probabilities under the model's raw distribution)."""
    greedy = torch.argmax(logits, dim=-1).tolist()
    tokens = [g if p.greedy else sample_one(logits[i], p, draws[i]) for i, (g, p) in enumerate(zip(greedy, params))]
    logprobs = [0.0] * len(tokens)
    want = [i for i, p in enumerate(params) if p.logprobs]
    if want:
        rows = torch.tensor(want)
        lp = torch.log_softmax(logits[rows], dim=-1)
        chosen = lp.gather(1, torch.tensor([tokens[i] for i in want]).view(-1, 1)).view(-1).tolist()
        for i, value in zip(want, chosen):
            logprobs[i] = value
    return tokens, logprobs
