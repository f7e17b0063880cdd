"""Per-request token counts for the sampler's penalties, as rows of one device tensor.

A request that sets a penalty gets a row (a slot) the first time it samples: for each token, 2 x how often its output
holds it, plus 1 when its prompt does (``counts`` [slots, V] int32; 0: neither), built from the tokens the executor's
mirror holds for it (prompt, then its ``num_output`` sampled tokens). A request resent in full (a resume, a migration,
a plan refused) gets a new RequestState, so a new slot built from the tokens the plan carries. Each step's penalised
rows are read at once, as the sparse entries the sampler touches (``history``), and their sampled tokens counted at
once (``add``).
"""

from __future__ import annotations

import torch

from executor_svc.sampler import History
from executor_svc.tensors import long_tensor

INITIAL_SLOTS = 16
IN_PROMPT, PER_OUTPUT = 1, 2  # a slot's value for a token: PER_OUTPUT x its output count + IN_PROMPT if in the prompt


class TokenCounts:
    def __init__(self) -> None:
        self.counts: torch.Tensor | None = None  # [slots, V] int32
        self.free: list[int] = []

    def _grow(self, vocab: int, device: torch.device) -> None:
        if self.counts is None:
            self.counts = torch.zeros(INITIAL_SLOTS, vocab, dtype=torch.int32, device=device)
            self.free = list(range(INITIAL_SLOTS - 1, -1, -1))
            return
        if self.counts.shape[1] != vocab or self.counts.device != device:
            raise ValueError(f"token counts hold rows of {self.counts.shape[1]} tokens on {self.counts.device}; "
                             f"asked for {vocab} on {device}")
        n = len(self.counts)
        self.counts = torch.cat([self.counts, torch.zeros_like(self.counts)])
        self.free = list(range(2 * n - 1, n - 1, -1))

    def assign(self, token_ids: list[int], num_output: int, vocab: int, device: torch.device) -> int:
        """A slot holding the counts of ``token_ids``: the last ``num_output`` are the output, the rest the prompt."""
        if not self.free or self.counts is None:
            self._grow(vocab, device)
        slot = self.free.pop()
        split = len(token_ids) - num_output
        row = self.counts[slot]
        row.zero_()
        row[long_tensor(token_ids[:split], device)] = IN_PROMPT
        out = long_tensor(token_ids[split:], device)
        row.index_add_(0, out, torch.full_like(out, PER_OUTPUT, dtype=torch.int32))
        return slot

    def release(self, slot: int) -> None:
        self.free.append(slot)

    def release_all(self) -> None:
        self.free = list(range(len(self.counts) - 1, -1, -1)) if self.counts is not None else []

    def history(self, slots: list[int]) -> History:
        """The entries of ``slots`` (rows numbered by their place in ``slots``) for the sampler's penalties."""
        block = self.counts.index_select(0, long_tensor(slots, self.counts.device))
        rows, tokens = block.nonzero(as_tuple=True)
        return History(rows, tokens, block[rows, tokens] // PER_OUTPUT)

    def add(self, slots: list[int], tokens: list[int]) -> None:
        """One more occurrence in the output of each ``tokens[i]`` for ``slots[i]``."""
        device = self.counts.device
        self.counts.index_put_((long_tensor(slots, device), long_tensor(tokens, device)),
                               torch.full((len(slots),), PER_OUTPUT, dtype=torch.int32, device=device),
                               accumulate=True)
