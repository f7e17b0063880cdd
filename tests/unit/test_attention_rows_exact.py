"""A query's attention has the same bits however the CPU kernel computes it (issue #46, F7): as a decode (its own table
row), as a token of a prefill chunk (the kernel's runs: a chunk's tokens read their keys together), beside any other
queries, and as a row of a decode cascade over a shared prefix (paged_attention_cascade). What a recomputed stream's
exactness rests on (tests/unit/test_exact_recompute.py)."""

from __future__ import annotations

import pytest
import torch

from executor_svc.attention import cpu_kernel
from executor_svc.attention.metadata import AttentionMetadata, DecodeGroup, PrefillSegment

pytestmark = [pytest.mark.unit, pytest.mark.skipif(cpu_kernel.unavailable_reason() is not None,
                                                   reason="no CPU kernel library here")]

NONE = torch.empty(0, dtype=torch.long)
SHAPES = [(9, 3, 64), (8, 4, 32), (8, 2, 128), (4, 4, 256)]


@pytest.fixture(scope="module")
def kernel():
    ops = cpu_kernel.load()
    if not ops.paged_attention_shared_dims():
        pytest.skip("no vector path of the CPU kernel here (AVX2 or AVX-512)")
    return ops


def pool(pages: int, kv_heads: int, dim: int, g: torch.Generator, block: int = 16):
    return torch.randn(pages, block, kv_heads, dim, generator=g), torch.randn(pages, block, kv_heads, dim, generator=g)


def as_decodes(kernel, q, k, v, tables, pos, model_window=0):
    """Each query alone, as a decode step attends it, one call each: query i over table row i (or the one row)."""
    rows = [tables[min(i, tables.shape[0] - 1)].view(1, -1) for i in range(q.shape[0])]
    return torch.cat([kernel.paged_attention(q[i:i + 1].contiguous(), k, v, rows[i].contiguous(), NONE, pos[i:i + 1],
                                             NONE, NONE, model_window, q.shape[-1] ** -0.5)
                      for i in range(q.shape[0])])


@pytest.mark.parametrize("heads,kv_heads,dim", SHAPES)
@pytest.mark.parametrize("ctx,q_len", [(37, 37), (300, 50), (1100, 200), (40, 19)],
                         ids=["whole-prompt", "chunk-mid-page", "long", "short-chunk"])
@pytest.mark.parametrize("model_window", [0, 48])
def test_a_prefill_chunks_tokens_have_the_bits_of_decodes(kernel, heads, kv_heads, dim, ctx, q_len, model_window):
    g = torch.Generator().manual_seed(ctx + q_len + dim)
    width = -(-ctx // 16)
    k, v = pool(width + 5, kv_heads, dim, g)
    table = torch.randperm(width + 5, generator=g)[:width].view(1, -1).contiguous()
    q = torch.randn(q_len, heads, dim, generator=g)
    pos = torch.arange(ctx - q_len, ctx)
    chunk = kernel.paged_attention(q, k, v, table, torch.zeros(q_len, dtype=torch.long), pos, NONE, NONE,
                                   model_window, dim ** -0.5)
    assert torch.equal(chunk, as_decodes(kernel, q, k, v, table, pos, model_window=model_window))
    # the same tokens as a batch of decodes (a table row each), and the chunk cut in two calls
    batch = kernel.paged_attention(q, k, v, table.expand(q_len, -1).contiguous(), NONE, pos, NONE, NONE, model_window,
                                   dim ** -0.5)
    assert torch.equal(chunk, batch)
    cut = q_len // 3
    parts = [kernel.paged_attention(q[a:b].contiguous(), k, v, table, torch.zeros(b - a, dtype=torch.long), pos[a:b],
                                    NONE, NONE, model_window, dim ** -0.5) for a, b in ((0, cut), (cut, q_len))]
    assert torch.equal(chunk, torch.cat(parts))


def test_chunks_of_several_requests_and_windows_of_their_own(kernel):
    """Three chunks in one call (one with a sink + window of its own, whose tokens go one by one), each token's bits
    its decode's."""
    g = torch.Generator().manual_seed(3)
    k, v = pool(60, 2, 64, g)
    tables = torch.randperm(60, generator=g)[:54].view(3, 18).contiguous()
    spans = [(0, 120, 40), (1, 200, 77), (2, 90, 90)]  # (table row, context, chunk length)
    q = torch.randn(sum(n for *_, n in spans), 8, 64, generator=g)
    rows = torch.cat([torch.full((n,), r) for r, _, n in spans])
    pos = torch.cat([torch.arange(c - n, c) for _, c, n in spans])
    sinks, windows = torch.tensor([0, 4, 0]), torch.tensor([0, 50, 0])
    got = kernel.paged_attention(q, k, v, tables, rows, pos, sinks, windows, 0, 0.125)
    want = torch.cat([kernel.paged_attention(q[i:i + 1].contiguous(), k, v, tables[rows[i]:rows[i] + 1].contiguous(),
                                             NONE, pos[i:i + 1], sinks[rows[i]:rows[i] + 1],
                                             windows[rows[i]:rows[i] + 1], 0, 0.125) for i in range(q.shape[0])])
    assert torch.equal(got, want)


def cascade_case(rows: int, shared_pages: int, own: list[int], heads: int, kv_heads: int, dim: int, seed: int):
    """Decodes whose tables begin with the same ``shared_pages`` pages, then ``own[i]`` tokens of their own."""
    g = torch.Generator().manual_seed(seed)
    widths = [-(-n // 16) for n in own]
    num = shared_pages + sum(widths) + 2
    k, v = pool(num, kv_heads, dim, g)
    order = torch.randperm(num, generator=g)
    tables = torch.zeros(rows, shared_pages + max(widths), dtype=torch.long)
    tables[:, :shared_pages] = order[:shared_pages]
    at = shared_pages
    for i, w in enumerate(widths):
        tables[i, shared_pages:shared_pages + w] = order[at:at + w]
        at += w
    pos = torch.tensor([shared_pages * 16 + n - 1 for n in own])
    return torch.randn(rows, heads, dim, generator=g), k, v, tables, pos, order[:shared_pages].contiguous()


@pytest.mark.parametrize("heads,kv_heads,dim", SHAPES)
@pytest.mark.parametrize("rows,shared", [(9, 29), (32, 64), (3, 1)])
def test_a_cascade_row_has_the_bits_of_the_row_alone(kernel, heads, kv_heads, dim, rows, shared):
    own = [1 + (i * 37) % 70 for i in range(rows)]
    q, k, v, tables, pos, pages = cascade_case(rows, shared, own, heads, kv_heads, dim, seed=rows + shared)
    got = kernel.paged_attention_cascade(q, k, v, tables, pos, pages, dim ** -0.5)
    assert torch.equal(got, kernel.paged_attention(q, k, v, tables, NONE, pos, NONE, NONE, 0, dim ** -0.5))
    lone = torch.cat([kernel.paged_attention(q[i:i + 1].contiguous(), k, v, tables[i:i + 1].contiguous(), NONE,
                                             pos[i:i + 1], NONE, NONE, 0, dim ** -0.5) for i in range(rows)])
    assert torch.equal(got, lone)


def test_the_cascade_refuses_bad_arguments_by_name(kernel):
    q, k, v, tables, pos, pages = cascade_case(4, 3, [5, 9, 2, 30], 4, 2, 32, seed=1)
    cases = [(dict(pages=pages.flip(0).contiguous()), "does not begin with the shared pages"),
             (dict(pos=pos - 20), "not after the 48 shared keys"),
             (dict(pos=pos + 1000), "outside its page table"),
             (dict(q=q.to(torch.bfloat16)), "float32"),
             (dict(tables=tables[:3].contiguous()), "a row per query"),
             (dict(pages=torch.tensor([10_000] * 3)), "does not begin")]
    for change, words in cases:
        args = dict(q=q, k=k, v=v, tables=tables, pos=pos, pages=pages) | change
        with pytest.raises(RuntimeError, match=words):
            kernel.paged_attention_cascade(args["q"], args["k"], args["v"], args["tables"], args["pos"],
                                           args["pages"], 0.125)


def test_the_backend_gives_a_token_the_same_bits_in_a_mixed_step_and_as_a_decode(kernel, monkeypatch):
    """Through TorchPagedAttention: a step of decodes (as a cascade) and prefill chunks in between them; each token's
    output equals the one it gets as a lone decode, and every prefill token lands in its own row."""
    from executor_svc.attention import cascade
    from executor_svc.attention.torch_backend import TorchPagedAttention

    monkeypatch.setattr(cascade, "CASCADE_MIN_WORK", 0)
    heads, kv_heads, dim = 9, 3, 64
    q_dec, k, v, tables, pos, pages = cascade_case(8, 9, [3 + 5 * i for i in range(8)], heads, kv_heads, dim, seed=4)
    spans = [(2, 70), (3, 150)]  # prefill chunks: (decode table row they extend, tokens), placed after those rows
    q_pre = [torch.randn(n, heads, dim) for _, n in spans]
    flat, token_idx, segs = [], [], []
    for i in range(8):
        token_idx.append(len(flat))
        flat.append(q_dec[i])
        for row, n in spans:
            if row == i:
                ctx = int(pos[row]) + 1  # (the chunk's own pages: the row's table; its keys up to ctx, random)
                segs.append(PrefillSegment(len(flat), n, ctx, tables[row, :-(-ctx // 16)].contiguous()))
                flat.extend(q_pre[len(segs) - 1])
    q = torch.stack(flat)
    group = DecodeGroup(torch.tensor(token_idx), tables, pos + 1)
    meta = AttentionMetadata(torch.zeros(len(flat), dtype=torch.long), torch.zeros(len(flat), dtype=torch.long),
                             [group], segs)
    out = TorchPagedAttention(heads, kv_heads, dim, dim ** -0.5).forward(q, k, v, meta)
    assert group.shared_pages.numel() == 9, "the decodes must have run as a cascade"
    assert torch.equal(out[group.token_idx], as_decodes(kernel, q_dec, k, v, tables, pos))
    for seg, (row, n) in zip(segs, spans):
        want = as_decodes(kernel, q[seg.q_start:seg.q_start + n], k, v, tables[row:row + 1].contiguous(),
                          torch.arange(seg.ctx_len - n, seg.ctx_len))
        assert torch.equal(out[seg.q_start:seg.q_start + n], want)
