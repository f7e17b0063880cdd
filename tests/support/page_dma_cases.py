"""Page DMA checks shared by the CPU tests and the GPU tests (tests/gpu/): the same cases on any device."""

from __future__ import annotations

import random
from types import SimpleNamespace

import torch

from executor_svc.pages import DevicePagePool, HostPagePool, PageMover


def pools(device: str, num_pages: int = 24, num_host: int = 40, dtype=torch.float16, layers: int = 3,
          block: int = 16, kv_heads: int = 2, head_dim: int = 64):
    cfg = SimpleNamespace(num_layers=layers, num_kv_heads=kv_heads, head_dim=head_dim)
    dev = DevicePagePool(cfg, num_pages, block, dtype, torch.device(device))
    dev.pages.copy_(torch.randn(dev.pages.shape, dtype=torch.float32).to(dtype))  # never zeros
    host = HostPagePool(dev, num_host)
    return dev, host, PageMover(dev, host)


def round_trip_is_bit_exact(device: str, seed: int = 0) -> None:
    """Scattered and consecutive pages out to the host, the device pages overwritten, then back in to other
    device pages: every page comes back bit for bit."""
    rng = random.Random(seed)
    dev, host, mover = pools(device)
    original = dev.pages.clone()
    src = rng.sample(range(20), 12) + [20, 21, 22]  # distinct pages, a run of three as well
    dst_host = rng.sample(range(30), 12) + [30, 31, 32]
    mover.run(list(zip(src, dst_host)), [])
    dev.pages.copy_(torch.randn(dev.pages.shape, dtype=torch.float32).to(dev.dtype))  # the step reuses them
    back = list(range(dev.num_pages))
    rng.shuffle(back)
    back = back[:len(src)]
    mover.run([], list(zip(dst_host, back)))
    mover.synchronize()
    if dev.pages.is_cuda:
        torch.cuda.synchronize()
    for s, b in zip(src, back):
        assert torch.equal(dev.pages[b].cpu(), original[s].cpu()), f"page {s} -> host -> {b} changed"


def out_then_in_same_step(device: str) -> None:
    """A page swapped out and, in the same step, the target of a swap-in: the copy-out sees the old
    contents (swap-outs run first)."""
    dev, host, mover = pools(device)
    old5, old7 = dev.pages[5].clone(), dev.pages[7].clone()
    mover.run([(7, 0)], [])  # host page 0 holds page 7's contents
    mover.run([(5, 1)], [(0, 5)])  # page 5 out to host 1, then host 0 (page 7's data) into page 5
    mover.synchronize()
    if dev.pages.is_cuda:
        torch.cuda.synchronize()
    assert torch.equal(host.pages[1], old5.cpu())
    assert torch.equal(dev.pages[5].cpu(), old7.cpu())
