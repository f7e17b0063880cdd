"""Sampling: greedy, temperature, top-k, top-p, with a per-request seed stream.

Draw number i of a request inverts its filtered distribution at a uniform number made from (seed, i) alone,
so what a request samples depends neither on the other requests in the batch nor on whether it was preempted
and recomputed or migrated: the same seed gives the same tokens. Every row of a step is sampled at once
(batched torch ops, no loop over rows).
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


def uniform(seed: int, draw: int) -> float:
    """Draw number ``draw`` of a request seeded ``seed``: a uniform number in [0, 1) from (seed, draw) alone."""
    return (draw_seed(seed, draw) >> 10) / 9007199254740992.0  # (the top 53 of its 63 bits) / 2**53


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """logits [V] (already divided by temperature) with the tokens outside top-k / top-p set to -inf: the
    definition of the filters, one row at a time (``distribution`` applies them to a batch)."""
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


# A row with top-p but no top-k first looks for its kept set among this many most likely tokens (a partial
# selection: a full sort of every row costs ~30x more on the CPU); a row whose set reaches past them is sorted.
CANDIDATES = 256


def distribution(scaled: torch.Tensor, top_k: list[int], top_p: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """scaled [S, V] (logits already divided by each row's temperature), every row with a filter -> (weights
    [S, W], order [S, W]): each row's W most likely tokens, largest first (``order``: their ids), weighted by
    their probability after the row's top-k then top-p filter (as ``filter_logits``; not normalized; 0: filtered
    out). Ties at a cut keep the first of equal logits in ``torch.topk``'s order."""
    rows, vocab = scaled.shape
    device = scaled.device
    ks = [k if 0 < k < vocab else 0 for k in top_k]
    width = min(vocab, max(max(ks), CANDIDATES if any(k == 0 and p < 1.0 for k, p in zip(ks, top_p)) else 0))
    values, order = torch.topk(scaled, width, dim=-1)
    k = torch.tensor([k or width for k in ks], device=device).view(-1, 1)
    values = values.masked_fill(torch.arange(width, device=device) >= k, float("-inf"))
    has_k = torch.tensor([k > 0 for k in ks], device=device)
    norm = torch.where(has_k, torch.logsumexp(values, -1), torch.logsumexp(scaled, -1)).view(-1, 1)
    probs = torch.exp(values - norm)  # of the whole row, or of its top k
    p = torch.tensor(top_p, dtype=probs.dtype, device=device).view(-1, 1)
    cum = probs.cumsum(-1)
    drop = (cum - probs >= p) & (p < 1.0)  # keep the smallest set reaching top_p
    drop[:, 0] = False
    short = ~has_k & (p.view(-1) < 1.0) & (cum[:, -1] < p.view(-1))  # the set reaches past the candidates
    if width < vocab and bool(short.any()):
        idx = short.nonzero().view(-1)
        sub = idx.tolist()
        full, full_order = distribution_sorted(scaled[idx], [top_p[i] for i in sub])
        weights = torch.zeros(rows, vocab, dtype=probs.dtype, device=device)
        weights[:, :width] = probs.masked_fill(drop, 0.0)
        orders = torch.zeros(rows, vocab, dtype=order.dtype, device=device)
        orders[:, :width] = order
        weights[idx], orders[idx] = full, full_order
        return weights, orders
    return probs.masked_fill(drop, 0.0), order


def distribution_sorted(scaled: torch.Tensor, top_p: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows with top-p alone whose kept set is not among the CANDIDATES: ``distribution`` over a full sort."""
    values, order = torch.sort(scaled, dim=-1, descending=True)
    probs = torch.softmax(values, dim=-1)
    p = torch.tensor(top_p, dtype=probs.dtype, device=scaled.device).view(-1, 1)
    drop = probs.cumsum(-1) - probs >= p
    drop[:, 0] = False
    return probs.masked_fill(drop, 0.0), order


def _invert(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The column where each row's cumulative weights first exceed u x its total."""
    cdf = weights.cumsum(-1)
    return torch.searchsorted(cdf, u.to(cdf.dtype) * cdf[:, -1:], right=True).clamp_(max=cdf.shape[-1] - 1)


def sample_one(logits: torch.Tensor, params: SamplingParams, draw: int) -> int:
    """One row's token: what ``sample`` draws for it in any batch."""
    return sample(logits.view(1, -1), [params], [draw])[0][0]


def sample(logits: torch.Tensor, params: list[SamplingParams], draws: list[int]) -> tuple[list[int], list[float]]:
    """logits [B, V] fp32 -> (token ids, log-probabilities under the model's raw distribution).

    Greedy rows take the argmax. The others, all at once: divided by their temperature, filtered (top-k, top-p:
    ``distribution``), and drawn by inverting the cumulative distribution (in float64) at ``uniform(seed,
    draw)``: the token depends on the row's logits, seed and draw number alone, never on the batch."""
    greedy = torch.argmax(logits, dim=-1).tolist()
    tokens = greedy
    vocab = logits.shape[-1]
    plain = [i for i, p in enumerate(params) if not p.greedy and not 0 < p.top_k < vocab and not p.top_p < 1.0]
    filtered = [i for i, p in enumerate(params) if not p.greedy and (0 < p.top_k < vocab or p.top_p < 1.0)]
    for rows in (plain, filtered):
        if not rows:
            continue
        device = logits.device
        picked = [params[i] for i in rows]
        temps = torch.tensor([p.temperature for p in picked], dtype=logits.dtype, device=device).view(-1, 1)
        scaled = (logits if len(rows) == len(params) else logits[long_rows(rows, device)]) / temps
        u = torch.tensor([uniform(p.seed, draws[i]) for p, i in zip(picked, rows)], dtype=torch.float64,
                         device=device).view(-1, 1)
        if rows is plain:
            at = _invert(torch.exp(scaled - scaled.amax(-1, keepdim=True)), u)
        else:
            weights, order = distribution(scaled, [p.top_k for p in picked], [p.top_p for p in picked])
            at = order.gather(1, _invert(weights, u))
        if tokens is greedy:
            tokens = list(greedy)
        for i, token in zip(rows, at.view(-1).tolist()):
            tokens[i] = token
    logprobs = [0.0] * len(tokens)
    want = [i for i, p in enumerate(params) if p.logprobs]
    if want:
        rows_t = torch.tensor(want, device=logits.device)
        lp = torch.log_softmax(logits[rows_t], dim=-1)
        chosen_lp = lp.gather(1, torch.tensor([tokens[i] for i in want], device=logits.device).view(-1, 1))
        for i, value in zip(want, chosen_lp.view(-1).tolist()):
            logprobs[i] = value
    return tokens, logprobs


def long_rows(rows: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.long, device=device)
