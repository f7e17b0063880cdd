"""Page DMA and page operations in the executor, on the CPU (the GPU runs the same cases: tests/gpu/)."""

from __future__ import annotations

import pytest
import torch

from executor_svc.pages import _runs
from executor_svc.runner import ModelRunner
from pagedkv.executor.v1 import executor_pb2 as pb
from tests.support.page_dma_cases import out_then_in_same_step, pools, round_trip_is_bit_exact

pytestmark = pytest.mark.unit


def test_runs_merge_consecutive_pages_and_keep_order():
    assert _runs([(3, 10), (4, 11), (5, 12), (9, 0), (2, 1)]) == [(3, 10, 3), (9, 0, 1), (2, 1, 1)]
    assert _runs([(1, 1), (1, 1)]) == [(1, 1, 1), (1, 1, 1)]  # a repeated copy is not merged away
    assert _runs([]) == []


def test_round_trip_is_bit_exact_on_cpu():
    for seed in range(3):
        round_trip_is_bit_exact("cpu", seed)


def test_swap_out_runs_before_swap_in_on_cpu():
    out_then_in_same_step("cpu")


def test_runner_applies_swaps_then_copies_and_rejects_bad_ids():
    dev, host, _ = pools("cpu", num_pages=8, num_host=16, dtype=torch.float32)
    model = type("M", (), {})()
    runner = ModelRunner(model, dev, attention=None, device=torch.device("cpu"), host_pool=host)
    p2, p3 = dev.pages[2].clone(), dev.pages[3].clone()
    plan = pb.StepPlan(step_id=1)
    plan.page_ops.swap_out.add(src=2, dst=9)
    plan.page_ops.swap_in.add(src=9, dst=4)  # the page just swapped out comes back as page 4
    plan.page_ops.copy.add(src=4, dst=5)  # copy-on-write runs after the swap-in
    plan.page_ops.copy.add(src=3, dst=2)
    result = runner.step(plan)
    assert not result.error
    assert torch.equal(host.pages[9], p2) and torch.equal(dev.pages[4], p2) and torch.equal(dev.pages[5], p2)
    assert torch.equal(dev.pages[2], p3)
    for field, src, dst in (("swap_out", 0, 16), ("swap_in", 16, 0), ("swap_in", 0, 8), ("copy", -1, 0)):
        bad = pb.StepPlan(step_id=2)
        getattr(bad.page_ops, field).add(src=src, dst=dst)
        before = dev.pages.clone()
        result = runner.step(bad)
        assert f"page_ops.{field}" in result.error and torch.equal(dev.pages, before)  # nothing ran


def test_without_a_host_tier_swaps_are_rejected():
    dev, _, _ = pools("cpu", num_pages=8, num_host=0, dtype=torch.float32)
    runner = ModelRunner(type("M", (), {})(), dev, attention=None, device=torch.device("cpu"), host_pool=None)
    plan = pb.StepPlan(step_id=1)
    plan.page_ops.swap_out.add(src=1, dst=0)
    assert "outside [0, 8) -> [0, 0)" in runner.step(plan).error
