"""The CPU kernel's cascades against the torch backend's reference path (gather, then SDPA): decodes whose tables
share a prefix attend it once (paged_attention_shared: the cascade's first half as matrix products, against float64)
and then their own pages, the softmaxes merged, only where every row shares it and it pays; prefill chunks attend
their cached context apart (a common prefix in one call), then their own keys. The in-place decode kernel itself:
test_attention_cpu_kernel.py."""

from __future__ import annotations

import pytest
import torch

from executor_svc.attention import cpu_kernel
from executor_svc.attention.metadata import AttentionMetadata, PrefillSegment
from tests.support.attention_cpu_cases import both, pool_views, shared_meta

pytestmark = [pytest.mark.unit,
              pytest.mark.skipif(cpu_kernel.unavailable_reason() is not None,
                                 reason=f"CPU kernel not buildable here: {cpu_kernel.unavailable_reason()}")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows,shared", [(8, 33), (20, 14), (40, 9)], ids=lambda x: str(x))
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (8, 8, 32), (8, 1, 128)])
def test_shared_prefix_cascade_matches_reference(rows, shared, heads, kv_heads, head_dim, dtype):
    """Rows whose tables share their first pages attend them as a cascade (one SDPA over the prefix for every
    row, then the kernel over each row's own pages, the softmaxes merged): the reference's result, each row at its
    own length (some end one token into their own pages, some many pages after)."""
    g = torch.Generator().manual_seed(rows * 100 + shared + head_dim)
    block_size, num_pages = 16, 1200
    k, v = pool_views(num_pages, block_size, kv_heads, head_dim, dtype, g)
    ctx_lens = [shared * block_size + 1 + int(x) for x in torch.randint(0, 70, (rows,), generator=g)]
    ctx_lens[0] = shared * block_size + 1  # its query is the first token after the prefix
    ctx_lens[1] = shared * block_size + 300  # 300 keys of its own: the kernel's part in chunks, then the prefix
    meta = shared_meta(ctx_lens, shared, block_size, num_pages, g)
    q = torch.randn(rows, heads, head_dim, generator=g).to(dtype)
    ref, fast = both(heads, kv_heads, head_dim)
    out = fast.forward(q, k, v, meta)
    assert meta.decodes[0].shared_pages.tolist() == meta.decodes[0].page_tables[0, :shared].tolist()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref.forward(q, k, v, meta).float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("rows,heads,kv_heads,head_dim,pages,block_size", [
    (32, 9, 3, 64, 64, 16),  # SmolLM2's shape: 96 query vectors a KV head, 1,024 keys in four chunks
    (1, 2, 1, 64, 1, 16),  # one query vector, one page
    (7, 8, 2, 128, 21, 16),  # chunks of 256 keys, the last one 80
    (33, 9, 3, 64, 17, 5),  # 85 keys: a panel of 64 and one of 21 (zeros after)
    (3, 4, 1, 256, 9, 16),
    (70, 4, 4, 32, 40, 8),  # 70 query vectors, 320 keys: two chunks
    (50, 9, 3, 64, 40, 16),  # 150 query vectors a KV head: two blocks of 75; 640 keys: chunks in groups
    (200, 9, 3, 64, 48, 16),  # 600 query vectors: five blocks, each over three chunks merged as it goes
])
def test_shared_prefix_product_matches_float64(rows, heads, kv_heads, head_dim, pages, block_size):
    """paged_attention_shared (the cascade's first half as matrix products, float32): every query against every key
    of the given pages, in their order; its output and log-sum-exp against float64 on fresh random values."""
    kernel = cpu_kernel.load()
    if head_dim not in kernel.paged_attention_shared_dims():
        pytest.skip("no vectors for paged_attention_shared on this CPU")
    g = torch.Generator().manual_seed(rows + pages + head_dim)
    num_pages = 3 * pages + 2
    k, v = pool_views(num_pages, block_size, kv_heads, head_dim, torch.float32, g)
    page_ids = torch.randperm(num_pages, generator=g)[:pages]
    q = torch.randn(rows, heads, head_dim, generator=g)
    scale = head_dim ** -0.5
    out, lse = kernel.paged_attention_shared(q, k, v, page_ids, scale)
    keys = k[page_ids].reshape(-1, kv_heads, head_dim).double().repeat_interleave(heads // kv_heads, 1)
    values = v[page_ids].reshape(-1, kv_heads, head_dim).double().repeat_interleave(heads // kv_heads, 1)
    scores = torch.einsum("nhd,lhd->nhl", q.double(), keys) * scale
    torch.testing.assert_close(lse.double(), scores.logsumexp(-1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.double(), torch.einsum("nhl,lhd->nhd", scores.softmax(-1), values),
                               rtol=1e-5, atol=1e-5)


def test_shared_prefix_product_refuses_bad_arguments_by_name():
    kernel = cpu_kernel.load()
    if 64 not in kernel.paged_attention_shared_dims():
        pytest.skip("no vectors for paged_attention_shared on this CPU")
    k = v = torch.randn(4, 16, 2, 64)
    q = torch.randn(3, 4, 64)
    with pytest.raises(RuntimeError, match="float32 q with head_dim"):
        kernel.paged_attention_shared(q.bfloat16(), k, v, torch.tensor([1]), 0.1)
    with pytest.raises(RuntimeError, match="pages must be a non-empty"):
        kernel.paged_attention_shared(q, k, v, torch.tensor([], dtype=torch.long), 0.1)
    with pytest.raises(RuntimeError, match="page id 4 outside the pool of 4 pages"):
        kernel.paged_attention_shared(q, k, v, torch.tensor([1, 4]), 0.1)
    with pytest.raises(RuntimeError, match="head shapes disagree"):
        kernel.paged_attention_shared(torch.randn(3, 3, 64), k, v, torch.tensor([1]), 0.1)


def test_the_cascade_takes_only_what_every_row_shares_and_only_where_it_pays():
    g = torch.Generator().manual_seed(11)
    heads, kv_heads, head_dim, block_size, num_pages = 8, 2, 32, 16, 800
    k, v = pool_views(num_pages, block_size, kv_heads, head_dim, torch.float32, g)
    ref, fast = both(heads, kv_heads, head_dim)

    def run(ctx_lens, shared, diverge=None, window=None):
        meta = shared_meta(ctx_lens, shared, block_size, num_pages, g, diverge)
        meta.sliding_window = window
        q = torch.randn(len(ctx_lens), heads, head_dim, generator=g)
        torch.testing.assert_close(fast.forward(q, k, v, meta), ref.forward(q, k, v, meta), rtol=1e-5, atol=1e-5)
        return meta.decodes[0].shared_pages.numel()

    long = 24 * 16 + 5
    assert run([long] * 20, 24) == 24
    assert run([long] * 20, 24, diverge={7: 17}) == 17  # one row has its own pages from page 17 on
    assert run([long] * 20, 24, diverge={3: 4}) == 0  # 4 pages in common: 64 tokens, too few
    assert run([long] * 7, 24) == 0  # too few rows
    assert run([12 * 16 + 3] * 20, 12) == 0  # 20 x 192 tokens: too little work
    assert run([long] * 20, 24, window=100) == 0  # the model's sliding window: the kernel alone
    # A row whose query is in page 15 has its own page there: the prefix ends before it for every row.
    assert run([long] * 19 + [15 * 16 + 2], 24, diverge={19: 15}) == 15


def prefill_meta(segments: list[tuple[int, int, int]], block_size: int, num_pages: int, g: torch.Generator,
                 window: int | None = None) -> AttentionMetadata:
    """Prefill chunks (q_len, ctx_len, shared pages): each chunk's context starts with the first ``shared`` pages of
    one common prefix (0: none), then pages of its own."""
    perm = torch.randperm(num_pages, generator=g).tolist()
    prefix = [perm.pop() for _ in range(max(s for _, _, s in segments))]
    segs, start = [], 0
    for q_len, ctx_len, shared in segments:
        pages = prefix[:shared] + [perm.pop() for _ in range(-(-ctx_len // block_size) - shared)]
        segs.append(PrefillSegment(start, q_len, ctx_len, torch.tensor(pages)))
        start += q_len
    slots = torch.zeros(start, dtype=torch.long)
    return AttentionMetadata(slots, slots, [], segs, sliding_window=window)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (8, 8, 32), (8, 1, 128)])
def test_prefill_chunks_attend_their_context_apart_and_match_the_reference(heads, kv_heads, head_dim, dtype):
    """Prefill chunks with cached context: the chunks over a common prefix score it in one call, the others their
    own context in one, each then its own keys (causal; behind a mask where context follows the common pages), the
    softmaxes merged: the reference's one masked SDPA over the whole context, for every chunk."""
    from executor_svc.attention.cascade import split_prefills

    g = torch.Generator().manual_seed(heads * 10 + head_dim)
    block_size, num_pages = 16, 600
    k, v = pool_views(num_pages, block_size, kv_heads, head_dim, dtype, g)
    segments = [(40, 40 + 160, 10),  # its context is exactly the common prefix (10 pages)
                (37, 37 + 160, 10),
                (5, 5 + 203, 10),  # more context after the prefix, and not on a page boundary
                (64, 64 + 170, 10),
                (20, 20 + 100, 0),  # context of its own: split alone
                (16, 16 + 40, 0),  # too little context: the masked SDPA
                (30, 30, 0)]  # no context
    meta = prefill_meta(segments, block_size, num_pages, g)
    q = torch.randn(sum(s[0] for s in segments), heads, head_dim, generator=g).to(dtype)
    ref, fast = both(heads, kv_heads, head_dim)
    out = fast.forward(q, k, v, meta)
    groups = split_prefills(meta, block_size)
    assert [(p.numel(), [meta.prefills.index(s) for s in segs]) for p, segs in groups] == [(10, [0, 1, 2, 3]),
                                                                                           (6, [4])]
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref.forward(q, k, v, meta).float(), rtol=tol, atol=tol)


def test_prefill_chunks_under_a_sliding_window_keep_the_masked_attention():
    from executor_svc.attention.cascade import split_prefills

    g = torch.Generator().manual_seed(5)
    k, v = pool_views(200, 16, 2, 32, torch.float32, g)
    meta = prefill_meta([(20, 20 + 160, 10), (20, 20 + 160, 10)], 16, 200, g, window=48)
    assert split_prefills(meta, 16) == []
    q = torch.randn(40, 4, 32, generator=g)
    ref, fast = both(4, 2, 32)
    torch.testing.assert_close(fast.forward(q, k, v, meta), ref.forward(q, k, v, meta), rtol=1e-5, atol=1e-5)
