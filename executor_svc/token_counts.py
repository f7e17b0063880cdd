"""Per-request token counts for the sampler's penalties, as rows of two device tensors.

A request that sets a penalty gets a row (a slot) the first time it samples: how often each token is in its output
(``output`` [slots, V] int32) and whether it is in its prompt (``prompt`` [slots, V] bool), built from the tokens the
executor's mirror holds for it (prompt, then its ``num_output`` sampled tokens). A request resent in full (a resume, a
migration, a plan refused) gets a new RequestState, so a new slot built from the tokens the plan carries. Each step's
penalised rows are gathered at once (``rows``) and their sampled tokens counted at once (``add``).
"""

from __future__ import annotations

import torch

from executor_svc.tensors import long_tensor

INITIAL_SLOTS = 16


class TokenCounts:
    def __init__(self) -> None:
        self.output: torch.Tensor | None = None  # [slots, V] int32: occurrences in the output
        self.prompt: torch.Tensor | None = None  # [slots, V] bool: in the prompt
        self.free: list[int] = []

    def _grow(self, vocab: int, device: torch.device) -> None:
        if self.output is None:
            self.output = torch.zeros(INITIAL_SLOTS, vocab, dtype=torch.int32, device=device)
            self.prompt = torch.zeros(INITIAL_SLOTS, vocab, dtype=torch.bool, device=device)
            self.free = list(range(INITIAL_SLOTS - 1, -1, -1))
            return
        if self.output.shape[1] != vocab or self.output.device != device:
            raise ValueError(f"token counts hold rows of {self.output.shape[1]} tokens on {self.output.device}; "
                             f"asked for {vocab} on {device}")
        n = len(self.output)
        self.output = torch.cat([self.output, torch.zeros_like(self.output)])
        self.prompt = torch.cat([self.prompt, torch.zeros_like(self.prompt)])
        self.free = list(range(2 * n - 1, n - 1, -1))

    def assign(self, token_ids: list[int], num_output: int, vocab: int, device: torch.device) -> int:
        """A slot holding the counts of ``token_ids``: the last ``num_output`` are the output, the rest the prompt."""
        if not self.free or self.output is None:
            self._grow(vocab, device)
        slot = self.free.pop()
        split = len(token_ids) - num_output
        self.prompt[slot] = False
        self.prompt[slot, long_tensor(token_ids[:split], device)] = True
        self.output[slot] = 0
        out = long_tensor(token_ids[split:], device)
        self.output[slot].index_add_(0, out, torch.ones_like(out, dtype=torch.int32))
        return slot

    def release(self, slot: int) -> None:
        self.free.append(slot)

    def release_all(self) -> None:
        self.free = list(range(len(self.output) - 1, -1, -1)) if self.output is not None else []

    def rows(self, slots: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(output counts [P, V], prompt mask [P, V]) of ``slots``, in order (copies)."""
        idx = long_tensor(slots, self.output.device)
        return self.output.index_select(0, idx), self.prompt.index_select(0, idx)

    def add(self, slots: list[int], tokens: list[int]) -> None:
        """One more occurrence in the output of each ``tokens[i]`` for ``slots[i]``."""
        device = self.output.device
        self.output.index_put_((long_tensor(slots, device), long_tensor(tokens, device)),
                               torch.ones(len(slots), dtype=torch.int32, device=device), accumulate=True)
