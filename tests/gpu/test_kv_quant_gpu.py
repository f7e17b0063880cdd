"""8-bit KV pages on a GPU: the FP8 conversion and both quantizers give the same bits on the GPU as on the
CPU, and quantized pages swap through the pinned host tier with their scales. (The fused 8-bit decode kernel
against the torch reference: tests/gpu/test_cuda_attention_gpu.py's cases, and test_kernels_emulated.py on the
CPU.) Skipped without CUDA."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from executor_svc.attention import select_backend
from executor_svc.kv_quant import parse_kv_dtype, to_fp8_e4m3
from executor_svc.pages import DevicePagePool, HostPagePool, PageMover

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_fp8_conversion_is_identical_on_gpu_and_cpu():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1 << 20, generator=g) * torch.pow(2.0, torch.randint(-14, 12, (1 << 20,), generator=g).float())
    x[:4] = torch.tensor([1e6, -1e6, 448.0, 464.0])
    cpu = to_fp8_e4m3(x).view(torch.uint8)
    gpu = to_fp8_e4m3(x.cuda()).view(torch.uint8).cpu()
    assert torch.equal(cpu, gpu)


@pytest.mark.parametrize("name", ["fp8_e4m3", "int8"])
def test_quantized_pages_match_the_cpu_and_survive_swap(name):
    cfg = SimpleNamespace(num_layers=2, num_kv_heads=4, head_dim=128)
    fmt = parse_kv_dtype(name, torch.float16)
    pools = {dev: DevicePagePool(cfg, 8, 16, torch.float16, torch.device(dev), fmt) for dev in ("cpu", "cuda")}
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(40, 4, 128, generator=g) * 3).half()
    pages = torch.tensor([1] * 16 + [5] * 16 + [2] * 8)
    offs = torch.arange(40) % 16
    for dev, pool in pools.items():
        for i in range(2):
            for cache in pool.layer(i):
                cache.write(pages.to(dev), offs.to(dev), x.to(dev))
    # the same bytes: quantization is elementwise IEEE arithmetic (division, round half to even, saturation)
    same = (pools["cpu"].pages != pools["cuda"].pages.cpu()).float().mean()
    assert same < 1e-4, f"{same:.2%} of the pool's bytes differ between CPU and GPU"
    dev = pools["cuda"]
    host = HostPagePool(dev, 4)
    mover = PageMover(dev, host)
    before = dev.layer(1)[0].gather(torch.tensor([5], device="cuda"), torch.float32)
    mover.run([(5, 3)], [])
    dev.pages[5].zero_()
    mover.run([], [(3, 6)])
    mover.synchronize()
    after = dev.layer(1)[0].gather(torch.tensor([6], device="cuda"), torch.float32)
    assert torch.equal(before, after)


def test_auto_keeps_torch_until_the_kernels_are_verified():
    from executor_svc.attention import CUDA_VERIFIED_ON_GPU

    name, _ = select_backend("auto", torch.device("cuda"), torch.float16, 128, kv_quantized=True)
    assert name == ("cuda" if CUDA_VERIFIED_ON_GPU else "torch") or "CuPy" in _
