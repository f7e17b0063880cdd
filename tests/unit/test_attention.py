"""The torch paged attention against dense attention on the same K/V, random inputs, several shapes: both its
paths, the reference (gather, then SDPA) and the CPU kernel that reads decodes' pages in place."""

from __future__ import annotations

import pytest
import torch

from executor_svc.attention.metadata import AttentionMetadata, DecodeGroup, PrefillSegment
from executor_svc.attention.torch_backend import TorchPagedAttention
from tests.support.attention_reference import dense

pytestmark = pytest.mark.unit


def kernel_built() -> bool:
    """The CPU kernel is built here; only a machine without a compiler may lack it (then the gather serves)."""
    from executor_svc.attention import cpu_kernel

    if cpu_kernel.load() is None:
        assert cpu_kernel.unavailable_reason() is not None, cpu_kernel.reason()
        return False
    return True


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 16), (8, 2, 32)])
@pytest.mark.parametrize("window", [None, 13])
@pytest.mark.parametrize("reference", [True, False], ids=["gather", "in_place"])
def test_paged_matches_dense(block_size, heads, kv_heads, head_dim, window, reference):
    g = torch.Generator().manual_seed(block_size * 100 + heads)
    num_pages = 64
    # (context length, new tokens) per request: decodes (1 new token) and prefill chunks with context.
    reqs = [(1, 1), (37, 1), (70, 1), (25, 25), (50, 9), (16, 3)]
    k_cache = torch.randn(num_pages, block_size, kv_heads, head_dim, generator=g)
    v_cache = torch.randn(num_pages, block_size, kv_heads, head_dim, generator=g)
    perm = torch.randperm(num_pages, generator=g).tolist()  # scattered, non-contiguous pages
    tables = []
    for ctx, _ in reqs:
        n = -(-ctx // block_size)
        tables.append([perm.pop() for _ in range(n)])
    total = sum(n for _, n in reqs)
    q = torch.randn(total, heads, head_dim, generator=g)
    new_k = torch.randn(total, kv_heads, head_dim, generator=g)
    new_v = torch.randn(total, kv_heads, head_dim, generator=g)
    slot_pages, slot_offsets, dec_idx, dec_tables, dec_lens, prefills = [], [], [], [], [], []
    start = 0
    for (ctx, n), table in zip(reqs, tables):
        for pos in range(ctx - n, ctx):
            slot_pages.append(table[pos // block_size])
            slot_offsets.append(pos % block_size)
        if n == 1:
            dec_idx.append(start)
            dec_tables.append(table)
            dec_lens.append(ctx)
        else:
            prefills.append(PrefillSegment(start, n, ctx, torch.tensor(table)))
        start += n
    width = max(len(t) for t in dec_tables)
    meta = AttentionMetadata(
        slot_pages=torch.tensor(slot_pages), slot_offsets=torch.tensor(slot_offsets),
        decodes=[DecodeGroup(torch.tensor(dec_idx), torch.tensor([t + [0] * (width - len(t)) for t in dec_tables]),
                             torch.tensor(dec_lens))],
        prefills=prefills, sliding_window=window,
    )
    attn = TorchPagedAttention(heads, kv_heads, head_dim, head_dim ** -0.5, reference=reference)
    assert attn.reads_in_place(q, k_cache) is (not reference and kernel_built())
    attn.write_cache(k_cache, v_cache, new_k, new_v, meta)
    out = attn.forward(q, k_cache, v_cache, meta)
    start = 0
    for (ctx, n), table in zip(reqs, tables):
        k = k_cache[table].reshape(-1, kv_heads, head_dim)[:ctx]
        v = v_cache[table].reshape(-1, kv_heads, head_dim)[:ctx]
        assert torch.equal(k[ctx - n:], new_k[start:start + n])  # the new K landed in its slots
        ref = dense(q[start:start + n], k, v, ctx, n, head_dim ** -0.5, window)
        torch.testing.assert_close(out[start:start + n], ref, rtol=1e-5, atol=1e-5)
        start += n


def dense_sink_window(q, k, v, ctx_len, q_len, scale, sink, window):
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, 1).transpose(0, 1)
    v = v.repeat_interleave(group, 1).transpose(0, 1)
    s = q.transpose(0, 1) @ k.transpose(1, 2) * scale
    qp = torch.arange(ctx_len - q_len, ctx_len).view(-1, 1)
    kp = torch.arange(ctx_len).view(1, -1)
    visible = (kp <= qp) & ((kp < sink) | (kp > qp - window))
    s = s.masked_fill(~visible, float("-inf"))
    return (torch.softmax(s.float(), -1).to(q.dtype) @ v).transpose(0, 1)


@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("reference", [True, False], ids=["gather", "in_place"])
def test_sink_and_window_with_dropped_pages(block_size, reference):
    """Requests with their own sink + window: pages wholly outside are gone (read as page 0, which holds
    other data) and must not change the result; one request without a window shares the decode group."""
    g = torch.Generator().manual_seed(block_size)
    heads, kv_heads, head_dim, num_pages = 8, 2, 32, 96
    # (context length, new tokens, sink, window)
    reqs = [(90, 1, 4, 20), (75, 1, 0, 33), (60, 1, 0, 0), (120, 12, 8, 40), (50, 5, 3, 17)]
    k_cache = torch.randn(num_pages, block_size, kv_heads, head_dim, generator=g)
    v_cache = torch.randn(num_pages, block_size, kv_heads, head_dim, generator=g)
    perm = torch.randperm(num_pages - 1, generator=g).add(1).tolist()  # page 0 stays foreign
    full_tables, tables = [], []
    for ctx, n, sink, window in reqs:
        table = [perm.pop() for _ in range(-(-ctx // block_size))]
        full_tables.append(table)
        first_visible = ctx - n - window + 1  # the earliest query's window start
        sink_pages = -(-sink // block_size)
        tables.append([0 if window and sink_pages <= i < first_visible // block_size else p
                       for i, p in enumerate(table)])
    total = sum(r[1] for r in reqs)
    q = torch.randn(total, heads, head_dim, generator=g)
    dec, prefills, start = [], [], 0
    for (ctx, n, sink, window), table in zip(reqs, tables):
        if n == 1:
            dec.append((start, table, ctx, sink, window))
        else:
            prefills.append(PrefillSegment(start, n, ctx, torch.tensor(table), sink, window))
        start += n
    width = max(len(t) for _, t, *_ in dec)
    group = DecodeGroup(torch.tensor([d[0] for d in dec]),
                        torch.tensor([d[1] + [0] * (width - len(d[1])) for d in dec]),
                        torch.tensor([d[2] for d in dec]), sinks=torch.tensor([d[3] for d in dec]),
                        windows=torch.tensor([d[4] for d in dec]))
    meta = AttentionMetadata(slot_pages=torch.zeros(0, dtype=torch.long), slot_offsets=torch.zeros(0, dtype=torch.long),
                             decodes=[group], prefills=prefills)
    attn = TorchPagedAttention(heads, kv_heads, head_dim, head_dim ** -0.5, reference=reference)
    assert attn.reads_in_place(q, k_cache) is (not reference and kernel_built())
    out = attn.forward(q, k_cache, v_cache, meta)
    start = 0
    for (ctx, n, sink, window), table in zip(reqs, full_tables):
        k = k_cache[table].reshape(-1, kv_heads, head_dim)[:ctx]
        v = v_cache[table].reshape(-1, kv_heads, head_dim)[:ctx]
        ref = dense_sink_window(q[start:start + n], k, v, ctx, n, head_dim ** -0.5, sink, window or 10**9)
        torch.testing.assert_close(out[start:start + n], ref, rtol=1e-5, atol=1e-5)
        start += n


def test_every_backend_is_a_paged_attention():
    """Both backends offer what the model and the runner call (executor_svc.attention.interface); a stand-in
    without forward is not one."""
    from executor_svc.attention import BACKENDS, PagedAttention

    for name, backend in BACKENDS.items():
        attention = backend(8, 4, 128, 128 ** -0.5)
        assert isinstance(attention, PagedAttention) and attention.name == name
    assert TorchPagedAttention(8, 4, 128, 1.0).copy_pages is None  # the pool's torch copy
    assert callable(BACKENDS["cuda"](8, 4, 128, 1.0).copy_pages)
    assert not isinstance(type("Half", (), {"name": "x", "write_cache": lambda *a: None})(), PagedAttention)
