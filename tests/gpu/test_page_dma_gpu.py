"""Page DMA on a GPU: pinned host pool, copies on their own stream, ordered with the compute stream.
Skipped without CUDA. The same cases run on the CPU in tests/unit/test_page_dma.py."""

from __future__ import annotations

import pytest
import torch

from tests.support.page_dma_cases import out_then_in_same_step, pools, round_trip_is_bit_exact

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_host_pool_is_pinned():
    _, host, mover = pools("cuda")
    assert host.pages.is_pinned() and mover.stream is not None


@pytest.mark.parametrize("seed", range(3))
def test_round_trip_is_bit_exact(seed):
    round_trip_is_bit_exact("cuda", seed)


def test_swap_out_runs_before_swap_in():
    out_then_in_same_step("cuda")


def test_copy_out_waits_for_earlier_compute():
    """A kernel on the compute stream writes a page, then the page is swapped out without any host
    synchronisation: the copy must see the written values (the DMA stream waits for compute)."""
    dev, host, mover = pools("cuda", num_pages=64, num_host=64)
    big = torch.randn(4096, 4096, device="cuda")
    for _ in range(8):  # keep the compute stream busy so an unordered copy would overtake the write
        big = big @ big.clamp(-1, 1)
    dev.pages[3].fill_(7.0)
    mover.run([(3, 11)], [])
    mover.synchronize()
    assert torch.all(host.pages[11] == 7.0)


def test_compute_waits_for_copy_in():
    """A swap-in, then at once a read on the compute stream (no host synchronisation in between): the
    read sees the copied-in values (the compute stream waits for the DMA stream)."""
    dev, host, mover = pools("cuda", num_pages=256, num_host=256, layers=8, kv_heads=8, head_dim=128)
    host.pages.fill_(3.0)
    dev.pages.zero_()
    torch.cuda.synchronize()
    mover.run([], [(h, h) for h in range(256)])
    total = dev.pages.float().sum()  # queued on the compute stream right after the swap-ins
    assert total.item() == 3.0 * dev.pages.numel()


def test_host_pool_is_exactly_registered():
    _, host, _ = pools("cuda", num_pages=8, num_host=40)
    assert host.registered and host.pages.is_pinned()
    assert host.pages.untyped_storage().nbytes() == 40 * host.page_bytes
