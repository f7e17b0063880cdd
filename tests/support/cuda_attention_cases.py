"""Checks of the CUDA attention backend against the torch reference, shared by the GPU tests
(tests/gpu/test_cuda_attention_gpu.py: real kernels on CUDA) and the emulated tests (tests/e2e/test_kernels_emulated.py:
the same kernel source run on the CPU by tests/support/cuda_emulator).

Every check draws fresh random K/V/q (never zeros) into a real page-pool layout (layer 1 of a 2-layer pool: the
K/V views are not contiguous across pages) with scattered pages. The reference is TorchPagedAttention in float32
on the same values upcast (its gather path, reference=True). Tolerances (stated once, here):

* fp16 / bf16 kernels: max |out - ref| / max |ref| <= 1e-2 and mean |out - ref| / mean |ref| <= 2e-3 (fp16) or
  4e-3 (bf16: its 8-bit mantissa alone rounds the output by up to 2^-9 relative);
* fp32 kernels: 2e-5 and 2e-6 (exp2 on the special-function unit, another summation order);
* cache write and page copy: bit-exact.

Positions a kernel must not read (table padding past a request's context, pages wholly outside its sink +
window, pages before the model's window) get "bad" page ids in the kernel's table: on a GPU an id far outside
the pool (a read faults); on the emulator a page full of NaN (a read that is used poisons the output). The
reference gets page 0 there (masked, so never used).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch

from executor_svc.attention.cuda_backend import CudaPagedAttention
from executor_svc.attention.metadata import AttentionMetadata, DecodeGroup, PrefillSegment
from executor_svc.attention.torch_backend import TorchPagedAttention, gather_pages
from executor_svc.pages import DevicePagePool

TOL = {torch.float16: (1e-2, 2e-3), torch.bfloat16: (1e-2, 4e-3), torch.float32: (2e-5, 2e-6)}
SPLIT = {"split": 512, "split64": 64, "nosplit": 1 << 30}  # partition_tokens
FAR_PAGE = 1 << 40  # a page id far outside any pool


@dataclass(frozen=True, slots=True)
class Env:
    """Where the checks run: a device, and the kernel library (None: the real CUDA loader)."""

    device: str
    library: object | None = None

    @property
    def poison_with_nan(self) -> bool:
        # the emulator: unread pages are a NaN page (an unmapped address would kill the test process)
        return bool(getattr(self.library, "emulated", False))

    def attention(self, heads: int, kv_heads: int, head_dim: int, scale: float,
                  partition_tokens: int = 512) -> CudaPagedAttention:
        return CudaPagedAttention(heads, kv_heads, head_dim, scale, partition_tokens=partition_tokens,
                                  library=self.library)

    def sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()


@dataclass(slots=True)
class Request:
    ctx: int
    sink: int = 0
    window: int = 0


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    out, ref = out.float(), ref.float()
    assert torch.isfinite(out).all(), f"{what}: non-finite output"
    err = (out - ref).abs()
    max_rel = (err.max() / ref.abs().max()).item()
    mean_rel = (err.mean() / ref.abs().mean()).item()
    tol_max, tol_mean = TOL[dtype]
    assert max_rel <= tol_max and mean_rel <= tol_mean, (
        f"{what}: max rel err {max_rel:.2e} (tol {tol_max:.0e}), mean rel err {mean_rel:.2e} (tol {tol_mean:.0e})")


def make_pool(env: Env, num_pages: int, block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
              g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    pages = torch.randn((num_pages, 2, 2, block_size, kv_heads, head_dim), generator=g, device=env.device)
    pages = pages.to(dtype)
    return pages, pages[:, 1, 0], pages[:, 1, 1]


def visible(r: Request, pos: int, model_window: int) -> bool:
    ok = pos < r.ctx
    if model_window:
        ok &= pos > r.ctx - 1 - model_window
    if r.window:
        ok &= pos < r.sink or pos > r.ctx - 1 - r.window
    return ok


def decode_tables(reqs: list[Request], block_size: int, num_pages: int, model_window: int, seed: int,
                  bad_page: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(reference table, kernel table) [B, width]: scattered distinct pages from [1, num_pages - 1) (page 0 and
    the last page are reserved); where no position of a page is visible (and in the padding) the reference has
    page 0 and the kernel table ``bad_page``."""
    width = max(-(-r.ctx // block_size) for r in reqs)
    perm = torch.randperm(num_pages - 2, generator=torch.Generator().manual_seed(seed)).add(1).tolist()
    ref, ker = [], []
    for r in reqs:
        rrow, krow = [], []
        for i in range(width):
            seen = any(visible(r, p, model_window) for p in range(i * block_size, (i + 1) * block_size))
            page = perm.pop() if seen else 0
            rrow.append(page)
            krow.append(page if seen else bad_page)
        ref.append(rrow)
        ker.append(krow)
    return torch.tensor(ref, device=device), torch.tensor(ker, device=device)


def run_decode(env: Env, reqs: list[Request], *, dtype: torch.dtype, head_dim: int, block_size: int, heads: int,
               kv_heads: int, partition_tokens: int, model_window: int = 0, seed: int = 0,
               q_scale: float = 1.0) -> None:
    """The decode kernel(s) on a group of requests whose queries sit at scattered rows of a larger flat batch;
    rows outside the group must stay untouched (NaN)."""
    g = torch.Generator(device=env.device).manual_seed(seed)
    num_pages = sum(-(-r.ctx // block_size) for r in reqs) + 8
    pages, k_cache, v_cache = make_pool(env, num_pages, block_size, kv_heads, head_dim, dtype, g)
    bad_page = FAR_PAGE
    if env.poison_with_nan:
        bad_page = num_pages - 1
        pages[bad_page] = float("nan")
    ref_table, ker_table = decode_tables(reqs, block_size, num_pages, model_window, seed, bad_page, env.device)
    batch = len(reqs)
    rows = 2 * batch + 3
    token_idx = torch.randperm(rows, generator=g, device=env.device)[:batch]
    # q_scale > 1: peaked softmax (scores of tens): big jumps of the running max, underflowing exponents
    q = (torch.randn((rows, heads, head_dim), generator=g, device=env.device) * q_scale).to(dtype)
    ctx = torch.tensor([r.ctx for r in reqs], device=env.device)
    windowed = any(r.window for r in reqs)
    sinks = torch.tensor([r.sink for r in reqs], device=env.device) if windowed else None
    windows = torch.tensor([r.window for r in reqs], device=env.device) if windowed else None
    scale = head_dim ** -0.5

    attn = env.attention(heads, kv_heads, head_dim, scale, partition_tokens)
    out = torch.full_like(q, float("nan"))
    attn.decode(q, out, k_cache, v_cache, DecodeGroup(token_idx, ker_table, ctx, sinks, windows), model_window)
    env.sync()

    ref_group = DecodeGroup(torch.arange(batch, device=env.device), ref_table, ctx, sinks, windows)
    empty = torch.zeros(0, dtype=torch.long)
    ref_meta = AttentionMetadata(empty, empty, [ref_group], [], sliding_window=model_window or None)
    ref = TorchPagedAttention(heads, kv_heads, head_dim, scale, reference=True).forward(
        q[token_idx].float(), k_cache.float(), v_cache.float(), ref_meta)
    untouched = torch.ones(rows, dtype=torch.bool, device=env.device)
    untouched[token_idx] = False
    assert torch.isnan(out[untouched]).all(), "rows outside the group's token_idx were written"
    assert_close(out[token_idx], ref, dtype, f"decode B={batch} ctx<={max(r.ctx for r in reqs)}")


def run_decode_q8(env: Env, reqs: list[Request], *, kv_dtype: str, dtype: torch.dtype, head_dim: int,
                  block_size: int, heads: int, kv_heads: int, partition_tokens: int, model_window: int = 0,
                  seed: int = 0) -> None:
    """paged_decode_q8 over an 8-bit pool (executor_svc.kv_quant; layer 1 of 2) against the torch reference over
    the same pages (which dequantizes them), at the same tolerances as the 16/32-bit decode: the kernel must
    dequantize exactly as the reference does. Unread pages are bad ids (GPU) or all-0xff bytes (the emulator:
    NaN fp8 data and bf16 scales, infinite int8 exponents)."""
    from executor_svc.kv_quant import parse_kv_dtype

    g = torch.Generator(device=env.device).manual_seed(seed)
    num_pages = sum(-(-r.ctx // block_size) for r in reqs) + 8
    cfg = SimpleNamespace(num_layers=2, num_kv_heads=kv_heads, head_dim=head_dim)
    pool = DevicePagePool(cfg, num_pages, block_size, dtype, torch.device(env.device),
                          parse_kv_dtype(kv_dtype, dtype))
    k_cache, v_cache = pool.layer(1)
    n = num_pages * block_size
    slots = torch.arange(n, device=env.device)
    fill = AttentionMetadata(slots // block_size, slots % block_size, [], [])
    x = torch.randn((2, n, kv_heads, head_dim), generator=g, device=env.device)
    x[0, :, :, 1] *= 12  # an outlier channel in K
    ref_attn = TorchPagedAttention(heads, kv_heads, head_dim, head_dim ** -0.5, reference=True)
    ref_attn.write_cache(k_cache, v_cache, x[0].to(dtype), x[1].to(dtype), fill)
    bad_page = FAR_PAGE
    if env.poison_with_nan:
        bad_page = num_pages - 1
        pool.pages[bad_page] = 255
    ref_table, ker_table = decode_tables(reqs, block_size, num_pages, model_window, seed, bad_page, env.device)
    batch = len(reqs)
    rows = 2 * batch + 3
    token_idx = torch.randperm(rows, generator=g, device=env.device)[:batch]
    q = torch.randn((rows, heads, head_dim), generator=g, device=env.device).to(dtype)
    ctx = torch.tensor([r.ctx for r in reqs], device=env.device)
    windowed = any(r.window for r in reqs)
    sinks = torch.tensor([r.sink for r in reqs], device=env.device) if windowed else None
    windows = torch.tensor([r.window for r in reqs], device=env.device) if windowed else None
    attn = env.attention(heads, kv_heads, head_dim, head_dim ** -0.5, partition_tokens)
    out = torch.full_like(q, float("nan"))
    attn.decode(q, out, k_cache, v_cache, DecodeGroup(token_idx, ker_table, ctx, sinks, windows), model_window)
    env.sync()
    ref_group = DecodeGroup(torch.arange(batch, device=env.device), ref_table, ctx, sinks, windows)
    empty = torch.zeros(0, dtype=torch.long)
    ref_meta = AttentionMetadata(empty, empty, [ref_group], [], sliding_window=model_window or None)
    ref = ref_attn.forward(q[token_idx].float(), k_cache, v_cache, ref_meta)
    untouched = torch.ones(rows, dtype=torch.bool, device=env.device)
    untouched[token_idx] = False
    assert torch.isnan(out[untouched]).all(), "rows outside the group's token_idx were written"
    assert_close(out[token_idx], ref, dtype, f"{kv_dtype} decode B={batch} ctx<={max(r.ctx for r in reqs)}")


def write_q8_matches_reference(env: Env, kv_dtype: str, dtype: torch.dtype, head_dim: int) -> None:
    """The CUDA backend's quantizing cache write against the torch reference's, step by step on pools that start
    with the same stale bytes: prefill runs over several pages, decodes, a chunk that continues a page with
    larger values (INT8 K: its channel exponents grow and the page's earlier tokens are requantized). Every
    written slot's bytes, its scales and the pages' exponents must be identical."""
    from executor_svc.kv_quant import parse_kv_dtype

    block, heads, kv_heads = 16, 8, 4
    cfg = SimpleNamespace(num_layers=2, num_kv_heads=kv_heads, head_dim=head_dim)
    fmt = parse_kv_dtype(kv_dtype, dtype)
    pools = [DevicePagePool(cfg, 12, block, dtype, torch.device(env.device), fmt) for _ in range(2)]
    g = torch.Generator(device=env.device).manual_seed(head_dim)
    stale = torch.randint(0, 256, pools[0].pages.shape, generator=g, device=env.device, dtype=torch.int32)
    for p in pools:
        p.pages.copy_(stale.to(torch.uint8))
    ref = TorchPagedAttention(heads, kv_heads, head_dim, head_dim ** -0.5, reference=True)
    ker = env.attention(heads, kv_heads, head_dim, head_dim ** -0.5)
    # (page, offset) of each token, per step; requests A (pages 3, 7, 1) and B (pages 9, 2)
    steps = [[(3, o) for o in range(16)] + [(7, o) for o in range(16)] + [(1, o) for o in range(5)]
             + [(9, o) for o in range(5)],
             [(1, 5), (9, 5)],
             [(9, o) for o in range(6, 16)] + [(2, o) for o in range(10)]]
    written: set[tuple[int, int]] = set()
    for i, step in enumerate(steps):
        pages = torch.tensor([p for p, _ in step], device=env.device)
        offs = torch.tensor([o for _, o in step], device=env.device)
        x = torch.randn((2, len(step), kv_heads, head_dim), generator=g, device=env.device) * (1 + 3 * i)
        x[0, :, :, 2] *= 10  # an outlier channel in K
        x = x.to(dtype)
        meta = AttentionMetadata(pages, offs, [], [])
        for attn, pool in ((ref, pools[0]), (ker, pools[1])):
            attn.write_cache(*pool.layer(1), x[0], x[1], meta)
        env.sync()
        written |= set(step)
        for which in range(2):  # K, V
            a, b = pools[0].layer(1)[which], pools[1].layer(1)[which]
            for p, o in sorted(written):
                assert torch.equal(a.data[p, o].view(torch.uint8), b.data[p, o].view(torch.uint8)), \
                    f"step {i}: {'KV'[which]} data of page {p} slot {o} differs"
                if hasattr(a, "scale"):
                    assert torch.equal(a.scale[p, o], b.scale[p, o]), f"step {i}: {'KV'[which]} scale {p}/{o}"
                else:
                    assert torch.equal(a.exp[p], b.exp[p]), f"step {i}: K exponents of page {p} differ"
    assert not torch.equal(pools[1].pages[3], stale[3].to(torch.uint8))  # the kernel did write


def gather_q8_matches_reference(env: Env, kv_dtype: str, dtype: torch.dtype, head_dim: int) -> None:
    """gather_kv_q8 (the prefill gather over 8-bit pages) gives exactly the torch reference's dequantized K/V."""
    from executor_svc.kv_quant import parse_kv_dtype

    block, kv_heads = 8, 2
    cfg = SimpleNamespace(num_layers=2, num_kv_heads=kv_heads, head_dim=head_dim)
    pool = DevicePagePool(cfg, 10, block, dtype, torch.device(env.device), parse_kv_dtype(kv_dtype, dtype))
    kc, vc = pool.layer(1)
    g = torch.Generator(device=env.device).manual_seed(7)
    slots = torch.arange(10 * block, device=env.device)
    x = (torch.randn((2, slots.numel(), kv_heads, head_dim), generator=g, device=env.device) * 5).to(dtype)
    ref = TorchPagedAttention(4, kv_heads, head_dim, 1.0, reference=True)
    ref.write_cache(kc, vc, x[0], x[1], AttentionMetadata(slots // block, slots % block, [], []))
    page_ids = torch.tensor([6, 2, 9, 0, 4], device=env.device)
    ctx = 35
    k, v = env.attention(4, kv_heads, head_dim, 1.0).gather_q8(kc, vc, page_ids, ctx, dtype)
    env.sync()
    want_k = gather_pages(kc, page_ids.view(1, -1), dtype)[:, :, :ctx]
    want_v = gather_pages(vc, page_ids.view(1, -1), dtype)[:, :, :ctx]
    assert torch.equal(k, want_k) and torch.equal(v, want_v)


def ragged() -> list[Request]:
    return [Request(c) for c in (1, 5, 16, 17, 100, 513, 1024, 2049)]


def batch256() -> list[Request]:
    g = torch.Generator().manual_seed(256)
    return [Request(int(c)) for c in torch.randint(1, 1100, (256,), generator=g)]


# sinks/windows: a request without one, a window of 1, a sink overlapping the window, long and short contexts
SINK_WINDOW = [Request(90, 4, 20), Request(75, 0, 33), Request(60), Request(3000, 16, 700), Request(1500, 5, 1),
               Request(40, 8, 100), Request(2100, 600, 1000)]


def write_cache_is_exact(env: Env, dtype: torch.dtype, head_dim: int, tokens: int = 300) -> None:
    """The step's K/V, made as the model makes them (slices of one fused qkv projection), into random slots."""
    g = torch.Generator(device=env.device).manual_seed(head_dim)
    block_size, kv_heads, heads = 16, 4, 8
    pages, k_cache, v_cache = make_pool(env, 64, block_size, kv_heads, head_dim, dtype, g)
    expected = pages.clone()
    slots = torch.randperm(64 * block_size, generator=g, device=env.device)[:tokens]
    meta = AttentionMetadata(slots // block_size, slots % block_size, [], [])
    qkv = torch.randn((tokens, (heads + 2 * kv_heads) * head_dim), generator=g, device=env.device).to(dtype)
    _, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    k, v = k.view(tokens, kv_heads, head_dim), v.view(tokens, kv_heads, head_dim)
    env.attention(heads, kv_heads, head_dim, 1.0).write_cache(k_cache, v_cache, k, v, meta)
    TorchPagedAttention(heads, kv_heads, head_dim, 1.0).write_cache(expected[:, 1, 0], expected[:, 1, 1], k, v, meta)
    env.sync()
    assert not torch.equal(pages, pages.clone().normal_()), "the pool is not all one value"
    assert torch.equal(pages, expected)


def copy_pages_is_exact(env: Env, dtype: torch.dtype) -> None:
    cfg = SimpleNamespace(num_layers=3, num_kv_heads=4, head_dim=128)
    pools = [DevicePagePool(cfg, 40, 16, dtype, torch.device(env.device)) for _ in range(2)]
    pools[0].pages.normal_()
    pools[1].pages.copy_(pools[0].pages)
    copied = []
    kernel_copy = env.attention(8, 4, 128, 1.0).copy_pages

    def copier(pages: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        copied.append(src.tolist())
        kernel_copy(pages, src, dst)

    pools[0].copier = copier
    src, dst = [3, 4, 5, 20, 0], [30, 31, 32, 7, 39]  # independent pairs: the kernel
    before = pools[0].pages.clone()
    for pool in pools:
        pool.copy_pages(src, dst)
    env.sync()
    assert copied == [src]
    assert torch.equal(pools[0].pages, pools[1].pages)
    assert torch.equal(pools[0].pages[30], before[3]) and torch.equal(pools[0].pages[39], before[0])
    src, dst = [1, 2], [2, 9]  # page 2 read and written: the indexing path (reads first) in both pools
    for pool in pools:
        pool.copy_pages(src, dst)
    assert torch.equal(pools[0].pages, pools[1].pages) and len(copied) == 1


def prefill_and_mixed_forward(env: Env, dtype: torch.dtype, block_size: int, model_window: int,
                              prefills: tuple[tuple[int, int, int, int], ...] = ((77, 77, 0, 0), (300, 40, 0, 0),
                                                                                 (250, 9, 4, 60)),
                              decodes: tuple[Request, ...] = (Request(33), Request(400), Request(129, 3, 50))) -> None:
    """forward() with prefill chunks (ctx, new tokens, sink, window; with and without cached context) and a
    decode group, in one flat batch."""
    g = torch.Generator(device=env.device).manual_seed(block_size)
    heads, kv_heads, head_dim, num_pages = 16, 4, 128, 200
    _, k_cache, v_cache = make_pool(env, num_pages, block_size, kv_heads, head_dim, dtype, g)
    perm = torch.randperm(num_pages, generator=torch.Generator().manual_seed(block_size)).tolist()
    segs, start = [], 0
    for ctx, n, sink, window in prefills:
        table = torch.tensor([perm.pop() for _ in range(-(-ctx // block_size))], device=env.device)
        segs.append(PrefillSegment(start, n, ctx, table, sink, window))
        start += n
    reqs = list(decodes)
    table, _ = decode_tables(reqs, block_size, num_pages, model_window, block_size, 0, env.device)
    ctx = torch.tensor([r.ctx for r in reqs], device=env.device)
    group = DecodeGroup(torch.arange(start, start + len(reqs), device=env.device), table, ctx,
                        torch.tensor([r.sink for r in reqs], device=env.device),
                        torch.tensor([r.window for r in reqs], device=env.device))
    q = torch.randn((start + len(reqs), heads, head_dim), generator=g, device=env.device).to(dtype)
    empty = torch.zeros(0, dtype=torch.long, device=env.device)
    meta = AttentionMetadata(empty, empty, [group], segs, sliding_window=model_window or None)
    out = env.attention(heads, kv_heads, head_dim, head_dim ** -0.5).forward(q, k_cache, v_cache, meta)
    group.mask = None
    ref = TorchPagedAttention(heads, kv_heads, head_dim, head_dim ** -0.5, reference=True).forward(
        q.float(), k_cache.float(), v_cache.float(), meta)
    assert_close(out[:start], ref[:start], dtype, "prefill rows")
    assert_close(out[start:], ref[start:], dtype, "decode rows")
