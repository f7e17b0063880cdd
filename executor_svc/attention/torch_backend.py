"""Paged attention in plain PyTorch (CPU and GPU), and the reference the CUDA kernels are checked against.

On the CPU, decodes read K/V where they lie in the pool: a small C++ kernel (``paged_attention_cpu.cpp``,
built once and cached by ``executor_svc.attention.cpu_kernel``) walks each request's page table. In float32 (at the
head sizes of its vector path: ``prefill_in_kernel``) prefill chunks go to the same kernel, each token a query as a
decode is: it takes a chunk's consecutive tokens together, reading their keys once, each token's arithmetic a lone
decode's. So a token's attention, and with it its K/V in the next layers and its logits, has the same bits however
it is computed: in a prefill chunk of any length and start, in a recompute (preemption, migration, a resumed stream:
prompt and outputs as one prefill) or in a decode step, beside any other requests (the linears and row-wise ops are
batch-independent too: executor_svc/model/cpu_linear.py). A recomputed sampled stream goes on exactly as it would
have (issue #46; tests/unit/test_exact_recompute.py). Other dtypes gather each chunk's context and run SDPA, as the
reference does.

The reference path (``reference=True``; also wherever the kernel does not apply: other devices, 8-bit
pools, a KV dtype other than the model's, no compiler) gathers for decodes too:
it reads K/V through page tables from the per-layer views of the page pool
``[num_pages, block_size, num_kv_heads, head_dim]``: one ``index_select`` of whole pages gives a
request's tokens in order, viewed (no copy) as [kv_heads, tokens, head_dim] for
``scaled_dot_product_attention`` with grouped-query heads. Positions past a request's context (table
padding), outside the model's sliding window when there is one, and outside a request's own sink + window
(its dropped pages among them) are masked.

Decodes whose tables all start with the same pages (a shared prompt prefix: prefix caching maps it to the same
pages) attend them as a cascade when the prefix is long enough for it to pay (cascade.py: ``CASCADE_MIN_ROWS``,
``CASCADE_MIN_TOKENS``, ``CASCADE_MIN_WORK``). In float32 the kernel library's ``paged_attention_cascade`` reads the
prefix's keys once for a block of rows instead of once a row, each row's arithmetic the kernel's alone (its bits do
not depend on whether the cascade runs). Other dtypes score every query against the prefix in one SDPA call over
the prefix gathered once a layer (the [rows x query heads] of each KV head), with its log-sum-exp; the kernel then
attends each request's own pages after the prefix and merges the two softmaxes (``paged_attention_after``).

In other dtypes, prefill chunks with cached context before them (a chunked prompt's later chunks, a prompt whose
prefix was cached) attend it in two parts merged by their log-sum-exps: the context's whole pages before the chunk's
first query, which every query sees (no mask), and the rest (the chunk's own keys, causal). Chunks whose contexts
begin with the same pages (a shared prompt prefix) score their queries against those pages in one SDPA call over the
[tokens x query heads] of each KV head (cascade.py ``split_prefills``). The one masked SDPA over the whole gathered
context that it replaces built a [q_len, ctx] mask per chunk and ran ~40% slower (bench/NOTES.md, session 16).

On a quantized pool (``QuantizedCache`` / ``ChannelScaledCache`` views, executor_svc.kv_quant)
``write_cache`` quantizes the new tokens (computing their scales), and the gather dequantizes the gathered
pages (a copy that the gather makes anyway), so attention itself runs in the model dtype.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from executor_svc.attention import cascade, cpu_kernel, q8_decode
from executor_svc.attention.metadata import (
    DECODE_SLACK,
    AttentionMetadata,
    DecodeGroup,
    PrefillSegment,
    prefill_queries,
)
from executor_svc.kv_quant import ChannelScaledCache, QuantizedCache

QUANTIZED = (QuantizedCache, ChannelScaledCache)

def gather_pages(cache: torch.Tensor | QuantizedCache | ChannelScaledCache, page_ids: torch.Tensor,
                 dtype: torch.dtype) -> torch.Tensor:
    """Pages [B, n] of one layer's K or V -> [B, kv_heads, n * block_size, head_dim]: one copy (dequantized
    from an 8-bit pool), then a strided view."""
    batch = page_ids.shape[0]
    if isinstance(cache, QUANTIZED):
        pages = cache.gather(page_ids.reshape(-1), dtype)
    else:
        pages = cache.index_select(0, page_ids.reshape(-1)).to(dtype)  # [B * n, bs, H, D] (no-op cast
        # unless --kv-cache-dtype is a float type other than the model's)
    return pages.view(batch, -1, pages.shape[-2], pages.shape[-1]).transpose(1, 2)


def decode_visible(group: DecodeGroup, window: int | None, length: int, device: torch.device) -> torch.Tensor:
    """[B, length] bool: the positions each decode of the group sees (its context, within the model's window and
    its own sink + window)."""
    batch = group.ctx_lens.numel()
    pos = torch.arange(length, device=device).view(1, -1)
    ctx = group.ctx_lens.view(batch, 1)
    visible = pos < ctx
    if window:
        visible &= pos > ctx - 1 - window
    if group.windows is not None:
        w = group.windows.view(batch, 1)
        visible &= (w == 0) | (pos < group.sinks.view(batch, 1)) | (pos > ctx - 1 - w)
    return visible


def prefill_visible(seg: PrefillSegment, window: int | None, device: torch.device) -> torch.Tensor:
    """[q_len, ctx_len] bool: causal, within the model's window and the request's sink + window."""
    q_pos = torch.arange(seg.ctx_len - seg.q_len, seg.ctx_len, device=device).view(-1, 1)
    k_pos = torch.arange(seg.ctx_len, device=device).view(1, -1)
    visible = k_pos <= q_pos
    if window:
        visible &= k_pos > q_pos - window
    if seg.window:
        visible &= (k_pos < seg.sink) | (k_pos > q_pos - seg.window)
    return visible


_NONE = torch.empty(0, dtype=torch.long)  # "no per-request windows" / "query i reads table row i"


class TorchPagedAttention:
    """The torch backend (an ``executor_svc.attention.PagedAttention``); ``reference=True`` always gathers."""

    name = "torch"
    copy_pages = None  # the pool copies pages with torch

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 reference: bool = False) -> None:
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.gqa = num_heads != num_kv_heads
        self.reference = reference

    def reads_in_place(self, q: torch.Tensor, k_cache: torch.Tensor | QuantizedCache | ChannelScaledCache) -> bool:
        """Whether forward's decodes read these pages in place (the CPU kernel; built on the first call) or
        gather them."""
        if self.reference or q.device.type != "cpu" or not isinstance(k_cache, torch.Tensor):
            return False
        return k_cache.dtype == q.dtype and cpu_kernel.load() is not None

    def decode_group_slack(self, k_cache: torch.Tensor | QuantizedCache | ChannelScaledCache,
                           dtype: torch.dtype) -> float:
        """How the runner groups decodes by table length (``executor_svc.runner``): in place, one group (the
        kernel reads each row to its own length, so padding costs nothing, and one call per layer beats one
        per group: bench/NOTES.md "One decode group"); gathering, groups of similar length (the copy is
        padded to the group's longest table)."""
        if isinstance(k_cache, torch.Tensor) and self.reads_in_place(
                torch.empty(0, dtype=dtype, device=k_cache.device), k_cache):
            return math.inf
        if q8_decode.kernel_for(torch.empty(0, dtype=dtype, device=k_cache.data.device), k_cache, self.reference,
                                self.num_heads):
            return math.inf  # (8-bit pages read in place as well)
        return DECODE_SLACK

    # write_cache stores K/V as they are into plain tensor pages: a model may store them itself the same way
    # (executor_svc/model/cpu_ops.cpp rotary_write).
    plain_cache_writes = True

    def write_cache(
        self, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        meta: AttentionMetadata,
    ) -> None:
        """Stores the step's new K/V ([T, kv_heads, head_dim]) into their slots."""
        if isinstance(k_cache, QUANTIZED):
            k_cache.write(meta.slot_pages, meta.slot_offsets, k)
            v_cache.write(meta.slot_pages, meta.slot_offsets, v)
            return
        k_cache[meta.slot_pages, meta.slot_offsets] = k.to(k_cache.dtype)  # no-op unless --kv-cache-dtype is
        v_cache[meta.slot_pages, meta.slot_offsets] = v.to(v_cache.dtype)  # another float type than the model's

    def forward(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """q: [T, heads, head_dim] -> [T, heads, head_dim]; the step's K/V must already be written."""
        if self.reads_in_place(q, k_cache):
            return self._forward_in_place(q, k_cache, v_cache, meta)
        out = torch.empty_like(q)
        for group in meta.decodes:
            out[group.token_idx] = self._decode(q[group.token_idx], k_cache, v_cache, group, meta.sliding_window)
        for seg in meta.prefills:
            rows = slice(seg.q_start, seg.q_start + seg.q_len)
            out[rows] = self._prefill(q[rows], k_cache, v_cache, seg, meta.sliding_window)
        return out

    def _forward_in_place(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          meta: AttentionMetadata) -> torch.Tensor:
        # NOTE: float32 prefill chunks go to the kernel too, each token attended as a decode is (the module
        # docstring); in other dtypes a chunk's queries run as one SDPA over its gathered context.
        kernel = cpu_kernel.load()
        window = meta.sliding_window or 0
        if meta.one_decode_group:  # (a decode-only step: no gather of q's rows, no scatter of the output)
            return self._decode_in_place(kernel, q, k_cache, v_cache, meta.decodes[0], window)
        exact = bool(meta.prefills) and cascade.prefill_in_kernel(kernel, q)
        if exact:
            pq = prefill_queries(meta)
            rows = kernel.paged_attention((q if pq.token_idx is None else q[pq.token_idx]).contiguous(), k_cache,
                                          v_cache, pq.tables, pq.q_rows, pq.q_pos, pq.sinks, pq.windows, window,
                                          self.scale)
            if pq.token_idx is None:
                return rows
        out = torch.empty_like(q)
        for group in meta.decodes:
            out[group.token_idx] = self._decode_in_place(kernel, q[group.token_idx], k_cache, v_cache, group, window)
        if exact:
            out[pq.token_idx] = rows
            return out
        split = cascade.split_prefills(meta, k_cache.shape[1])
        done = set()
        for pages, segs in split:
            self._prefill_split(q, k_cache, v_cache, pages, segs, out)
            done.update(id(seg) for seg in segs)
        for seg in meta.prefills:
            if id(seg) not in done:
                rows = slice(seg.q_start, seg.q_start + seg.q_len)
                out[rows] = self._prefill(q[rows], k_cache, v_cache, seg, meta.sliding_window)
        return out

    def _prefill_split(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       pages: torch.Tensor, segs: list[PrefillSegment], out: torch.Tensor) -> None:
        """Prefill segments over context ``pages`` that all of them start with (every query sees all of it: one
        unmasked SDPA over the gathered pages for the group's queries), then each over the rest of its context (its
        own keys, causal); the two softmaxes merged by their log-sum-exps, in float32."""
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        block_size, kv_heads, dim = k_cache.shape[1], self.num_kv_heads, self.head_dim
        heads, per_kv = self.num_heads, self.num_heads // self.num_kv_heads
        length = pages.numel() * block_size
        qs = [q[seg.q_start:seg.q_start + seg.q_len] for seg in segs]
        qc = qs[0] if len(qs) == 1 else torch.cat(qs)
        n = qc.shape[0]
        k = k_cache.index_select(0, pages).view(1, length, kv_heads, dim).transpose(1, 2)
        v = v_cache.index_select(0, pages).view(1, length, kv_heads, dim).transpose(1, 2)
        # every query head of a KV head, of every token, is a query row of that head: [1, kv_heads, n x per_kv, D]
        qg = qc.view(n, kv_heads, per_kv, dim).transpose(0, 1).reshape(1, kv_heads, n * per_kv, dim)
        prior, lse = flash(qg, k, v, 0.0, False, scale=self.scale)[:2]
        prior = prior[0].view(kv_heads, n, per_kv, dim).transpose(0, 1).reshape(n, heads, dim)
        lse = lse[0].view(kv_heads, n, per_kv).transpose(0, 1).reshape(n, heads)
        start = 0
        for seg, qseg in zip(segs, qs):
            rest = seg.ctx_len - length  # keys [length, ctx_len): the chunk's own, and context after the pages
            tail = seg.page_ids[pages.numel():-(-seg.ctx_len // block_size)]
            kr = gather_pages(k_cache, tail.view(1, -1), q.dtype)[:, :, :rest]  # [1, kv_heads, rest, D]
            vr = gather_pages(v_cache, tail.view(1, -1), q.dtype)[:, :, :rest]
            if per_kv > 1:
                kr, vr = kr.repeat_interleave(per_kv, 1), vr.repeat_interleave(per_kv, 1)
            qh = qseg.transpose(0, 1).unsqueeze(0)  # [1, heads, q_len, D]
            if rest == seg.q_len:
                own, own_lse = flash(qh, kr, vr, 0.0, True, scale=self.scale)[:2]
            else:  # query i (position ctx_len - q_len + i) sees key j (position length + j) for j <= i + rest - q_len
                visible = (torch.arange(rest).view(1, -1)
                           <= torch.arange(seg.q_len).view(-1, 1) + (rest - seg.q_len))
                mask = torch.zeros(visible.shape, dtype=q.dtype).masked_fill_(visible.logical_not(), -math.inf)
                own, own_lse = flash(qh, kr, vr, 0.0, False, attn_mask=mask, scale=self.scale)[:2]
            rows = slice(start, start + seg.q_len)
            w = torch.sigmoid(lse[rows] - own_lse[0].transpose(0, 1)).unsqueeze(-1)  # the prior's share
            merged = own[0].transpose(0, 1).float().lerp_(prior[rows].float(), w)
            out[seg.q_start:seg.q_start + seg.q_len] = merged.to(out.dtype)
            start += seg.q_len

    def _decode_in_place(self, kernel, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         group: DecodeGroup, window: int) -> torch.Tensor:
        """A decode group's attention by the kernel, its shared prefix as a cascade where that pays."""
        if group.shared_pages is None:
            group.shared_pages = cascade.shared_prefix(group, k_cache.shape[1], window)
        if not group.shared_pages.numel():
            sinks, windows = (_NONE, _NONE) if group.windows is None else (group.sinks, group.windows)
            return kernel.paged_attention(q, k_cache, v_cache, group.page_tables, _NONE, group.query_positions(),
                                          sinks, windows, window, self.scale)
        if cascade.shared_in_kernel(kernel, q):
            return kernel.paged_attention_cascade(q, k_cache, v_cache, group.page_tables, group.query_positions(),
                                                  group.shared_pages, self.scale)
        rows, heads, dim = q.shape
        kv_heads, per_kv = self.num_kv_heads, self.num_heads // self.num_kv_heads
        length = group.shared_pages.numel() * k_cache.shape[1]
        k = k_cache.index_select(0, group.shared_pages).view(1, length, kv_heads, dim).transpose(1, 2)
        v = v_cache.index_select(0, group.shared_pages).view(1, length, kv_heads, dim).transpose(1, 2)
        # Every query head of a KV head, of every row, is a query row of that head: [1, kv_heads, rows x per_kv, D].
        qg = q.view(rows, kv_heads, per_kv, dim).transpose(0, 1).reshape(1, kv_heads, rows * per_kv, dim)
        prior, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(qg, k, v, 0.0, False,
                                                                              scale=self.scale)[:2]
        prior = prior[0].view(kv_heads, rows, per_kv, dim).transpose(0, 1).reshape(rows, heads, dim).contiguous()
        lse = lse[0].view(kv_heads, rows, per_kv).transpose(0, 1).reshape(rows, heads).float().contiguous()
        return kernel.paged_attention_after(q, k_cache, v_cache, group.page_tables, group.query_positions(),
                                            length, prior, lse, self.scale)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                causal: bool = False) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=self.scale,
                                              enable_gqa=self.gqa)

    def _decode(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, group: DecodeGroup,
        window: int | None,
    ) -> torch.Tensor:
        if (kernel := q8_decode.kernel_for(q, k_cache, self.reference, self.num_heads)) is not None:  # 8-bit, in place
            return q8_decode.decode(kernel, q, k_cache, v_cache, group, window, self.scale)
        batch = q.shape[0]
        k = gather_pages(k_cache, group.page_tables, q.dtype)  # [B, H, L, D]
        v = gather_pages(v_cache, group.page_tables, q.dtype)
        if group.mask is None:  # the same for every layer of the step
            group.mask = decode_visible(group, window, k.shape[-2], q.device).view(batch, 1, 1, -1)
        # NOTE: the query heads of one KV head go in as rows of that head (q_len = group size) rather than
        # through enable_gqa with q_len = 1: the same arithmetic, ~40% faster in the CPU kernel.
        qg = q.view(batch, self.num_kv_heads, self.num_heads // self.num_kv_heads, self.head_dim)
        out = F.scaled_dot_product_attention(qg, k, v, attn_mask=group.mask, scale=self.scale)
        return out.reshape(batch, self.num_heads, self.head_dim)

    def _prefill(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seg: PrefillSegment,
        window: int | None,
    ) -> torch.Tensor:
        k = gather_pages(k_cache, seg.page_ids.view(1, -1), q.dtype)[:, :, : seg.ctx_len]  # [1, H, ctx, D]
        v = gather_pages(v_cache, seg.page_ids.view(1, -1), q.dtype)[:, :, : seg.ctx_len]
        return self.prefill_attend(q, k, v, seg, window)

    def prefill_attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seg: PrefillSegment,
                       window: int | None) -> torch.Tensor:
        """q [q_len, heads, D] over the segment's gathered context k, v [1, kv_heads, ctx, D] (causal, with
        the model's window and the request's sink + window)."""
        qh = q.transpose(0, 1).unsqueeze(0)  # [1, heads, q_len, D]
        if seg.ctx_len == seg.q_len and not window and not seg.window:
            out = self._attend(qh, k, v, None, causal=True)
        else:
            out = self._attend(qh, k, v, prefill_visible(seg, window, q.device))
        return out[0].transpose(0, 1)
