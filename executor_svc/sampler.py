"""Sampling: greedy, temperature, min-p, top-k, top-p, with a per-request seed stream; before them the logits
controls (``adjust_logits``): allowed_token_ids, bad_words, min_tokens, logit_bias, and the repetition, frequency and
presence penalties. Log-probabilities (``token_logprobs``: the sampled token's, its most likely alternatives, and a
prompt's) are those of the model's raw distribution, before any of them (vLLM's default, raw_logprobs).

Draw number i of a request inverts its filtered distribution (in token order) at a uniform number made from
(seed, i) alone, so what a request samples depends neither on the other requests in the batch nor on whether it
was preempted and recomputed or migrated: the same seed gives the same tokens. Every row of a step is sampled at
once (batched torch ops, no loop over rows).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from executor_svc.grammar_mask import GrammarMask, constrain
from executor_svc.tensors import long_tensor

_MASK64 = (1 << 64) - 1
# Temperatures below this sample greedily (as vLLM does): dividing logits by a tiny temperature overflows to
# inf, softmax turns inf - inf into NaN, and the draw then always picks token 0.
GREEDY_TEMPERATURE = 1e-5


class History(NamedTuple):
    """The tokens of the penalised rows of a step (``TokenCounts.history``): one entry per (row, token) for each
    token in the row's prompt or output; rows are numbered among the penalised rows."""

    rows: torch.Tensor  # [N] long
    tokens: torch.Tensor  # [N] long
    output_counts: torch.Tensor  # [N] int: how often the row's output holds the token (0: in the prompt only)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    logprobs: bool = False
    presence_penalty: float = 0.0  # subtracted once from each token the output holds (vLLM, OpenAI)
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output
    repetition_penalty: float = 1.0  # divides a positive logit, multiplies a negative one, of each token in
    #                                  prompt + output (transformers' RepetitionPenaltyLogitsProcessor, vLLM)
    min_p: float = 0.0  # tokens less probable than min_p x the most probable one are cut (after temperature)
    min_tokens: int = 0  # until this many tokens are drawn, min_tokens_stop_ids are masked
    min_tokens_stop_ids: tuple[int, ...] = ()  # (EOS unless ignore_eos, and the stop token ids: the scheduler's)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, value added to its logit)
    allowed_token_ids: tuple[int, ...] = ()  # (): every token
    bad_words: tuple[tuple[int, ...], ...] = ()  # token sequences whose last token is masked after the others
    top_logprobs: int = 0  # the most likely tokens returned beside the sampled one (their raw log-probabilities)
    prompt_logprobs: bool = False  # the prompt tokens' log-probabilities (the runner's prompt rows)
    prompt_top_logprobs: int = 0  # and this many most likely tokens at each prompt position
    penalised: bool = field(init=False, default=False)  # a penalty is set: the row needs its token counts
    adjusts: bool = field(init=False, default=False)  # ``adjust_logits`` changes the row

    def __post_init__(self) -> None:
        penalised = self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1
        object.__setattr__(self, "penalised", penalised)
        object.__setattr__(self, "adjusts", penalised or bool(self.logit_bias or self.allowed_token_ids
                                                              or self.bad_words)
                           or (self.min_tokens > 0 and bool(self.min_tokens_stop_ids)))

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


def banned_by_bad_words(bad_words: tuple[tuple[int, ...], ...], output: Sequence[int]) -> list[int]:
    """The tokens ``bad_words`` mask after ``output`` (vLLM's rule): each word's last token, when the output ends
    with the word's other tokens (a one-token word: always)."""
    banned = []
    for word in bad_words:
        prefix = len(word) - 1
        if prefix == 0 or (prefix <= len(output) and list(output[len(output) - prefix:]) == list(word[:-1])):
            banned.append(word[-1])
    return banned


def adjust_logits(logits: torch.Tensor, params: list[SamplingParams], draws: list[int],
                  history: History | None = None,
                  outputs: Callable[[int, int], Sequence[int]] | None = None) -> torch.Tensor:
    """logits [B, V] with each row's controls applied, in vLLM's order: allowed_token_ids (every other token at
    -inf), bad_words (``banned_by_bad_words`` at -inf; ``outputs(row, n)``: the last n tokens of the row's output),
    min_tokens (its stop ids at -inf while fewer than min_tokens tokens are drawn), logit_bias (added), then the
    penalties. The rows that set none are left as they are, and when no row sets any the logits themselves are
    returned (no copy).

    ``history``: the penalised rows' tokens (``SamplingParams.penalised``; rows numbered among them, in row
    order), one entry per token in a row's prompt or output: repetition_penalty applies to each, frequency and
    presence to those whose output count is not 0 (as vLLM defines each). Only those entries are touched."""
    rows = [i for i, p in enumerate(params) if p.adjusts]
    if not rows:
        return logits
    logits = logits.clone()  # (the raw logits stay: log-probabilities are the model's)
    device = logits.device
    masked_rows, masked_ids, bias_rows, bias_ids, bias_values = [], [], [], [], []
    allowed = [i for i in rows if params[i].allowed_token_ids]
    if allowed:
        keep = torch.zeros(len(allowed), logits.shape[-1], dtype=torch.bool, device=device)
        keep[long_tensor([j for j, i in enumerate(allowed) for _ in params[i].allowed_token_ids], device),
             long_tensor([t for i in allowed for t in params[i].allowed_token_ids], device)] = True
        idx = long_tensor(allowed, device)
        logits[idx] = logits[idx].masked_fill(~keep, float("-inf"))
    for i in rows:
        p = params[i]
        if p.bad_words:
            assert outputs is not None, "bad words need the rows' outputs"
            banned = banned_by_bad_words(p.bad_words, outputs(i, max(len(w) for w in p.bad_words) - 1))
            masked_rows += [i] * len(banned)
            masked_ids += banned
        if draws[i] < p.min_tokens:
            masked_rows += [i] * len(p.min_tokens_stop_ids)
            masked_ids += p.min_tokens_stop_ids
        for token, value in p.logit_bias:
            bias_rows.append(i)
            bias_ids.append(token)
            bias_values.append(value)
    if masked_rows:
        logits[long_tensor(masked_rows, device), long_tensor(masked_ids, device)] = float("-inf")
    if bias_rows:
        logits.index_put_((long_tensor(bias_rows, device), long_tensor(bias_ids, device)),
                          torch.tensor(bias_values, dtype=logits.dtype, device=device), accumulate=True)
    penalised = [i for i in rows if params[i].penalised]
    if penalised:
        assert history is not None, "penalised rows need their token history"
        picked = [params[i] for i in penalised]

        def per_entry(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=logits.dtype, device=device)[history.rows]

        at = (long_tensor(penalised, device)[history.rows], history.tokens)
        value = logits[at]
        rep = per_entry([p.repetition_penalty for p in picked])
        value = torch.where(value > 0, value / rep, value * rep)  # (transformers' RepetitionPenaltyLogitsProcessor)
        count = history.output_counts.to(logits.dtype)
        value = (value - per_entry([p.frequency_penalty for p in picked]) * count
                 - per_entry([p.presence_penalty for p in picked]) * (count > 0).to(logits.dtype))
        logits[at] = value
    return logits


def min_p_cut(scaled: torch.Tensor, min_p: list[float]) -> torch.Tensor:
    """scaled [S, V] (divided by temperature) with the tokens less probable than min_p x the row's most probable
    one at -inf, computed as transformers' MinPLogitsWarper does (on probabilities; the most probable token is
    always kept). min_p 0: nothing cut."""
    probs = torch.softmax(scaled, dim=-1)
    cut = torch.tensor(min_p, dtype=probs.dtype, device=scaled.device).view(-1, 1) * probs.amax(-1, keepdim=True)
    return scaled.masked_fill(probs < cut, float("-inf"))


class TokenLogprobs(NamedTuple):
    """Per row: the log-probability of a given token, and the row's most likely tokens (ids and log-probabilities,
    most likely first; as many as the row asked for, none for a row that asked for none); with ``ranks``, the given
    token's rank (1 + the tokens more likely than it)."""

    logprobs: list[float]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]
    ranks: list[int] | None = None


def token_logprobs(raw: torch.Tensor, targets: list[int], ks: list[int], ranks: bool = False) -> TokenLogprobs:
    """raw [R, V] logits (fp32) -> each row's log-probability of ``targets[i]`` and its ``ks[i]`` most likely tokens,
    under log_softmax over the whole vocabulary (``ranks``: and the target's rank). One log_softmax for the rows, one
    topk (of the largest k) for the rows with k > 0; a row's top tokens are the first k of it (topk is sorted), so
    they do not depend on the batch (which of two exactly equal log-probabilities comes first aside)."""
    device = raw.device
    lp = torch.log_softmax(raw, dim=-1)
    at = lp.gather(1, long_tensor(targets, device).view(-1, 1))
    chosen = at.view(-1).tolist()
    rank = (lp > at).sum(-1).add_(1).tolist() if ranks else None
    k = min(max(ks, default=0), raw.shape[-1])
    if not k:
        return TokenLogprobs(chosen, [[] for _ in targets], [[] for _ in targets], rank)
    asking = [i for i, n in enumerate(ks) if n]
    top = torch.topk(lp if len(asking) == len(ks) else lp[long_tensor(asking, device)], k, dim=-1)
    ids, values = [[] for _ in targets], [[] for _ in targets]
    for i, row_ids, row_values in zip(asking, top.indices.tolist(), top.values.tolist()):
        ids[i], values[i] = row_ids[:ks[i]], row_values[:ks[i]]
    return TokenLogprobs(chosen, ids, values, rank)


class Sampled(NamedTuple):
    """What ``sample`` drew: per row its token, that token's raw log-probability (0.0 for a row that asked for none),
    and (``top``, None when no row asked) each row's most likely tokens, its top_logprobs of them."""

    tokens: list[int]
    logprobs: list[float]
    top: TokenLogprobs | None = None


def sample_one(logits: torch.Tensor, params: SamplingParams, draw: int) -> int:
    """One row's token: what ``sample`` draws for it in any batch."""
    return sample(logits.view(1, -1), [params], [draw]).tokens[0]


def sample(logits: torch.Tensor, params: list[SamplingParams], draws: list[int], history: History | None = None,
           outputs: Callable[[int, int], Sequence[int]] | None = None, *,
           grammar: GrammarMask | None = None) -> Sampled:
    """logits [B, V] fp32 -> token ids and, for the rows that ask (logprobs, top_logprobs), log-probabilities under the
    model's raw distribution (``token_logprobs`` of the logits as they came, before any control, grammar or
    temperature).

    The rows' controls first (``adjust_logits``; ``history``: the penalised rows' tokens; ``outputs``: the rows'
    recent output tokens, for bad words), then the constrained rows' grammar masks (``grammar``: structured outputs,
    grammar_mask.constrain). Greedy rows take the
    argmax. The others, all at once: divided by their temperature, cut by their min-p (before top-k and top-p, as
    vLLM does), top-k and top-p (``thresholds``), and drawn by inverting the cumulative distribution, in token
    order, at ``uniform(seed, draw)`` (``_draw``): the token depends on the row's logits, seed and draw number
    alone, never on the batch."""
    raw = logits
    logits = adjust_logits(logits, params, draws, history, outputs)
    if grammar is not None:  # (raw's constrained rows kept only for those that want their log-probabilities)
        logits = constrain(logits, raw, grammar,
                           keep_raw=any(params[r].logprobs or params[r].top_logprobs for r in grammar.rows))
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
        if any(p.min_p > 0 for p in picked):
            scaled = min_p_cut(scaled, [p.min_p for p in picked])
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
    want = [i for i, p in enumerate(params) if p.logprobs or p.top_logprobs]
    if not want:
        return Sampled(tokens, logprobs)
    got = token_logprobs(raw if len(want) == len(params) else raw[long_tensor(want, raw.device)],
                         [tokens[i] for i in want], [params[i].top_logprobs for i in want])
    for i, value in zip(want, got.logprobs):
        logprobs[i] = value
    if not any(p.top_logprobs for p in params):
        return Sampled(tokens, logprobs)
    if len(want) == len(params):  # (every row asked: got is by row already)
        return Sampled(tokens, logprobs, got)
    top_ids, top_logprobs = [[] for _ in tokens], [[] for _ in tokens]
    for i, ids, values in zip(want, got.top_ids, got.top_logprobs):
        top_ids[i], top_logprobs[i] = ids, values
    return Sampled(tokens, logprobs, TokenLogprobs(logprobs, top_ids, top_logprobs))
