"""A step's requests (``plan_check.Scheduled`` rows, in plan order) as the model's inputs: token ids, positions,
the slot each new token's KV is written to, and the attention metadata (prefill segments; decodes grouped by page-
table length, each table padded). A decode is one ``DecodeRow`` (``decode_row``), for the eager batch here and for a
captured graph's static buffers (cuda_graphs.py) alike. Pages a sliding window dropped (DROPPED_PAGE in a table) are
read as page 0 and masked (``visible_table``)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from executor_svc.attention.metadata import DECODE_SLACK, AttentionMetadata, DecodeGroup, PrefillSegment
from executor_svc.plan_check import Scheduled
from executor_svc.tensors import long_tensor
from pagedkv.wire import DROPPED_PAGE


@dataclass(slots=True)
class DecodeRow:
    """One decode of the step: what its query reads and writes."""

    token: int
    position: int
    slot_page: int
    slot_offset: int
    table: list[int]  # pages of positions [0, position], dropped ones already read as page 0
    sink: int = 0
    window: int = 0


def visible_table(page_ids: list[int], num_pages: int, windowed: bool) -> list[int]:
    """The first ``num_pages`` entries of a page table as attention reads them: a page a window dropped as page 0
    (masked)."""
    table = page_ids[:num_pages]
    return [0 if p == DROPPED_PAGE else p for p in table] if windowed else table


@dataclass(slots=True)
class PromptRows:
    """The prompt log-probabilities a step computes: for each request that asks (``SamplingParams.prompt_logprobs``)
    and computes positions before its prompt's last, a span (plan row, first prompt token they are for, count), and
    those positions' rows in the step's flat batch (in span order). The logits of position p give token p + 1's."""

    spans: list[tuple[int, int, int]]
    flat: list[int]


def prompt_rows(scheduled: list[Scheduled]) -> PromptRows | None:
    """The step's prompt rows (None: no request computes any). Tokens lie in the flat batch in plan order."""
    spans, flat, at = [], [], 0
    for row, item in enumerate(scheduled):
        st = item.state
        end = min(item.start + item.count, st.num_prompt - 1)
        if st.sampling.prompt_logprobs and end > item.start:
            spans.append((row, item.start + 1, end - item.start))
            flat.extend(range(at, at + end - item.start))
        at += item.count
    return PromptRows(spans, flat) if spans else None


def decode_row(item: Scheduled, block_size: int) -> DecodeRow:
    st, pos = item.state, item.start
    page = pos // block_size
    return DecodeRow(st.token_ids[pos], pos, st.page_ids[page], pos % block_size,
                     visible_table(st.page_ids, page + 1, bool(st.window)), st.sink, st.window)


def group_by_length(num_pages: list[int], slack: float = DECODE_SLACK) -> list[tuple[list[int], int]]:
    """Indices grouped so that within a group the longest table is at most ``slack`` x the shortest
    (padding waste stays small); returns (members, padded width) pairs. An infinite slack: one group."""
    if slack == math.inf:
        return [(list(range(len(num_pages))), max(num_pages))] if num_pages else []
    order = sorted(range(len(num_pages)), key=num_pages.__getitem__)
    groups: list[tuple[list[int], int]] = []
    for i in order:
        if groups and num_pages[i] <= slack * num_pages[groups[-1][0][0]]:
            groups[-1][0].append(i)
            groups[-1] = (groups[-1][0], num_pages[i])
        else:
            groups.append(([i], num_pages[i]))
    return groups


def padded_tables(tables: list[list[int]], width: int, device: torch.device) -> torch.Tensor:
    """[len(tables), width]: each table, padded with page 0 (the rows' own pages only cross from Python to
    torch; the padding is written by one masked scatter)."""
    flat: list[int] = []
    for t in tables:
        flat += t
    pages = long_tensor(flat)
    if len(flat) == len(tables) * width:
        return pages.view(len(tables), width).to(device)
    lens = long_tensor([len(t) for t in tables])
    out = torch.zeros(len(tables), width, dtype=torch.long)
    out.masked_scatter_(torch.arange(width) < lens[:, None], pages)
    return out.to(device)


def build_batch(scheduled: list[Scheduled], block_size: int, device: torch.device, decode_slack: Callable[[], float],
                sliding_window) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
    """(token ids, positions, attention metadata, the rows whose logits are sampled) of an eager step;
    ``decode_slack()``: how much longer than the shortest a decode's table may be in its group (math.inf: one
    group), asked when the step has decodes."""
    bs = block_size
    ids, positions, slot_pages, slot_offsets = [], [], [], []
    decode_idx, decode_rows, prefills, logits_rows = [], [], [], []
    for item in scheduled:
        st, start, n = item.state, item.start, item.count
        q_start = len(ids)
        if n == 1:  # (a decode: one position, no ranges)
            row = decode_row(item, bs)
            ids.append(row.token)
            positions.append(start)
            slot_pages.append(row.slot_page)
            slot_offsets.append(row.slot_offset)
            decode_idx.append(q_start)
            decode_rows.append(row)
            if start + 1 == len(st.token_ids):
                logits_rows.append(q_start)
            continue
        ids.extend(st.token_ids[start:start + n])
        pos = range(start, start + n)
        positions.extend(pos)
        slot_pages.extend(st.page_ids[p // bs] for p in pos)
        slot_offsets.extend(p % bs for p in pos)
        ctx = start + n
        pages = long_tensor(visible_table(st.page_ids, -(-ctx // bs), bool(st.window)), device)
        prefills.append(PrefillSegment(q_start, n, ctx, pages, st.sink, st.window))
        if ctx == len(st.token_ids):
            logits_rows.append(len(ids) - 1)

    def tensor(values) -> torch.Tensor:
        return long_tensor(values, device)

    groups = []
    slack = decode_slack() if decode_rows else DECODE_SLACK
    for members, width in group_by_length([len(r.table) for r in decode_rows], slack):
        rows = [decode_rows[i] for i in members]
        group = DecodeGroup(tensor([decode_idx[i] for i in members]),
                            padded_tables([r.table for r in rows], width, device),
                            tensor([r.position + 1 for r in rows]),
                            in_order=all(a < b for a, b in zip(members, members[1:])))
        if any(r.window for r in rows):
            group.sinks = tensor([r.sink for r in rows])
            group.windows = tensor([r.window for r in rows])
        groups.append(group)
    meta = AttentionMetadata(slot_pages=tensor(slot_pages), slot_offsets=tensor(slot_offsets), decodes=groups,
                             prefills=prefills, sliding_window=sliding_window)
    return tensor(ids), tensor(positions), meta, tensor(logits_rows)
