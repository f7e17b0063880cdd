"""A step's token budget from a TPOT target (--target-tpot-ms, --target-ttft-ms; scheduler_svc/slo_budget.py): sized
by the executor's step-time model so that a step with decode rows stays within the target, the full budget where
nothing is to protect or a first token is late, and through the planner: prefills chunked to the budget, decodes
never starved, every request served as without a target."""

from __future__ import annotations

import argparse
import time

import numpy as np
import pytest

from pagedkv.executor.v1 import executor_pb2 as pb
from scheduler_svc import slo_budget
from scheduler_svc.args import add_args, check_args
from scheduler_svc.pages import PagePool
from scheduler_svc.plan_clock import MIN_SAMPLES, StepClock, step_features
from scheduler_svc.request import Finish
from scheduler_svc.scheduler import SchedulerConfig
from tests.support.driven import driven
from tests.support.fake_executor import drive, make_request, scheduled
from tests.support.scheduler_helpers import BS, assert_empty

pytestmark = pytest.mark.unit

PER_STEP, PER_TOKEN, PER_ROW, PER_PAIR = 0.002, 1e-4, 2e-4, 1e-8  # the machine the clock learns


def machine_seconds(rows: list[tuple[int, int]]) -> float:
    """A step of (tokens, cached before them) rows on the linear machine."""
    return PER_STEP + sum(PER_TOKEN * n + PER_ROW + PER_PAIR * n * (c + (n - 1) / 2) for n, c in rows)


def fitted_clock(samples: int = 40) -> StepClock:
    clock = StepClock()
    rng = np.random.default_rng(0)
    for _ in range(samples):
        rows = [(int(rng.integers(1, 300)), int(rng.integers(0, 1000))) for _ in range(int(rng.integers(1, 12)))]
        reqs = []
        for i, (n, c) in enumerate(rows):
            req = make_request(i, c + n, 4)
            req.num_computed = c + n  # (as after planning counted them)
            reqs.append((req, n, False))
        clock.observe(step_features(reqs), machine_seconds(rows), overhead=0.0)
    return clock


def decoding(i: int, context: int):
    req = make_request(i, context + 1, 8)
    req.num_computed = context  # one token left: a decode row
    return req


def prefilling(i: int, prompt: int, done: int):
    req = make_request(i, prompt, 8)
    req.num_computed = done
    return req


def config(tpot_ms: float = 0.0, ttft_ms: float = 0.0, tokens: int = 4096) -> SchedulerConfig:
    return SchedulerConfig(max_num_batched_tokens=tokens, target_tpot_s=tpot_ms / 1e3, target_ttft_s=ttft_ms / 1e3)


def test_the_budget_is_the_most_prefill_the_target_holds_beside_the_decodes():
    clock = fitted_clock()
    decodes = [decoding(i, 100 + 50 * i) for i in range(8)]
    for context, target_ms in [(0, 15.0), (0, 40.0), (600, 25.0), (1500, 60.0)]:
        running = [*decodes, prefilling(99, 4000, context)]
        budget = slo_budget.step_budget(clock, config(target_ms), running, [], BS)
        n = budget - len(decodes)
        assert BS < n < 4096 - len(decodes)
        rows = [(1, d.num_computed) for d in decodes]
        assert machine_seconds([*rows, (n, context)]) <= target_ms / 1e3 + 2e-4  # within the fit's error
        assert machine_seconds([*rows, (n + 8, context)]) > target_ms / 1e3 - 2e-4  # and not far below it


def test_the_full_budget_without_a_target_a_model_or_a_decode_row():
    decodes = [decoding(i, 100) for i in range(8)]
    clock = fitted_clock()
    assert slo_budget.step_budget(clock, config(), decodes, [], BS) == 4096  # no target
    assert slo_budget.step_budget(None, config(20.0), decodes, [], BS) == 4096  # no clock
    assert slo_budget.step_budget(fitted_clock(MIN_SAMPLES - 1), config(20.0), decodes, [], BS) == 4096  # unfit
    assert slo_budget.step_budget(clock, config(20.0), [prefilling(0, 900, 0)], [], BS) == 4096  # nothing decodes
    assert slo_budget.step_budget(clock, config(20.0), decodes, [], BS) < 4096
    assert slo_budget.step_budget(clock, config(20.0, tokens=64), decodes, [], BS) == 64  # never above the flag


def test_a_target_the_decodes_alone_exceed_still_gives_a_prefill_a_page():
    decodes = [decoding(i, 100) for i in range(30)]  # ~11 ms of decoding alone
    assert slo_budget.step_budget(fitted_clock(), config(5.0), decodes, [], BS) == 30 + BS


def test_a_late_first_token_takes_the_full_budget():
    clock = fitted_clock()
    decodes = [decoding(i, 100) for i in range(8)]
    late = make_request(50, 300, 8)
    late.trace.arrived(time.perf_counter() - 1.0, time.perf_counter() - 1.0)  # received a second ago
    assert slo_budget.step_budget(clock, config(20.0, ttft_ms=2000.0), decodes, [late], BS) < 4096
    assert slo_budget.step_budget(clock, config(20.0, ttft_ms=500.0), decodes, [late], BS) == 4096
    mid = prefilling(51, 3000, 512)  # mid-prefill, no token yet: as late
    mid.trace.arrived(time.perf_counter() - 1.0, time.perf_counter() - 1.0)
    assert slo_budget.step_budget(clock, config(20.0, ttft_ms=500.0), [*decodes, mid], [], BS) == 4096
    mid.output_ids.append(7)  # (it had its first token: no longer waiting for one)
    assert slo_budget.step_budget(clock, config(20.0, ttft_ms=500.0), [*decodes, mid], [], BS) < 4096


@pytest.mark.parametrize("target_ms", [0.0, 12.0])
def test_the_planner_chunks_prefills_to_the_budget_and_serves_the_same(target_ms):
    cfg = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=512, max_model_len=1024, watermark=0,
                          target_tpot_s=target_ms / 1e3)
    s = driven(PagePool(256, BS), cfg, [2])
    s.scheduler.clock = fitted_clock()
    for i in range(6):
        s.add(make_request(i, 8, 40))
    plans = []
    schedule = s.schedule

    def recorded():
        plan, outs = schedule()
        if plan is not None:
            plans.append(scheduled(plan))
        return plan, outs
    s.schedule = recorded
    finished = drive(s, on_step=lambda s: len(plans) == 3 and not s.scheduler.queues.requests.get("r9")
                     and s.add(make_request(9, 700, 4)))  # arrives beside six decoding requests
    served = sorted(r.request_id for r in finished if r.finish is Finish.LENGTH)
    assert served == [f"r{i}" for i in (0, 1, 2, 3, 4, 5, 9)]
    assert_empty(s)
    chunks = [dict(p)["r9"] for p in plans if "r9" in dict(p) and len(p) > 1]
    if target_ms:
        assert len(chunks) >= 4 and max(chunks) < 200  # 12 ms beside six decodes: ~70-token chunks
        with_decodes = [p for p in plans if "r9" in dict(p) and len(p) > 1 and dict(p)["r9"] > 1]
        for p in with_decodes:
            rows = [(n, 0) for rid, n in p]
            assert machine_seconds(rows) <= target_ms / 1e3 + 1e-3
    else:
        assert max(chunks) > 400  # the whole budget's worth in one step


def test_the_targets_are_checked_at_start_up():
    describe = pb.DescribeResponse(max_position_embeddings=64, num_device_pages=8, block_size=16)
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_args(parser)
    for flags, message in [(["--target-tpot-ms", "-1"], "--target-tpot-ms must be in [0, 3600000]"),
                           (["--target-tpot-ms", "nan"], "--target-tpot-ms must be in [0, 3600000]"),
                           (["--target-ttft-ms", "500"], "--target-ttft-ms needs --target-tpot-ms")]:
        with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
            check_args(parser.parse_args(["--executor", "h:1", *flags]), describe, None)
