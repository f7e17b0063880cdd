"""Sampling: greedy, temperature, top-k, top-p, with a per-request seed stream.

Draw number i of a request inverts its filtered distribution (in token order) at a uniform number made from
(seed, i) alone, so what a request samples depends neither on the other requests in the batch nor on whether it
was preempted and recomputed or migrated: the same seed gives the same tokens. Every row of a step is sampled at
once (batched torch ops, no loop over rows).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from executor_svc.tensors import long_tensor

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
    definition of the filters, one row at a time (``thresholds`` applies them to a batch). Each filter is a cut
    by value, so tokens tied at a cut are all kept (which of equal logits comes first never matters):

    - top-k keeps the logits >= the k-th largest;
    - top-p then keeps the logits >= the smallest one of the shortest run of largest (kept) logits whose
      probability reaches top_p."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        values = torch.sort(logits, descending=True).values
        probs = torch.softmax(values, dim=-1)
        kept = int((probs.cumsum(-1) - probs < top_p).sum())  # before it, less than top_p: kept
        logits = logits.masked_fill(logits < values[max(kept, 1) - 1], float("-inf"))
    return logits


# Top-p looks for its cut among this many largest logits of a row first (a partial selection: sorting every row
# whole costs ~30x more on the CPU); a row whose cut lies past them is sorted whole.
CANDIDATES = 256


def thresholds(scaled: torch.Tensor, top_k: list[int], top_p: list[float],
               candidates: int | None = None) -> torch.Tensor:
    """scaled [S, V] (logits already divided by each row's temperature) -> [S, 1]: the smallest logit each row
    keeps under its top-k then top-p filter (``filter_logits``; -inf: no filter). The cuts are computed from the
    rows' largest values alone (``torch.topk(...).values``, the same whatever the order of ties and however many
    are asked for), so a row's threshold depends on the row and its parameters, never on the batch."""
    rows, vocab = scaled.shape
    device = scaled.device
    ks = [k if 0 < k < vocab else 0 for k in top_k]
    wants_p = [p < 1.0 for p in top_p]
    # (top-p after a top-k cuts inside the top k, ties apart: a top-k row needs no more candidates than its k)
    only_p = any(w and not k for k, w in zip(ks, wants_p))
    width = min(vocab, max(1, max(ks), (candidates or CANDIDATES) if only_p else 0))
    values = torch.topk(scaled, width, dim=-1).values
    has_k = torch.tensor([k > 0 for k in ks], device=device).view(-1, 1)
    kth = values.gather(1, torch.tensor([max(k, 1) - 1 for k in ks], device=device).view(-1, 1))
    kth = torch.where(has_k, kth, torch.full_like(kth, float("-inf")))
    if not any(wants_p):
        return kth
    norm = torch.logsumexp(scaled.masked_fill(scaled < kth, float("-inf")), -1, keepdim=True)  # of what top-k kept
    probs = torch.exp(values.masked_fill(values < kth, float("-inf")) - norm)
    cum = probs.cumsum(-1)
    p = torch.tensor(top_p, dtype=probs.dtype, device=device).view(-1, 1)
    kept = (cum - probs < p).sum(-1, keepdim=True).clamp_(min=1)  # the shortest run reaching top_p
    cut = torch.maximum(kth, values.gather(1, kept - 1))
    wants = torch.tensor(wants_p, device=device).view(-1, 1)
    short = wants & (cum[:, -1:] < p)  # the run reaches past the candidates (or ties at the k-th): sort whole
    if width < vocab and bool(short.any()):
        idx = short.view(-1).nonzero().view(-1)
        sub = idx.tolist()
        cut[idx] = thresholds(scaled[idx], [ks[i] for i in sub], [top_p[i] for i in sub], candidates=vocab)
    return torch.where(wants, cut, kth)


def _draw(scaled: torch.Tensor, threshold: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """[S] token ids: each row's logits >= its threshold, weighted by their probability, in token order; the
    token where the cumulative weights (float64) first exceed u x their total. The target stays below the total,
    so the token found always has a weight (never a filtered one). A row with no finite weight: its argmax."""
    top = scaled.amax(-1, keepdim=True)
    weights = torch.exp((scaled - top).masked_fill(scaled < threshold, float("-inf"))).to(torch.float64)
    weights = torch.nan_to_num_(weights, nan=0.0, posinf=0.0)
    cdf = weights.cumsum_(-1)
    total = cdf[:, -1:]
    target = torch.minimum(u.to(torch.float64) * total, torch.nextafter(total, torch.zeros_like(total)))
    at = torch.searchsorted(cdf, target, right=True).clamp_(max=cdf.shape[-1] - 1).view(-1)
    bad = ~(total.view(-1) > 0)
    if bool(bad.any()):
        at = torch.where(bad, scaled.argmax(-1), at)
    return at


def sample_one(logits: torch.Tensor, params: SamplingParams, draw: int) -> int:
    """One row's token: what ``sample`` draws for it in any batch."""
    return sample(logits.view(1, -1), [params], [draw])[0][0]


def sample(logits: torch.Tensor, params: list[SamplingParams], draws: list[int]) -> tuple[list[int], list[float]]:
    """logits [B, V] fp32 -> (token ids, log-probabilities under the model's raw distribution).

    Greedy rows take the argmax. The others, all at once: divided by their temperature, cut by their top-k and
    top-p (``thresholds``), and drawn by inverting the cumulative distribution, in token order, at
    ``uniform(seed, draw)`` (``_draw``): the token depends on the row's logits, seed and draw number alone, never
    on the batch."""
    # (max's indices: argmax's, the first maximal value of each row, NaN included; on the CPU ~2.5x faster)
    greedy = logits.max(dim=-1).indices.tolist()
    tokens = greedy
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        device = logits.device
        vocab = logits.shape[-1]
        picked = [params[i] for i in rows]
        temps = torch.tensor([p.temperature for p in picked], dtype=logits.dtype, device=device).view(-1, 1)
        scaled = (logits if len(rows) == len(params) else logits[long_tensor(rows, device)]) / temps
        if any(0 < p.top_k < vocab or p.top_p < 1.0 for p in picked):
            threshold = thresholds(scaled, [p.top_k for p in picked], [p.top_p for p in picked])
        else:
            threshold = torch.full((len(rows), 1), float("-inf"), dtype=scaled.dtype, device=device)
        u = torch.tensor([uniform(p.seed, draws[i]) for p, i in zip(picked, rows)], dtype=torch.float64,
                         device=device).view(-1, 1)
        tokens = list(greedy)
        for i, token in zip(rows, _draw(scaled, threshold, u).tolist()):
            tokens[i] = token
    logprobs = [0.0] * len(tokens)
    want = [i for i, p in enumerate(params) if p.logprobs]
    if want:
        lp = torch.log_softmax(logits[long_tensor(want, logits.device)], dim=-1)
        chosen_lp = lp.gather(1, long_tensor([tokens[i] for i in want], logits.device).view(-1, 1))
        for i, value in zip(want, chosen_lp.view(-1).tolist()):
            logprobs[i] = value
    return tokens, logprobs
