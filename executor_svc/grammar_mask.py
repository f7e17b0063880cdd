"""A step's grammar masks applied to its logits (structured outputs; the masks come from executor_svc/grammar.py).

xgrammar packs a row's allowed tokens as int32 words, token t at bit t % 32 of word t // 32: on a little-endian
machine that is bit t % 8 of byte t // 8, which is how they are unpacked here, every constrained row at once (a
batched torch op on the logits' device; xgrammar's own CPU apply loops per row and costs ~10x more at 256 x 49k).
"""

from __future__ import annotations

import sys
from typing import NamedTuple

import torch

from executor_svc.tensors import long_tensor

assert sys.byteorder == "little", "the bitmask is unpacked byte by byte"


class GrammarMask(NamedTuple):
    rows: list[int]  # the constrained rows of the step's sampled logits, ascending
    bitmask: torch.Tensor  # [len(rows), ceil(V / 32)] int32 on the CPU: xgrammar's packed allowed tokens


_BITS: dict[torch.device, torch.Tensor] = {}


def allowed(bitmask: torch.Tensor, vocab: int, device: torch.device) -> torch.Tensor:
    """[R, vocab] bool: the tokens each row of ``bitmask`` allows."""
    return ~refused(bitmask, vocab, device)


def refused(bitmask: torch.Tensor, vocab: int, device: torch.device) -> torch.Tensor:
    """[R, vocab] bool: the tokens each row of ``bitmask`` does not allow (one pass over the output)."""
    bits = _BITS.get(device)
    if bits is None:
        bits = _BITS[device] = (1 << torch.arange(8, dtype=torch.int32)).to(torch.uint8).to(device).view(1, 1, 8)
    packed = bitmask.to(device, non_blocking=True).view(torch.uint8)  # [R, 4 * words]
    return ((packed.unsqueeze(-1) & bits) == 0).view(len(bitmask), -1)[:, :vocab]


def _cpu_op():
    """``torch.ops.pagedkv_cpu.grammar_mask`` (executor_svc/model/cpu_ops.cpp: one pass a row, in C++), or None where
    the CPU kernel library is not built (the torch path below is then the one, and stays the reference)."""
    if "op" not in _CPU:
        from executor_svc.attention import cpu_kernel

        ops = cpu_kernel.load()
        _CPU["op"] = getattr(ops, "grammar_mask", None) if ops is not None else None
    return _CPU["op"]


_CPU: dict[str, object] = {}


def constrain(logits: torch.Tensor, raw: torch.Tensor, mask: GrammarMask, keep_raw: bool = True) -> torch.Tensor:
    """``logits`` [B, V] (the step's, after the other controls) with every token a constrained row's grammar does
    not allow at -inf; the other rows untouched. A constrained row that the other controls left with no token its
    grammar allows (say min_tokens masking EOS where the grammar must end) takes its raw logits under the grammar
    alone: the constraint wins. ``logits`` is changed in place unless it is ``raw`` (the model's, kept for the
    log-probabilities) and ``keep_raw`` (some constrained row wants its log-probabilities): then only the masked
    rows are new, or a copy when some rows are not constrained."""
    adjusted = logits is not raw  # (only the other controls can leave a row with nothing the grammar allows)
    in_place = adjusted or not keep_raw
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and (op := _cpu_op()) is not None:
        return _constrain_cpu(op, logits, raw, mask, adjusted, in_place)
    out = refused(mask.bitmask, logits.shape[-1], logits.device)
    every = len(mask.rows) == len(logits)
    idx = None if every else long_tensor(mask.rows, logits.device)
    picked = logits if every else logits[idx]
    masked = picked.masked_fill(out, float("-inf"))
    if adjusted:
        empty = ~(masked.amax(-1) > float("-inf"))
        if bool(empty.any()):
            alone = (raw if every else raw[idx]).masked_fill(out, float("-inf"))
            masked = torch.where(empty.view(-1, 1), alone, masked)
    if every:
        return masked
    if not in_place:
        logits = logits.clone()
    logits[idx] = masked
    return logits


def _constrain_cpu(op, logits: torch.Tensor, raw: torch.Tensor, mask: GrammarMask, adjusted: bool,
                   in_place: bool) -> torch.Tensor:
    """constrain() through the C++ op: the masked rows written in one pass, in place when the logits are the step's
    own copy or nothing needs the raw rows any more, else into a new tensor (the other rows copied)."""
    logits, raw = logits.contiguous(), raw.contiguous()
    rows = torch.tensor(mask.rows, dtype=torch.long)
    bitmask = mask.bitmask.contiguous()
    if in_place:
        out = logits
    else:
        out = torch.empty_like(logits) if len(mask.rows) == len(logits) else logits.clone()
    empty = op(logits, out, rows, bitmask)
    if adjusted and bool(empty.any()):  # the grammar alone where the other controls left it nothing
        again = empty.nonzero().view(-1)
        op(raw, out, rows[again], bitmask[again].contiguous())
    return out
