"""The CPU writes of 8-bit KV pages (executor_svc/attention/kv_write_cpu.cpp: ``write_q8``, ``write_int8_channels``)
against the pool's torch writes (QuantizedCache.write, ChannelScaledCache.write with the kernel library hidden), bit
for bit: two copies of one pool (garbage bytes and exponents, as pages reused from earlier owners), each call written
through the kernel into one and through torch into the other, and every byte of both pools equal after every call.
Fresh random rows with outlier channels, tiny values (FP8 subnormals), halfway points of INT8's rounding, all-zero
rows, NaN and inf; decodes (one token a page per row), prefill chunks (many tokens of the same pages, from offset 0
and from mid-page, beside decodes), INT8 K exponents growing (earlier tokens requantized) and pages reused (written
again from offset 0); float32, bfloat16 and float16 rows; strided rows; bad arguments refused."""

from __future__ import annotations

import contextlib
import math
from types import SimpleNamespace

import pytest
import torch

from executor_svc import kv_quant
from executor_svc.attention import cpu_kernel
from executor_svc.kv_quant import parse_kv_dtype
from executor_svc.pages import DevicePagePool

pytestmark = [pytest.mark.unit, pytest.mark.skipif(cpu_kernel.unavailable_reason() is not None,
                                                   reason="no CPU kernel library here")]
LAYERS = 2
# kv_heads, head_dim, block (head_dim 40: a row's last 8 elements past its 16-element chunks)
SHAPES = [(4, 32, 16), (3, 48, 8), (3, 64, 16), (1, 128, 8), (1, 64, 16), (4, 128, 16), (2, 40, 8)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(scope="module")
def kernel():
    module = cpu_kernel.load()
    assert module is not None and hasattr(module, "write_q8") and hasattr(module, "write_int8_channels"), \
        cpu_kernel.reason()
    return module


@contextlib.contextmanager
def _torch_path():
    """The pool's writes through torch (the reference): the kernel library hidden from kv_quant."""
    saved = kv_quant._writer
    kv_quant._writer = lambda data, x: None
    try:
        yield
    finally:
        kv_quant._writer = saved


def _pools(kv: str, heads: int, dim: int, block: int, num_pages: int, seed: int):
    """Two pools holding the same garbage: random data and scale bytes, INT8 K exponents in [0, 254] (a quarter 0)."""
    cfg = SimpleNamespace(num_layers=LAYERS, num_kv_heads=heads, head_dim=dim)
    fmt = parse_kv_dtype(kv, torch.float32)
    fast, ref = (DevicePagePool(cfg, num_pages, block, torch.float32, torch.device("cpu"), fmt) for _ in range(2))
    g = torch.Generator().manual_seed(seed)
    fast.pages.copy_(torch.randint(0, 256, fast.pages.shape, generator=g).to(torch.uint8))
    for layer in range(LAYERS):
        k, _ = fast.layer(layer)
        if isinstance(k, kv_quant.ChannelScaledCache):
            e = torch.randint(1, 255, k.exp.shape, generator=g)
            k.exp.copy_(torch.where(torch.rand(k.exp.shape, generator=g) < 0.25, 0, e).to(torch.uint8))
    ref.pages.copy_(fast.pages)
    return fast, ref


def _write(fast: DevicePagePool, ref: DevicePagePool, pages: torch.Tensor, offsets: torch.Tensor,
           k: torch.Tensor, v: torch.Tensor) -> None:
    """K and V of every layer through the kernel into ``fast`` and through torch into ``ref``; every byte equal."""
    for layer in range(LAYERS):
        kf, vf = fast.layer(layer)
        assert kv_quant._writer(kf.data, k) is not None  # (the kernel path is the one taken)
        kf.write(pages, offsets, k)
        vf.write(pages, offsets, v)
        kr, vr = ref.layer(layer)
        with _torch_path():
            kr.write(pages, offsets, k)
            vr.write(pages, offsets, v)
    if not torch.equal(fast.pages, ref.pages):
        where = (fast.pages != ref.pages).nonzero()
        raise AssertionError(f"{len(where)} bytes differ, first at (page, layer, byte) {where[0].tolist()}: "
                             f"kernel {fast.pages[tuple(where[0])].item()}, torch {ref.pages[tuple(where[0])].item()}")


_FP8_VALUES = torch.arange(256, dtype=torch.int16).to(torch.uint8).view(torch.float8_e4m3fn).float()
_FP8_FINITE = _FP8_VALUES[torch.isfinite(_FP8_VALUES) & (_FP8_VALUES >= 0)].sort().values
_FP8_MIDPOINTS = (_FP8_FINITE[1:] + _FP8_FINITE[:-1]) / 2  # (exact in float32)


def _rows(g: torch.Generator, n: int, heads: int, dim: int, dtype: torch.dtype, size: float = 1.0) -> torch.Tensor:
    """[n, heads, dim] rows of different sizes with a few outlier channels, and among them: rows spanning 2^-30..1
    of their maximum (E4M3 subnormals, INT8 zeros), rows on INT8's halfway points ((k + 1/2) x a power of two) and on
    E4M3's midpoints (times a power of two, beside 448 x it), all-zero rows (some of -0.0)."""
    x = torch.randn(n, heads, dim, generator=g) * torch.exp(torch.randn(n, heads, 1, generator=g) * 2) * size
    x[..., torch.randperm(dim, generator=g)[:2]] *= 40  # outlier channels
    kind = torch.randint(0, 8, (n, heads), generator=g)
    p2 = torch.pow(2.0, torch.randint(-12, 6, (n, heads, 1), generator=g).float() + round(math.log2(size)))
    sign = torch.where(torch.rand(n, heads, dim, generator=g) < 0.5, -1.0, 1.0)
    wide = sign * torch.pow(2.0, -30 * torch.rand(n, heads, dim, generator=g)) * x.abs().amax(-1, keepdim=True)
    halves = (torch.randint(-127, 127, (n, heads, dim), generator=g) + 0.5) * p2
    halves[..., 0] = 127 * p2[..., 0]  # the row's scale exactly p2 (INT8 V)
    mids = sign * _FP8_MIDPOINTS[torch.randint(0, len(_FP8_MIDPOINTS), (n, heads, dim), generator=g)] * p2
    mids[..., 0] = 448 * p2[..., 0]  # the row's scale exactly p2 (FP8)
    x = torch.where((kind == 1).unsqueeze(-1), wide, x)
    x = torch.where((kind == 2).unsqueeze(-1), halves, x)
    x = torch.where((kind == 3).unsqueeze(-1), mids, x)
    x = torch.where((kind == 4).unsqueeze(-1), 0.0, x)
    x[(kind == 4) & (torch.rand(n, heads, generator=g) < 0.5)] = -0.0
    return x.to(dtype)


class _Request:
    def __init__(self, pages: list[int], start: int = 0) -> None:
        self.pages, self.pos = pages, start

    def slots(self, n: int, block: int) -> tuple[list[int], list[int]]:
        pos = range(self.pos, self.pos + n)
        self.pos += n
        return [self.pages[p // block] for p in pos], [p % block for p in pos]


def _call(reqs: list[tuple[_Request, int]], block: int) -> tuple[torch.Tensor, torch.Tensor]:
    pages, offsets = [], []
    for req, n in reqs:
        p, o = req.slots(n, block)
        pages += p
        offsets += o
    return torch.tensor(pages), torch.tensor(offsets)


@pytest.mark.parametrize("kv", ["fp8_e4m3", "int8"])
@pytest.mark.parametrize("heads,dim,block", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_prefills_and_decodes_equal_the_torch_writes(kernel, kv, heads, dim, block, dtype):
    """Prefill chunks (from offset 0 and from mid-page, beside decodes), decode steps whose rows grow (INT8 K's
    exponents grow: earlier tokens requantized), then a finished request's pages reused from offset 0."""
    seed = dim * 10 + heads + block + DTYPES.index(dtype)
    g = torch.Generator().manual_seed(seed)
    num_pages = 24
    fast, ref = _pools(kv, heads, dim, block, num_pages, seed)
    free = torch.randperm(num_pages, generator=g).tolist()
    take = lambda n: [free.pop() for _ in range(n)]  # noqa: E731
    a, b, c = _Request(take(5)), _Request(take(4)), _Request(take(4), start=block // 2 + 1)  # c: from mid-page
    steps = [
        [(a, 2 * block + 3)],  # a prefill from offset 0 over three pages
        [(b, block // 2), (c, 3)],  # a chunk from offset 0 and one from mid-page
        [(b, block), (a, 1), (c, 1)],  # a chunk from mid-page over a page boundary, beside decodes
    ] + [[(a, 1), (b, 1), (c, 1)]] * 8  # decodes
    size = 1.0
    for i, step in enumerate(steps):
        pages, offsets = _call(step, block)
        size *= 3.0 if i % 3 == 2 else 0.7  # rows larger now and then: INT8 K's exponents grow
        k, v = (_rows(g, len(pages), heads, dim, dtype, size) for _ in range(2))
        _write(fast, ref, pages, offsets, k, v)
    free += a.pages  # a finishes: its pages go to a new request, written from offset 0 (fresh exponents)
    d = _Request(take(4))
    for step in ([(d, block + 2), (b, 1)], [(d, 1), (b, 1), (c, 1)], [(d, 1), (c, 2)]):
        pages, offsets = _call(step, block)
        k, v = (_rows(g, len(pages), heads, dim, dtype, 0.01) for _ in range(2))
        _write(fast, ref, pages, offsets, k, v)


@pytest.mark.parametrize("kv", ["fp8_e4m3", "int8"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_batch_equals_the_torch_writes(kernel, kv, dtype):
    """A decode step at batch 32 (SmolLM2's 3 KV heads of 64): one token a page per row at random offsets, int32
    page ids and offsets (the cache converts them), rows strided in every dimension."""
    g = torch.Generator().manual_seed(7)
    fast, ref = _pools(kv, 3, 64, 16, 40, seed=7)
    for _ in range(6):
        pages = torch.randperm(40, generator=g)[:32].int()
        offsets = torch.randint(0, 16, (32,), generator=g).int()
        k = _rows(g, 32, 3, 128, dtype)[..., ::2]  # strided head_dim
        v = _rows(g, 3, 32, 64, dtype).transpose(0, 1)  # tokens not outermost
        _write(fast, ref, pages, offsets, k, v)


@pytest.mark.parametrize("kv", ["fp8_e4m3", "int8"])
def test_long_prefill_chunks_over_threads(kernel, kv):
    """Chunks large enough to be split over torch's threads (rows for write_q8, pages for write_int8_channels):
    two requests' 300-token chunks from mid-page, then 200 more tokens each that grow INT8 K's exponents."""
    g = torch.Generator().manual_seed(17)
    fast, ref = _pools(kv, 4, 128, 16, 64, seed=17)
    free = torch.randperm(64, generator=g).tolist()
    a, b = _Request(free[:32], start=5), _Request(free[32:], start=11)
    for n, size in ((300, 1.0), (200, 8.0)):
        pages, offsets = _call([(a, n), (b, n)], 16)
        k, v = (_rows(g, len(pages), 4, 128, torch.bfloat16, size) for _ in range(2))
        _write(fast, ref, pages, offsets, k, v)


@pytest.mark.parametrize("kv", ["fp8_e4m3", "int8"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_nan_and_inf_rows_as_torch(kernel, kv, dtype):
    """NaN and +-inf written as torch writes them: a NaN's row (and INT8 K: its channel) keeps its scale 1 (and
    exponent), FP8 NaN bytes keep the NaN's sign, INT8 NaN -> 0; inf makes the row's scale inf."""
    g = torch.Generator().manual_seed(11)
    fast, ref = _pools(kv, 3, 32, 8, 12, seed=11)
    for step in range(4):
        pages = torch.tensor([1, 1, 1, 4, 5, 7]) + step % 2
        offsets = torch.tensor([0, 1, 2, 5, 3, 7]) if step < 2 else torch.tensor([3, 4, 5, 6, 4, 0])
        k, v = (_rows(g, 6, 3, 32, torch.float32) for _ in range(2))
        for x in (k, v):
            x[0, 0, 3] = float("nan")
            x[1, 1, :] = -float("nan")
            x[2, 2, 5] = float("inf")
            x[3, 0, 7] = -float("inf")
            x[4, 1, 0] = float("nan")
            x[4, 1, 1] = float("inf")
        _write(fast, ref, pages, offsets, k.to(dtype), v.to(dtype))


@pytest.mark.parametrize("kv", ["fp8_e4m3", "int8"])
def test_halfway_points_round_to_even(kernel, kv):
    """INT8: rows whose quotients are exactly k + 1/2 (round half to even, both paths); FP8: midpoints between
    neighbouring E4M3 values. The inputs are checked to hold such quotients."""
    g = torch.Generator().manual_seed(5)
    fast, ref = _pools(kv, 4, 64, 16, 8, seed=5)
    n = 16
    p2 = torch.pow(2.0, torch.randint(-8, 8, (n, 4, 1), generator=g).float())
    if kv == "int8":
        x = (torch.randint(-127, 127, (n, 4, 64), generator=g) + 0.5) * p2
        x[..., 0] = 127 * p2[..., 0]
        q = x / p2
    else:
        idx = torch.randint(0, len(_FP8_MIDPOINTS), (n, 4, 64), generator=g)
        x = _FP8_MIDPOINTS[idx] * p2 * torch.where(torch.rand(n, 4, 64, generator=g) < 0.5, -1.0, 1.0)
        x[..., 0] = 448 * p2[..., 0]
        q = x / p2
    scale = kv_quant.quantize(x, parse_kv_dtype(kv, torch.float32))[1].float().unsqueeze(-1)
    assert torch.equal(scale, p2)  # (the row's scale is exactly p2: the quotients are the halfway points)
    if kv == "int8":
        assert bool(((q - q.floor()) == 0.5).sum() > n * 4 * 60)
    pages = torch.arange(n) // 2
    offsets = torch.arange(n) % 2 * 3
    _write(fast, ref, pages, offsets, x, x.flip(0))


def _binades() -> torch.Tensor:
    """Channel maxima over every float32 binade: 127 x 2^k (amax / 127 exactly a power of two) and its neighbours,
    subnormals (the smallest: amax / 127 rounds to 0), the largest floats, inf, 0 and NaN."""
    p2 = torch.pow(2.0, torch.arange(-149, 128).float())
    return torch.cat([p2 * 127, p2 * 127 * (1 + 2.0 ** -23), p2 * 127 * (1 - 2.0 ** -24), p2, p2 * 1.5, p2 * 3])


_SPECIALS = torch.tensor([1e-45, 3e-45, 1e-40, 1e-38, 1.2e-38, 3.4e38, 3.0e38, 1.7e38, float("inf"), 0.0, float("nan")])


@pytest.mark.parametrize("kv", ["fp8_e4m3", "int8"])
def test_every_binade_as_torch(kernel, kv):
    """Rows whose channels' maxima cover every float32 binade (INT8 K's exponents from each: fresh pages, then
    grown by a second token of each page), subnormal inputs included."""
    g = torch.Generator().manual_seed(13)
    v = _binades()
    heads, dim = 3, 48
    n = -(-len(v) // (heads * dim))
    fast, ref = _pools(kv, heads, dim, 8, n + 1, seed=13)
    x = v[torch.arange(n * heads * dim) % len(v)].view(n, heads, dim)
    x = x * torch.where(torch.rand(x.shape, generator=g) < 0.5, -1.0, 1.0)
    x[..., 1::2] *= torch.pow(2.0, -torch.randint(0, 30, x[..., 1::2].shape, generator=g).float())
    x[:len(_SPECIALS), 0, 0] = _SPECIALS  # (alone in their channel of a fresh page: the exponent is theirs)
    pages = torch.arange(n)
    _write(fast, ref, pages, torch.zeros(n, dtype=torch.long), x, x)  # fresh pages: the exponents are the needs
    y = x[torch.randperm(n, generator=g)].roll(7, dims=2)  # other maxima: some channels grow
    _write(fast, ref, pages, torch.ones(n, dtype=torch.long), y, y)


@pytest.mark.parametrize("kv", ["fp8_e4m3", "int8"])
def test_duplicate_slots_store_the_last_row(kernel, kv):
    """The same slot twice in one call (a plan never has it): the last row in order is stored, as torch's serial
    index_put does; INT8 K's exponents count both rows, as its scatter_reduce does."""
    g = torch.Generator().manual_seed(3)
    fast, ref = _pools(kv, 3, 64, 16, 6, seed=3)
    pages, offsets = torch.tensor([2, 3, 2, 2, 4]), torch.tensor([5, 0, 6, 5, 1])
    k, v = (_rows(g, 5, 3, 64, torch.float32) for _ in range(2))
    k[0] *= 100  # the overwritten row is the larger one: INT8 K's exponents from it
    _write(fast, ref, pages, offsets, k, v)


def test_torch_powers_of_two_are_exact():
    """The kernel's powers of two (INT8 K's scales and requantization shifts) are 2^k rounded to float32 once, as
    torch.pow(2.0, k) gives them: 2^-150 and below 0, 2^128 inf."""
    k = torch.arange(-255, 256)
    exact = torch.tensor([math.ldexp(1.0, int(e)) if e < 128 else math.inf for e in k], dtype=torch.float64)
    assert torch.equal(torch.pow(2.0, k.float()), exact.float())


def test_empty_call_writes_nothing(kernel):
    fast, ref = _pools("int8", 3, 64, 16, 4, seed=1)
    empty = torch.zeros(0, dtype=torch.long)
    _write(fast, ref, empty, empty, torch.zeros(0, 3, 64), torch.zeros(0, 3, 64))


def _args(kv: str = "fp8_e4m3"):
    fast, _ = _pools(kv, 3, 64, 16, 4, seed=2)
    k, v = fast.layer(0)
    return k, v, torch.tensor([0, 3]), torch.tensor([1, 15]), torch.randn(2, 3, 64)


@pytest.mark.parametrize("change,message", [
    (dict(pages=torch.tensor([0, 4])), "page id 4 \\(row 1\\) outside the pool of 4 pages"),
    (dict(pages=torch.tensor([-1, 0])), "page id -1 \\(row 0\\) outside the pool of 4 pages"),
    (dict(offsets=torch.tensor([16, 0])), "offset 16 \\(row 0\\) outside the page's 16 slots"),
    (dict(offsets=torch.tensor([0, -2])), "offset -2 \\(row 1\\) outside the page's 16 slots"),
    (dict(pages=torch.tensor([0, 3], dtype=torch.int32)), "pages must be an int64 vector"),
    (dict(offsets=torch.tensor([0])), "offsets must be an int64 vector as long as pages"),
    (dict(x=torch.randn(2, 3, 32)), "x must be \\[T, kv_heads, D\\] = \\[2, 3, 64\\]"),
    (dict(x=torch.randn(3, 3, 64)), "x must be \\[T, kv_heads, D\\] = \\[2, 3, 64\\]"),
    (dict(x=torch.randn(2, 3, 64, dtype=torch.float64)), "x must be float32, bfloat16 or float16, not Double"),
    (dict(data=lambda d: d.view(torch.int8)), "data must be uint8 \\[pages, block, kv_heads, D\\] with D contiguous"),
    (dict(data=lambda d: d.transpose(2, 3)), "data must be uint8 \\[pages, block, kv_heads, D\\] with D contiguous"),
])
@pytest.mark.parametrize("op", ["write_q8", "write_int8_channels"])
def test_bad_arguments_are_refused(kernel, op, change, message):
    k, v, pages, offsets, x = _args("fp8_e4m3" if op == "write_q8" else "int8")
    cache = v if op == "write_q8" else k
    args = dict(data=cache.data.view(torch.uint8), pages=pages, offsets=offsets, x=x)
    for key, value in change.items():
        args[key] = value(args[key]) if callable(value) else value
    before = cache.data.view(torch.uint8).clone()
    with pytest.raises(RuntimeError, match=f"{op}: {message}"):
        if op == "write_q8":
            kernel.write_q8(args["data"], cache.scale, args["pages"], args["offsets"], args["x"], True)
        else:
            kernel.write_int8_channels(args["data"], cache.exp, args["pages"], args["offsets"], args["x"])
    assert torch.equal(cache.data.view(torch.uint8), before)  # (nothing written)


def test_bad_scales_are_refused(kernel):
    k, v, pages, offsets, x = _args("int8")
    data = v.data.view(torch.uint8)
    with pytest.raises(RuntimeError, match="write_q8: scale must be bfloat16 \\[pages, block, kv_heads\\] = "
                                           "\\[4, 16, 3\\], not Float"):
        kernel.write_q8(data, v.scale.float(), pages, offsets, x, False)
    with pytest.raises(RuntimeError, match="write_q8: scale must be bfloat16 \\[pages, block, kv_heads\\]"):
        kernel.write_q8(data, v.scale[:, :8], pages, offsets, x, False)
    with pytest.raises(RuntimeError, match="write_int8_channels: exp must be uint8 \\[pages, kv_heads, D\\] = "
                                           "\\[4, 3, 64\\] with D contiguous"):
        kernel.write_int8_channels(k.data.view(torch.uint8), k.exp[:, :2], pages, offsets, x)
    with pytest.raises(RuntimeError, match="write_int8_channels: exp must be uint8"):
        kernel.write_int8_channels(k.data.view(torch.uint8), k.exp.view(torch.int8), pages, offsets, x)


def test_other_row_types_take_the_torch_path(kernel):
    """Rows the kernel does not take (float64) are written by torch, as before."""
    k, v, pages, offsets, x = _args("int8")
    assert kv_quant._writer(k.data, x.double()) is None and kv_quant._writer(k.data, x) is not None
    k.write(pages, offsets, x.double())
    v.write(pages, offsets, x.double())
