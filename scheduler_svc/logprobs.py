"""Log-probabilities on the scheduler's side: the most likely tokens of each sample, split from a step's result by
row (``sampled_tops``), and a request's prompt log-probabilities gathered over the steps that compute its prompt
(``PromptLogprobs``: chunks of a long prompt, a recompute after a preemption, another executor after a move) until
every prompt token after the first has one; the result's lists checked first (``malformed``).

Log-probabilities are the executor's: those of the model's raw distribution (executor_svc/sampler.py)."""

from __future__ import annotations

from collections.abc import Sequence

from pagedkv.api.v1 import api_pb2 as api

TopEntry = tuple[Sequence[int], Sequence[float]]  # a position's most likely token ids and their log-probabilities
NO_TOP: TopEntry = ((), ())


class PromptLogprobs:
    """A request's prompt log-probabilities: ``logprobs[i]`` is prompt token i + 1's, ``top[i]`` its ``k`` most likely
    tokens there (k > 0), gathered as results come (``add``, outputs.py) until ``complete``. While not complete the
    request computes its prompt with no prefix-cache hit, so that every position's logits are computed."""

    __slots__ = ("k", "logprobs", "ranks", "top", "missing")

    def __init__(self, num_prompt: int, k: int) -> None:
        self.k = k
        self.logprobs: list[float | None] = [None] * (num_prompt - 1)
        self.ranks = [0] * (num_prompt - 1)
        self.top: list[TopEntry] = [NO_TOP] * (num_prompt - 1) if k else []
        self.missing = num_prompt - 1

    @property
    def complete(self) -> bool:
        return not self.missing

    def add(self, first_token: int, logprobs: Sequence[float], top_ids: Sequence[int],
            top_logprobs: Sequence[float], ranks: Sequence[int] = ()) -> bool:
        """A run of prompt tokens' log-probabilities from ``first_token`` on (a StepResult's entry, checked by
        ``malformed``); returns whether this completed them. Tokens already held (computed again after a
        recompute, or by a plan in flight when the request moved) keep their first values: each is counted once."""
        if not self.missing:
            return False
        k, held = self.k, self.logprobs
        for i, value in enumerate(logprobs):
            at = first_token - 1 + i
            if at >= len(held) or held[at] is not None:
                continue
            held[at] = value
            if ranks:
                self.ranks[at] = ranks[i]
            if k:
                self.top[at] = (tuple(top_ids[i * k:(i + 1) * k]), tuple(top_logprobs[i * k:(i + 1) * k]))
            self.missing -= 1
        return not self.missing

    def write(self, prompt: api.Prompt) -> None:
        """Into a GenerateResponse's prompt (once complete)."""
        prompt.logprobs.extend(self.logprobs)
        prompt.ranks.extend(self.ranks)
        for ids, values in self.top:
            prompt.top_logprobs.add(token_ids=ids, logprobs=values)


def sampled_tops(result, top_ks: Sequence[int]) -> dict[int, TopEntry]:
    """Each sampled row's most likely tokens (``result``: a StepResult whose sampled_top_* lists are not empty,
    checked by ``malformed``; ``top_ks[row]``: the row's request's top_logprobs), by plan row."""
    ids, values = result.sampled_top_token_ids, result.sampled_top_logprobs
    out, at = {}, 0
    for row in result.sampled_rows:
        k = top_ks[row]
        if k:
            out[row] = (ids[at:at + k], values[at:at + k])
            at += k
    return out


def malformed(result, top_ks: Sequence[int], prompt_ks: Sequence[int | None], prompt_lens: Sequence[int],
              vocab_size: int = 0) -> str:
    """Why the log-probabilities of ``result`` (a StepResult whose sampled rows are checked) cannot be its plan's, or
    ''. Per plan row: ``top_ks`` its request's top_logprobs, ``prompt_ks`` its prompt_logprobs (None: it asked for
    none), ``prompt_lens`` its prompt's length. The top lists must hold k entries for each sample whose request asks,
    token ids in [0, vocab_size) when that is known; a prompt entry must be for a row that asks, within its prompt,
    with k top entries per token."""
    ids, values = result.sampled_top_token_ids, result.sampled_top_logprobs
    if ids or values:
        want = sum(top_ks[row] for row in result.sampled_rows)
        if not len(ids) == len(values) == want:
            return (f"sampled_top_token_ids / sampled_top_logprobs: {len(ids)} / {len(values)} entries; the samples' "
                    f"top_logprobs ask for {want}")
    every = [ids, *(e.top_token_ids for e in result.prompt_logprobs)]
    if any(t and (min(t) < 0 or (vocab_size and max(t) >= vocab_size)) for t in every):
        return f"top token ids: one outside the vocabulary [0, {vocab_size or 'its size'})"
    for entry in result.prompt_logprobs:
        row = entry.row
        if row >= len(prompt_ks) or prompt_ks[row] is None:
            return f"prompt_logprobs: row {row} did not ask for prompt log-probabilities"
        n, k = len(entry.logprobs), prompt_ks[row]
        if not (1 <= entry.first_token and entry.first_token + n <= prompt_lens[row]):
            return (f"prompt_logprobs: tokens {entry.first_token} to {entry.first_token + n - 1} of row {row} are not "
                    f"in its prompt's [1, {prompt_lens[row] - 1}]")
        if not len(entry.top_token_ids) == len(entry.top_logprobs) == n * k:
            return f"prompt_logprobs: row {row} has {len(entry.top_token_ids)} top entries for {n} tokens x {k}"
        if len(entry.ranks) not in (0, n):
            return f"prompt_logprobs: row {row} has {len(entry.ranks)} ranks for {n} tokens"
    return ""
