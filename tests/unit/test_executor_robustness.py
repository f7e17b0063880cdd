"""The executor's edges in one process: tiny and NaN temperatures sample greedily, the plan check accepts the
limits themselves, a wipe zeroes the written device and host pages. The Run stream under abuse:
tests/e2e/test_executor_robustness.py."""

from __future__ import annotations

import pytest
import torch

from executor_svc.runner import ModelRunner
from executor_svc.sampler import SamplingParams, sample, sample_one
from pagedkv.executor.v1 import executor_pb2 as pb
from tests.support.executor_requests import BLOCK, MAX_POSITIONS, VOCAB, new_request
from tests.support.page_dma_cases import pools

pytestmark = pytest.mark.unit


# ---- sampling ------------------------------------------------------------------------------------
def test_tiny_and_nan_temperatures_sample_greedily():
    logits = torch.full((259,), -3.0)
    logits[17], logits[200] = 4.0, 3.5  # the argmax is not token 0
    for t in (1e-38, 1e-30, 1e-6, float("nan")):
        p = SamplingParams(temperature=t, seed=3)
        assert p.greedy
        assert [sample_one(logits, p, d) for d in range(5)] == [17] * 5, t
        assert sample(logits.view(1, -1), [p], [0])[0] == [17]
    assert not SamplingParams(temperature=1e-5).greedy  # at the threshold it samples again
    draws = {sample_one(logits, SamplingParams(temperature=5.0, seed=1), d) for d in range(40)}
    assert len(draws) > 1


def test_wipe_zeroes_written_device_and_host_pages():
    dev, host, _ = pools("cpu", num_pages=8, num_host=16, dtype=torch.float32)
    runner = ModelRunner(type("M", (), {})(), dev, attention=None, device=torch.device("cpu"), host_pool=host)
    host.pages.zero_()
    plan = pb.StepPlan(step_id=1)
    plan.page_ops.swap_out.add(src=2, dst=9)  # writes host page 9
    plan.page_ops.swap_in.add(src=9, dst=4)  # writes device page 4
    assert not runner.step(plan).error
    assert host.pages[9].abs().sum() > 0 and dev.pages.abs().sum() > 0
    assert runner.wipe_pages()
    assert dev.pages.abs().sum() == 0 and host.pages.abs().sum() == 0
    assert not runner.wipe_pages()  # nothing written since: nothing to zero


def test_validation_accepts_the_limits_themselves():
    """The edges are valid: the last vocabulary id, the last position, top_p 1, temperature 0 (checked on the
    runner alone: its mirror accepting the plan is the point, no forward is needed)."""
    dev, host, _ = pools("cpu", num_pages=200, num_host=0, dtype=torch.float32)
    cfg = type("C", (), {"vocab_size": VOCAB, "max_position_embeddings": MAX_POSITIONS})()
    runner = ModelRunner(type("M", (), {"cfg": cfg})(), dev, attention=None, device=torch.device("cpu"),
                         host_pool=host)
    edge = new_request("e", [VOCAB - 1] * MAX_POSITIONS, list(range(MAX_POSITIONS // BLOCK)),
                       computed=MAX_POSITIONS - 1, top_p=1.0, temperature=0.0)
    scheduled = runner.mirror.apply(pb.StepPlan(step_id=1, new_requests=[edge]))
    assert [(s.request_id, s.start, s.count) for s in scheduled] == [("e", MAX_POSITIONS - 1, 1)]
