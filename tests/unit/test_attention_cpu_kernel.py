"""The CPU kernel that reads decodes' K/V in place (executor_svc/attention/paged_attention_cpu.cpp) against the
torch backend's reference path (gather, then SDPA): its task layouts (a few queries: one task per KV head;
many: one per query), head sizes with and without a compiled-in specialization, bfloat16, the model's window
and requests' sink + window, long contexts; that it copies no pages; and the fallbacks (quantized pages, no
kernel)."""

from __future__ import annotations

import pytest
import torch

from executor_svc.attention import cpu_kernel
from executor_svc.attention.metadata import AttentionMetadata, DecodeGroup
from executor_svc.attention.torch_backend import TorchPagedAttention
from executor_svc.kv_quant import QuantizedCache, parse_kv_dtype
from tests.support.attention_cpu_cases import both, pool_views, shared_meta

pytestmark = [pytest.mark.unit,
              pytest.mark.skipif(cpu_kernel.unavailable_reason() is not None,
                                 reason=f"CPU kernel not buildable here: {cpu_kernel.unavailable_reason()}")]


def decode_meta(ctx_lens: list[int], block_size: int, num_pages: int, g: torch.Generator,
                sink_windows: list[tuple[int, int]] | None = None, window: int | None = None) -> AttentionMetadata:
    perm = torch.randperm(num_pages, generator=g).tolist()
    width = max(-(-c // block_size) for c in ctx_lens) + 1  # one page of padding beyond the longest
    tables = [[perm.pop() for _ in range(-(-c // block_size))] for c in ctx_lens]
    tables = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    sinks = windows = None
    if sink_windows is not None:
        sinks = torch.tensor([s for s, _ in sink_windows])
        windows = torch.tensor([w for _, w in sink_windows])
    group = DecodeGroup(torch.arange(len(ctx_lens)), tables, torch.tensor(ctx_lens), sinks, windows)
    empty = torch.zeros(0, dtype=torch.long)
    return AttentionMetadata(empty, empty, [group], [], sliding_window=window)


@pytest.mark.parametrize("batch", [1, 3, 40], ids=lambda b: f"batch{b}")
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(8, 4, 32), (4, 4, 64), (12, 2, 48), (8, 1, 128)])
def test_in_place_matches_reference(batch, heads, kv_heads, head_dim):
    g = torch.Generator().manual_seed(batch * 1000 + head_dim)
    block_size, num_pages = 16, 40 * 12
    k, v = pool_views(num_pages, block_size, kv_heads, head_dim, torch.float32, g)
    ctx_lens = torch.randint(1, 170, (batch,), generator=g).tolist()
    meta = decode_meta(ctx_lens, block_size, num_pages, g)
    q = torch.randn(batch, heads, head_dim, generator=g)
    ref, fast = both(heads, kv_heads, head_dim)
    assert fast.reads_in_place(q, k)
    torch.testing.assert_close(fast.forward(q, k, v, meta), ref.forward(q, k, v, meta), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [None, 24])
def test_in_place_windows_and_sinks(window):
    """The model's window, requests' sink + window (sink inside, reaching, or beyond the window; none), and
    both together: the visible positions are the reference's masks."""
    g = torch.Generator().manual_seed(7)
    heads, kv_heads, head_dim, block_size, num_pages = 8, 2, 32, 8, 200
    k, v = pool_views(num_pages, block_size, kv_heads, head_dim, torch.float32, g)
    ctx_lens = [90, 75, 60, 30, 12, 100, 41]
    sink_windows = [(4, 20), (0, 33), (0, 0), (25, 10), (3, 40), (64, 30), (1, 1)]
    meta = decode_meta(ctx_lens, block_size, num_pages, g, sink_windows, window)
    q = torch.randn(len(ctx_lens), heads, head_dim, generator=g)
    ref, fast = both(heads, kv_heads, head_dim)
    torch.testing.assert_close(fast.forward(q, k, v, meta), ref.forward(q, k, v, meta), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [None, 300])
def test_long_queries_alone_and_in_a_batch(window):
    """Long contexts (up to 1,100 keys), a sink + window in two runs, next to short ones: within float32 noise of the
    reference, and each row's bits the same alone as in the batch (the task layout changes with the batch size, a
    row's arithmetic does not)."""
    g = torch.Generator().manual_seed(11)
    heads, kv_heads, head_dim, block_size, num_pages = 9, 3, 64, 16, 700
    k, v = pool_views(num_pages, block_size, kv_heads, head_dim, torch.float32, g)
    ctx_lens = [1100, 600, 128, 129, 17, 257, 900, 1]
    sink_windows = [(4, 200), (0, 0), (0, 0), (0, 0), (0, 0), (100, 100), (0, 0), (0, 0)]
    meta = decode_meta(ctx_lens, block_size, num_pages, g, sink_windows, window)
    q = torch.randn(len(ctx_lens), heads, head_dim, generator=g)
    ref, fast = both(heads, kv_heads, head_dim)
    got = fast.forward(q, k, v, meta)
    torch.testing.assert_close(got, ref.forward(q, k, v, meta), rtol=1e-5, atol=1e-5)
    group = meta.decodes[0]
    for row in (0, 1, 3, 5):
        alone = DecodeGroup(torch.arange(1), group.page_tables[row:row + 1], group.ctx_lens[row:row + 1],
                            group.sinks[row:row + 1], group.windows[row:row + 1])
        empty = torch.zeros(0, dtype=torch.long)
        one = fast.forward(q[row:row + 1], k, v, AttentionMetadata(empty, empty, [alone], [], sliding_window=window))
        assert torch.equal(one[0], got[row]), row


def test_in_place_bfloat16():
    g = torch.Generator().manual_seed(3)
    heads, kv_heads, head_dim, block_size, num_pages = 8, 4, 64, 16, 300
    k, v = pool_views(num_pages, block_size, kv_heads, head_dim, torch.bfloat16, g)
    ctx_lens = torch.randint(1, 200, (20,), generator=g).tolist()
    meta = decode_meta(ctx_lens, block_size, num_pages, g)
    q = torch.randn(20, heads, head_dim, generator=g).bfloat16()
    ref, fast = both(heads, kv_heads, head_dim)
    assert fast.reads_in_place(q, k)
    out = fast.forward(q, k, v, meta)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref.forward(q, k, v, meta).float(), rtol=2e-2, atol=2e-2)


class OpLog(torch.overrides.TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.names.add(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


def test_in_place_copies_no_pages():
    """Decodes never gather: no index_select and no SDPA on the fast path, both on the reference's."""
    g = torch.Generator().manual_seed(5)
    k, v = pool_views(64, 16, 4, 32, torch.float32, g)
    meta = decode_meta([33, 70, 5], 16, 64, g)
    q = torch.randn(3, 8, 32, generator=g)
    ref, fast = both(8, 4, 32)
    for attention, gathers in ((ref, True), (fast, False)):
        with OpLog() as ops:
            attention.forward(q, k, v, meta)
        assert ("index_select" in ops.names) is gathers, ops.names
        assert ("scaled_dot_product_attention" in ops.names) is gathers, ops.names
    # nor does a float32 cascade over a shared prefix (the kernel library attends the prefix where it lies)
    k, v = pool_views(200, 16, 4, 32, torch.float32, g)
    meta = shared_meta([24 * 16 + 5] * 20, 24, 16, 200, g)
    q = torch.randn(20, 8, 32, generator=g)
    with OpLog() as ops:
        fast.forward(q, k, v, meta)
    assert meta.decodes[0].shared_pages.numel() == 24
    assert "index_select" not in ops.names, ops.names


def test_quantized_pages_and_other_kv_dtypes_gather():
    """8-bit pages and a KV dtype other than q's take the reference path, which dequantizes / casts."""
    g = torch.Generator().manual_seed(9)
    fmt = parse_kv_dtype("fp8_e4m3", torch.float32)
    data = torch.zeros(8, 16, 2, 32, dtype=torch.float8_e4m3fn)
    quantized = QuantizedCache(data, torch.ones(8, 16, 2, dtype=torch.bfloat16), fmt)
    q = torch.randn(2, 4, 32, generator=g)
    fast = TorchPagedAttention(4, 2, 32, 1.0)
    assert not fast.reads_in_place(q, quantized)
    assert not fast.reads_in_place(q, torch.zeros(8, 16, 2, 32, dtype=torch.bfloat16))
    assert fast.reads_in_place(q, torch.zeros(8, 16, 2, 32))


def test_no_kernel_falls_back_to_gather(monkeypatch):
    """A machine where the kernel cannot be built (here: PAGEDKV_CPU_ATTENTION=reference) gathers, with the
    same results, and says why."""
    monkeypatch.setattr(cpu_kernel, "_state", {})
    monkeypatch.setenv("PAGEDKV_CPU_ATTENTION", "reference")
    g = torch.Generator().manual_seed(11)
    k, v = pool_views(64, 16, 4, 32, torch.float32, g)
    meta = decode_meta([33, 70, 5], 16, 64, g)
    q = torch.randn(3, 8, 32, generator=g)
    ref, fast = both(8, 4, 32)
    assert not fast.reads_in_place(q, k)
    assert cpu_kernel.reason() == "PAGEDKV_CPU_ATTENTION=reference"
    assert torch.equal(fast.forward(q, k, v, meta), ref.forward(q, k, v, meta))


def test_kernel_rejects_mismatched_inputs():
    """The operator checks what it reads: a wrong table dtype is an error naming it, not a bad read."""
    kernel = cpu_kernel.load()
    q = torch.randn(2, 4, 32)
    k = torch.randn(8, 16, 2, 32)
    with pytest.raises(RuntimeError, match="tables"):
        kernel.paged_attention(q, k, k, torch.zeros(2, 1, dtype=torch.int32), torch.empty(0, dtype=torch.long),
                               torch.tensor([3, 4]), torch.empty(0, dtype=torch.long),
                               torch.empty(0, dtype=torch.long), 0, 1.0)


def test_kernel_refuses_reads_outside_the_pool():
    """A page id beyond the pool, or a context beyond the page table, is an error, as index_select's is."""
    kernel = cpu_kernel.load()
    q = torch.randn(1, 4, 32)
    k = torch.randn(8, 16, 2, 32)
    none = torch.empty(0, dtype=torch.long)
    with pytest.raises(RuntimeError, match="page id 8 outside the pool of 8 pages"):
        kernel.paged_attention(q, k, k, torch.tensor([[3, 8]]), none, torch.tensor([20]), none, none, 0, 1.0)
    with pytest.raises(RuntimeError, match="outside its page table of 2 pages"):
        kernel.paged_attention(q, k, k, torch.tensor([[3, 4]]), none, torch.tensor([32]), none, none, 0, 1.0)


def test_failed_build_falls_back_and_leaves_no_work_directory(monkeypatch, tmp_path):
    """A build that fails (here: a flag g++ refuses) is a reason, not an error; its private build directory
    is removed and nothing half-built lands in the cache."""
    monkeypatch.setattr(cpu_kernel, "_state", {})
    monkeypatch.setattr(cpu_kernel, "CFLAGS", [*cpu_kernel.CFLAGS, "-fno-such-flag-pagedkv"])
    monkeypatch.setenv("PAGEDKV_KERNEL_CACHE_DIR", str(tmp_path))
    assert cpu_kernel.load() is None
    assert cpu_kernel.reason().startswith("build of pagedkv_attention_cpu_"), cpu_kernel.reason()
    assert list(tmp_path.iterdir()) == []
    q = torch.randn(1, 4, 32)
    assert not TorchPagedAttention(4, 2, 32, 1.0).reads_in_place(q, torch.zeros(8, 16, 2, 32))


def test_the_runner_puts_every_decode_in_one_group_when_they_are_read_in_place(tiny_llama_dir):
    """Read in place, decodes of very different lengths go to the kernel in one call per layer (one group; the
    kernel reads each row to its own length, so the padding costs nothing); gathering, they are grouped by length
    (the copy is padded to a group's longest). Tokens equal either way."""
    from tests.support.inprocess import InProcessServer

    prompts = [[(5 * i + j) % 200 + 3 for j in range(3 + 37 * i)] for i in range(7)]  # 1 to 15 pages
    max_tokens = [12] * 7
    widths: dict[str, list[list[int]]] = {}
    outputs = {}
    for path in ("in place", "gather"):
        server = InProcessServer(tiny_llama_dir, num_pages=160, max_num_seqs=8)
        if path == "gather":
            a = server.runner.attention
            server.runner.attention = TorchPagedAttention(a.num_heads, a.num_kv_heads, a.head_dim, a.scale,
                                                          reference=True)
        build = server.runner._build_batch
        seen = widths.setdefault(path, [])

        def spy(scheduled, build=build, seen=seen):
            out = build(scheduled)
            if out[2].decodes:
                seen.append([g.page_tables.shape[0] for g in out[2].decodes])
            return out

        server.runner._build_batch = spy
        outputs[path] = [r.output_ids for r in server.generate(prompts, max_tokens)]
    assert outputs["in place"] == outputs["gather"]
    assert widths["in place"] and all(len(groups) == 1 for groups in widths["in place"])
    assert max(len(groups) for groups in widths["gather"]) > 3


def test_decodes_stay_in_length_groups_where_they_are_gathered():
    """One group only where a kernel reads the pages (float32 pages, or 8-bit pages under any model dtype:
    q8_decode.py): pages on another device than the CPU (here 'meta', as a CUDA pool would be), 16-bit pages under
    another model dtype and the reference path keep the length groups (the gather pads each group's copy to its
    longest table)."""
    import math

    from executor_svc.attention.metadata import DECODE_SLACK

    fast, ref = TorchPagedAttention(8, 4, 32, 32 ** -0.5), TorchPagedAttention(8, 4, 32, 32 ** -0.5, reference=True)
    cpu = torch.zeros(4, 16, 4, 32)
    assert fast.decode_group_slack(cpu, torch.float32) == math.inf
    assert fast.decode_group_slack(torch.zeros(4, 16, 4, 32, device="meta"), torch.float32) == DECODE_SLACK
    assert fast.decode_group_slack(cpu, torch.bfloat16) == DECODE_SLACK  # (a KV dtype other than the model's)
    assert ref.decode_group_slack(cpu, torch.float32) == DECODE_SLACK
    fmt = parse_kv_dtype("fp8_e4m3", torch.float32)
    quantized = QuantizedCache(torch.zeros(4, 16, 4, 32, dtype=torch.float8_e4m3fn),
                               torch.ones(4, 16, 4, dtype=torch.bfloat16), fmt)
    assert fast.decode_group_slack(quantized, torch.float32) == math.inf  # (read in place: q8_decode.py)
    assert fast.decode_group_slack(quantized, torch.bfloat16) == math.inf  # (a 16-bit model's too)
    assert ref.decode_group_slack(quantized, torch.float32) == DECODE_SLACK
