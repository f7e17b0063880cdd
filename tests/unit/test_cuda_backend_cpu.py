"""The CUDA backend's CPU-side parts: backend choice and start-up errors, lazy CuPy import, the kernel
argument and source plumbing, the page-copy routing, and the visible-range arithmetic of the decode kernel.
(The kernels themselves run in tests/gpu/; their nvcc build in tests/e2e/test_kernels_compile.py.)"""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from executor_svc.attention import BACKENDS, select_backend
from executor_svc.attention.cuda_backend import CudaPagedAttention
from executor_svc.attention.metadata import DecodeGroup
from executor_svc.pages import DevicePagePool
from kernels_cuda import specs
from kernels_cuda.loader import Pointer, kernel_args

pytestmark = pytest.mark.unit


def test_auto_is_torch_without_cuda_and_cuda_is_refused():
    cpu = torch.device("cpu")
    assert select_backend("torch", cpu, torch.float32, 64) == ("torch", "requested")
    backend, why = select_backend("auto", cpu, torch.float16, 128)
    assert backend == "torch" and "CUDA device" in why
    with pytest.raises(ValueError, match="--attention-backend cuda: it needs a CUDA device"):
        select_backend("cuda", cpu, torch.float16, 128)
    assert set(BACKENDS) == {"torch", "cuda"}


def test_unsupported_shapes_name_the_limit():
    with pytest.raises(ValueError, match=r"head_dim \(64, 128\), got 96"):
        CudaPagedAttention(8, 2, 96, 1.0)
    with pytest.raises(ValueError, match="partition_tokens must be >= 1"):
        CudaPagedAttention(8, 2, 64, 1.0, partition_tokens=0)


def test_partitions_follow_shapes_and_window():
    attn = CudaPagedAttention(32, 8, 128, 1.0, partition_tokens=512)
    assert (attn.tile, attn.chunks) == (4, 1)
    group = DecodeGroup(torch.zeros(3, dtype=torch.long), torch.zeros(3, 257, dtype=torch.long),
                        torch.ones(3, dtype=torch.long))
    assert attn.num_partitions(group, 16, None) == 9  # 257 * 16 = 4112 tokens -> 9 x 512
    assert attn.num_partitions(group, 16, 1000) == 2
    assert attn.num_partitions(group, 1, None) == 1  # one partition covers it: no split-K
    assert (CudaPagedAttention(40, 4, 64, 1.0).tile, CudaPagedAttention(40, 4, 64, 1.0).chunks) == (8, 2)
    assert CudaPagedAttention(12, 4, 64, 1.0).tile == 4


def test_kernel_args_have_fixed_c_types():
    t = torch.zeros(4)
    args = kernel_args([Pointer(None), Pointer(t), t, np.int32(3), np.int64(5), np.float32(0.5)])
    assert args[0] == np.uint64(0) and args[1] == np.uint64(t.data_ptr()) == args[2]
    assert [type(a) for a in args[3:]] == [np.int32, np.int64, np.float32]
    with pytest.raises(TypeError, match="argument 0: int has no fixed C type"):
        kernel_args([7])


def test_sources_expand_includes_and_list_every_kernel():
    for source in specs.SOURCES:
        text = specs.source_text(source)
        assert '#include "' not in text and text.count("struct Visible {") == 1
        unit = specs.nvcc_unit(source)
        assert all(f"&{name}," in unit for name in specs.name_expressions(source))
    names = specs.name_expressions("decode.cu")
    # paged_decode and paged_decode_q8 (per 8-bit KV format) per tile, and one reduce, per dtype and head_dim
    assert len(names) == len(specs.DTYPES) * len(specs.HEAD_DIMS) * (len(specs.GROUP_TILES) * (1 + len(specs.KV8)) + 1)
    assert [specs.group_tile(g) for g in (1, 2, 3, 4, 5, 8, 10)] == [1, 2, 4, 4, 8, 8, 8]


def test_page_copies_use_the_kernel_only_for_independent_pairs():
    cfg = SimpleNamespace(num_layers=2, num_kv_heads=2, head_dim=8)
    pool = DevicePagePool(cfg, 12, 4, torch.float32, torch.device("cpu"))
    pool.pages.normal_()
    calls = []

    def copier(pages, src, dst):
        calls.append((src.tolist(), dst.tolist()))
        pages[dst] = pages[src]

    pool.copier = copier
    before = pool.pages.clone()
    pool.copy_pages([1, 2], [5, 6])
    assert calls == [([1, 2], [5, 6])] and torch.equal(pool.pages[5], before[1])
    pool.copy_pages([5, 3], [3, 7])  # page 3 is read and written: not the kernel
    pool.copy_pages([1, 2], [8, 8])  # page 8 written twice: not the kernel
    assert len(calls) == 1 and torch.equal(pool.pages[7], before[3]) and torch.equal(pool.pages[3], before[1])


def visible_positions(ctx: int, model_window: int, sink: int, window: int) -> list[int]:
    """A line-for-line mirror of pkv::visible_positions + Visible::position (common.cuh)."""
    lo = max(0, ctx - model_window) if model_window > 0 else 0
    a0 = lo
    if window > 0:
        b0 = max(lo, ctx - window)
        a1 = max(lo, min(sink, b0))
    else:
        b0 = a1 = lo
    count = (a1 - a0) + (ctx - b0)
    return [a0 + i if i < a1 - a0 else b0 + (i - (a1 - a0)) for i in range(count)]


def test_visible_ranges_equal_the_reference_mask():
    """The decode kernel iterates over two position ranges instead of masking; over random cases they hold
    exactly the positions the torch backend's mask leaves visible, in order, each once."""
    rng = random.Random(0)
    for _ in range(3000):
        ctx = rng.randint(1, 300)
        model_window = rng.choice([0, 0, rng.randint(1, 320)])
        window = rng.choice([0, rng.randint(1, 320)])
        sink = rng.randint(0, 40) if window else 0
        pos = torch.arange(ctx)
        mask = pos < ctx
        if model_window:
            mask &= pos > ctx - 1 - model_window
        if window:
            mask &= (pos < sink) | (pos > ctx - 1 - window)
        assert visible_positions(ctx, model_window, sink, window) == pos[mask].tolist(), (ctx, model_window,
                                                                                         sink, window)


class _FakeCupy:
    """Only the CuPy API the loader may use (each name checked to exist in cupy-cuda13x 14.2): RawModule(code,
    options, name_expressions).get_function, cuda.Device (context), cuda.ExternalStream(ptr, device_id) (context,
    synchronize). Records what the loader does with it."""

    def __init__(self, fail_sync: bool = False) -> None:
        fake = self
        self.compiled, self.launches, self.syncs, self.streams = [], [], 0, []

        class Kernel:
            def __init__(self, name):
                self.name = name

            def __call__(self, grid, block, args):
                fake.launches.append((self.name, grid, block, args))

        class RawModule:
            def __init__(self, *, code, options, name_expressions):
                fake.compiled.append((tuple(name_expressions), options, "#include" in code))

            def get_function(self, name):
                return Kernel(name)

        class Ctx:
            def __init__(self, *args):
                pass

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                return False

        class ExternalStream(Ctx):
            def __init__(self, ptr, device_id):
                fake.streams.append((ptr, device_id))

            def synchronize(self):
                fake.syncs += 1
                if fail_sync:
                    raise RuntimeError("cudaErrorIllegalAddress")

        self.RawModule = RawModule
        self.cuda = SimpleNamespace(Device=Ctx, ExternalStream=ExternalStream)


def _fake_library(monkeypatch, debug: bool, fail_sync: bool = False):
    from kernels_cuda import loader

    fake = _FakeCupy(fail_sync)
    monkeypatch.setattr(loader, "_import_cupy", lambda: fake)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: SimpleNamespace(cuda_stream=1234))
    monkeypatch.setenv("PAGEDKV_CUDA_DEBUG", "1" if debug else "0")
    return loader.KernelLibrary(torch.device("cuda", 0)), fake


def test_loader_compiles_each_instantiation_once_and_launches_on_torchs_stream(monkeypatch):
    lib, fake = _fake_library(monkeypatch, debug=False)
    name = specs.write_name("float16")
    t = torch.zeros(4)
    for _ in range(3):
        lib.launch("cache.cu", name, (2, 1, 1), (128, 1, 1), [t, np.int32(7)])
    assert fake.compiled == [((name,), specs.OPTIONS, False)]  # one module, includes expanded
    assert fake.streams == [(1234, 0)] and fake.syncs == 0
    assert len(fake.launches) == 3 and fake.launches[0][3] == (np.uint64(t.data_ptr()), np.int32(7))
    lib.launch("cache.cu", name, (0, 1, 1), (128, 1, 1), [t, np.int32(7)])  # an empty grid launches nothing
    assert len(fake.launches) == 3
    with pytest.raises(KeyError, match="not instantiated"):
        lib.launch("cache.cu", "pkv::write_kv_cache<double>", (1, 1, 1), (1, 1, 1), [])


def test_loader_debug_mode_synchronises_and_names_the_kernel(monkeypatch):
    lib, fake = _fake_library(monkeypatch, debug=True)
    lib.launch("cache.cu", specs.COPY_NAME, (1, 1, 1), (256, 1, 1), [np.int64(1)])
    assert fake.syncs == 1
    lib, fake = _fake_library(monkeypatch, debug=True, fail_sync=True)
    with pytest.raises(RuntimeError, match=r"CUDA kernel pkv::copy_pages .* cudaErrorIllegalAddress"):
        lib.launch("cache.cu", specs.COPY_NAME, (1, 1, 1), (256, 1, 1), [np.int64(1)])


def test_cli_backend_names_match_the_backends():
    from executor_svc.args import BACKEND_NAMES

    assert set(BACKEND_NAMES) == set(BACKENDS)
