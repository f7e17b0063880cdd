"""A step's token budget from a TPOT target (#49): Sarathi-Serve's stall-free batching, with the budget chosen per
step from the executor's own step-time model instead of fixed.

Without targets every step may compute ``--max-num-batched-tokens`` tokens: a step that carries decode rows and a
full budget of prefill chunks runs as long as the prefill makes it, and every running request's next token waits
for it (TPOT), as does every request that arrives meanwhile (TTFT: it joins the next step at the earliest).

``--target-tpot-ms T``: a step that carries decode rows takes only the prefill tokens that the step-time model
(plan_clock.StepClock: seconds against tokens, rows and attention pairs, fitted to this executor's recent steps)
predicts fit in T beside those decodes, and at least one page's worth (``block_size`` tokens), so that a prefill
always advances. A step with no decode row protects nothing and takes the full budget, as does every step until
the model has seen enough steps to predict.

``--target-ttft-ms F`` (with a TPOT target): a step takes the full budget when a request still without its first
token (waiting, or in the middle of its prefill) has waited F since it was received: first tokens over smooth
decoding, once they are late.

The prediction is for one more chunk at the context of the next prefill to run (a running request's, else 0: a
prefix-cache hit only makes it cheaper); a step that computes several prompts' chunks is predicted a little high.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable

from scheduler_svc import metrics
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.plan_clock import StepClock
from scheduler_svc.request import Request


def step_budget(clock: StepClock | None, config: SchedulerConfig, running: list[Request],
                waiting: Iterable[Request], block_size: int) -> int:
    """The most tokens the next step may compute (``config.max_num_batched_tokens`` without a TPOT target)."""
    full = config.max_num_batched_tokens
    if not config.target_tpot_s or clock is None:
        return full
    coef = clock.unit_costs()
    if coef is None:
        return full
    decodes = pairs = 0
    context = -1  # the next prefill's cached tokens (-1: no running request is mid-prefill)
    for req in running:
        left = req.num_uncomputed
        if left == 1:
            decodes += 1
            pairs += req.num_computed + 1
        elif left > 1 and context < 0:
            context = req.num_computed
    if not decodes or (config.target_ttft_s and _first_token_late(running, waiting, config.target_ttft_s)):
        return full
    per_step, per_token, per_row, per_pair = coef
    room = config.target_tpot_s - (per_step + (per_token + per_row) * decodes + per_pair * pairs) - per_row
    tokens = _tokens_within(room, max(per_token, 0.0), max(per_pair, 0.0), max(context, 0))
    budget = min(full, decodes + max(block_size, tokens))
    metrics.STEP_TOKEN_BUDGET.observe(budget)
    return budget


def _tokens_within(room: float, per_token: float, per_pair: float, context: int) -> int:
    """The most tokens n of one chunk over ``context`` cached tokens whose cost, n * per_token + per_pair * n *
    (context + (n - 1) / 2), stays within ``room`` seconds."""
    if room <= 0:
        return 0
    a = per_pair / 2  # a n^2 + b n <= room
    b = per_token + per_pair * (context - 0.5)
    if a <= 0:
        return int(room / b) if b > 0 else 1 << 30
    return max(0, int((-b + math.sqrt(b * b + 4 * a * room)) / (2 * a)))


def _first_token_late(running: list[Request], waiting: Iterable[Request], after_s: float) -> bool:
    """A request without its first token, waiting or mid-prefill, was received ``after_s`` or more ago."""
    cutoff = time.perf_counter() - after_s
    for req in running:
        if req.num_uncomputed > 1 and not req.output_ids and 0 < req.trace.received <= cutoff:
            return True
    return any(0 < req.trace.received <= cutoff for req in waiting)
