"""CUDA graphs for decode-only steps: the forward captured once per (batch bucket, page-table width) and replayed.

A decode-only step of ``n`` requests is padded to the next batch bucket (1, 2, 4, ... up to the largest,
``--cuda-graph-max-batch``) with dummy rows, and its page tables to the next power-of-two width. The step's
values are copied into static buffers (token ids, positions, slots, page tables, context lengths, sinks and
windows) that the captured forward reads; its first ``n`` rows of logits are the step's, the rest dropped.

    row:        0 .. n-1         | n .. bucket-1
    token/pos:  the step's       | token 0 at position 0
    slot:       the step's       | (scratch page, offset 0): a page no request owns
    table:      the step's, 0s   | [scratch, 0, ...] with context length 1 (reads only its own slot)

The scratch page is the pool's last page, kept from the scheduler (``ModelRunner.num_pages``), so a dummy row
never writes a page that holds a request's KV.

What the capture is comes from outside: ``cuda_capture`` (a ``torch.cuda.CUDAGraph``) on a CUDA device,
``eager_capture`` (replay = run the forward again on the static buffers) in the CPU tests, which thereby
exercise the bucket choice, padding, buffer filling and un-padding without a GPU. Prefill and mixed steps,
8-bit KV pages, per-layer windows, attention softcapping and MoE layers run eager (``graph_blocker``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from executor_svc.attention.metadata import AttentionMetadata, DecodeGroup
from executor_svc.batch import DecodeRow
from executor_svc.tensors import long_tensor

Forward = Callable[[], torch.Tensor]  # runs the model on the static buffers, returns logits [bucket, vocab]
Capture = Callable[[Forward], Forward]  # a forward -> its replay (same output tensor each call)


def decode_buckets(max_batch: int) -> list[int]:
    """Powers of two below ``max_batch``, then ``max_batch`` itself."""
    if max_batch < 1:
        raise ValueError(f"--cuda-graph-max-batch must be >= 1, got {max_batch}")
    out = [1]
    while out[-1] * 2 < max_batch:
        out.append(out[-1] * 2)
    if out[-1] != max_batch:
        out.append(max_batch)
    return out


def bucket_for(n: int, buckets: list[int]) -> int | None:
    """The smallest bucket that holds ``n`` rows; None when ``n`` is above the largest (the step runs eager)."""
    return next((b for b in buckets if b >= n), None)


def width_for(pages: int) -> int:
    """Page-table width of a graph: the next power of two (few graphs; at most 2x padding, masked)."""
    return 1 << max(0, pages - 1).bit_length()


def graph_blocker(model, pool) -> str | None:
    """Why this model and pool must run every step eager (None: decode steps can be captured)."""
    cfg = getattr(model, "cfg", None)
    if cfg is None:
        return "the model has no config"
    if getattr(getattr(pool, "kv", None), "quantized", False):
        return "8-bit KV pages (quantized writes keep per-step scale state)"
    if cfg.layer_windows:
        return "per-layer attention windows"
    if cfg.attn_softcap:
        return "attention softcapping"
    if cfg.moe is not None:
        return "MoE layers (expert routing depends on the values)"
    return None


class StaticDecodeBatch:
    """The buffers one captured graph reads, for ``bucket`` rows and tables of ``width`` pages."""

    def __init__(self, bucket: int, width: int, device: torch.device, scratch_page: int,
                 sliding_window: int | None) -> None:
        self.bucket, self.width, self.scratch_page = bucket, width, scratch_page

        def longs(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.long, device=device)

        self.ids, self.positions = longs(bucket), longs(bucket)
        self.slot_pages, self.slot_offsets = longs(bucket), longs(bucket)
        self.page_tables, self.ctx_lens = longs(bucket, width), longs(bucket)
        self.sinks, self.windows = longs(bucket), longs(bucket)  # always given: a window of 0 means none
        self.rows = torch.arange(bucket, device=device)
        self.group = DecodeGroup(self.rows, self.page_tables, self.ctx_lens, self.sinks, self.windows, in_order=True)
        self.meta = AttentionMetadata(self.slot_pages, self.slot_offsets, [self.group], [], sliding_window)

    def fill(self, rows: list[DecodeRow]) -> None:
        """Copies the step's rows in and pads the rest with dummy rows on the scratch page."""
        n, pad = len(rows), self.bucket - len(rows)
        if not 0 < n <= self.bucket or any(len(r.table) > self.width for r in rows):
            raise ValueError(f"{n} decode rows do not fit a graph of {self.bucket} rows x {self.width} pages")
        scratch = self.scratch_page
        columns = (
            (self.ids, [r.token for r in rows] + [0] * pad),
            (self.positions, [r.position for r in rows] + [0] * pad),
            (self.slot_pages, [r.slot_page for r in rows] + [scratch] * pad),
            (self.slot_offsets, [r.slot_offset for r in rows] + [0] * pad),
            (self.ctx_lens, [r.position + 1 for r in rows] + [1] * pad),
            (self.sinks, [r.sink for r in rows] + [0] * pad),
            (self.windows, [r.window for r in rows] + [0] * pad),
        )
        for static, values in columns:
            static.copy_(long_tensor(values), non_blocking=True)
        zeros, tables = [0] * self.width, []  # (one flat list: one conversion)
        for r in rows:
            tables += r.table
            tables += zeros[len(r.table):]
        tables += ([scratch] + zeros[1:]) * pad
        self.page_tables.copy_(long_tensor(tables).view(self.bucket, self.width), non_blocking=True)


def eager_capture(forward: Forward) -> Forward:
    """A stand-in capture: each replay runs the forward again on the static buffers (the CPU tests)."""
    return forward


def cuda_capture(forward: Forward, pool_handle=None) -> Forward:
    """Warms ``forward`` up on a side stream (kernel compilation, cuBLAS workspaces), captures it into a CUDA
    graph and returns its replay, which refills the same output tensor."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            forward()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool_handle, capture_error_mode="thread_local"):  # other threads may use CUDA
        out = forward()

    def replay() -> torch.Tensor:
        graph.replay()
        return out

    return replay


class DecodeGraphs:
    """Captured decode forwards, one per (bucket, width), made on first use and replayed afterwards."""

    def __init__(self, model, pool, attention, device: torch.device, max_batch: int, scratch_page: int,
                 capture: Capture | None = None) -> None:
        self.model, self.pool, self.attention, self.device = model, pool, attention, device
        self.buckets = decode_buckets(max_batch)
        self.max_batch = self.buckets[-1]
        self.scratch_page = scratch_page
        if capture is None:
            handle = torch.cuda.graph_pool_handle()  # one memory pool shared by every graph (replayed one at a time)
            self.capture: Capture = lambda fwd: cuda_capture(fwd, handle)
        else:
            self.capture = capture
        self.graphs: dict[tuple[int, int], tuple[StaticDecodeBatch, Forward]] = {}

    def fits(self, n: int) -> bool:
        return 0 < n <= self.max_batch

    def _graph(self, bucket: int, width: int) -> tuple[StaticDecodeBatch, Forward]:
        key = (bucket, width)
        if key not in self.graphs:
            static = StaticDecodeBatch(bucket, width, self.device, self.scratch_page, self.model.cfg.sliding_window)

            def forward() -> torch.Tensor:
                static.group.new_step()  # a backend caches the mask and positions per step (eager replays remake them)
                return self.model.forward(static.ids, static.positions, static.meta, self.pool, self.attention,
                                          static.rows)

            static.fill([DecodeRow(0, 0, self.scratch_page, 0, [self.scratch_page])])  # capture on dummy rows
            self.graphs[key] = (static, self.capture(forward))
        return self.graphs[key]

    def run(self, rows: list[DecodeRow]) -> torch.Tensor:
        """Logits [len(rows), vocab] of one decode-only step (valid until the next call)."""
        bucket = bucket_for(len(rows), self.buckets)
        if bucket is None or not rows:
            raise ValueError(f"{len(rows)} decode rows: graphs hold 1 to {self.max_batch}")
        static, replay = self._graph(bucket, width_for(max(len(r.table) for r in rows)))
        static.fill(rows)
        return replay()[: len(rows)]
