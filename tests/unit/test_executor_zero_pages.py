"""PageOps.zero at the executor (a retained conversation's KV whose retention ended): the listed device pages are
zeroed after the swap-outs of the same plan and before its swap-ins and copies; bad ids are refused, nothing run."""

from __future__ import annotations

import pytest
import torch

from executor_svc.runner import ModelRunner
from pagedkv.executor.v1 import executor_pb2 as pb
from tests.support.page_dma_cases import pools

pytestmark = pytest.mark.unit


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU"))]


def runner_with_pages(device: str = "cpu") -> tuple[ModelRunner, object, object]:
    dev, host, _ = pools(device, num_pages=8, num_host=8, dtype=torch.float32)
    for p in range(8):
        dev.pages[p] = p + 1.0
    host.pages.zero_()
    runner = ModelRunner(type("M", (), {})(), dev, attention=None, device=torch.device(device), host_pool=host)
    return runner, dev, host


@pytest.mark.parametrize("device", DEVICES)
def test_zero_runs_after_swap_out_and_before_swap_in_and_copy(device):
    """(On a GPU the swaps run on the mover's stream: the zero goes between its swap-outs and swap-ins.)"""
    runner, dev, host = runner_with_pages(device)
    plan = pb.StepPlan(step_id=1)
    plan.page_ops.swap_out.add(src=2, dst=5)  # page 2's KV goes out first ...
    plan.page_ops.zero.extend([2, 3, 4])  # ... then 2, 3 and 4 are zeroed ...
    plan.page_ops.swap_in.add(src=5, dst=3)  # ... and 3 gets page 2's KV back, 4 a copy of page 6
    plan.page_ops.copy.add(src=6, dst=4)
    assert not runner.step(plan).error
    if device == "cuda":
        torch.cuda.synchronize()
    assert torch.all(host.pages[5] == 3.0)
    assert torch.all(dev.pages[2] == 0) and torch.all(dev.pages[3] == 3.0) and torch.all(dev.pages[4] == 7.0)
    assert all(torch.all(dev.pages[p] == p + 1.0) for p in (0, 1, 5, 6, 7))  # nothing else touched


@pytest.mark.parametrize("zero", [[8], [-1], [1, 1]])
def test_bad_zero_ids_are_refused_and_nothing_runs(zero):
    runner, dev, _ = runner_with_pages()
    plan = pb.StepPlan(step_id=1)
    plan.page_ops.zero.extend(zero)
    result = runner.step(plan)
    assert "page_ops.zero" in result.error and "[0, 8)" in result.error
    assert all(torch.all(dev.pages[p] == p + 1.0) for p in range(8))
