"""Scheduler policy and page accounting, driven by a fake executor (no processes)."""

from __future__ import annotations

import random

import pytest

from scheduler_svc.pages import PagePool
from scheduler_svc.request import Finish, Status
from scheduler_svc.scheduler import Scheduler, SchedulerConfig
from tests.fake_executor import drive, fake_result, make_request


def test_chunked_prefill_respects_token_budget_and_finishes_everything():
    pool = PagePool(num_pages=200, block_size=16)
    s = Scheduler(pool, SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=512), [2])
    rng = random.Random(0)
    for i in range(20):
        s.add(make_request(i, rng.randint(1, 300), rng.randint(1, 40)))
    finished = drive(s)
    assert len(finished) == 20
    assert all(r.finish is Finish.LENGTH and len(r.output_ids) == r.sampling.max_tokens for r in finished)
    assert pool.num_used == 0 and pool.num_free == 200


def test_preemption_picks_the_newest_and_everything_still_finishes():
    pool = PagePool(num_pages=10, block_size=4)
    s = Scheduler(pool, SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=40, watermark=0),
                  [2])
    reqs = [make_request(i, 6, 20) for i in range(4)]
    for r in reqs:
        s.add(r)
    finished = drive(s)
    assert len(finished) == 4 and s.counters.preemptions > 0
    assert reqs[0].num_preemptions == 0, "the oldest request is never the victim while newer ones run"
    assert pool.num_used == 0


def test_abort_frees_pages_at_the_next_step():
    pool = PagePool(num_pages=50, block_size=16)
    s = Scheduler(pool, SchedulerConfig(max_model_len=512), [2])
    r = make_request(0, 40, 100)
    s.add(r)
    known: dict[str, list] = {}
    plan, _ = s.schedule()
    s.process(fake_result(plan, known))
    assert pool.num_used == 3
    s.abort("r0")
    plan, outs = s.schedule()
    assert pool.num_used == 0 and r.status is Status.FINISHED
    assert outs[0][1].finish is Finish.ABORT
    assert plan is not None and list(plan.forget) == ["r0"]
    s.check_integrity()


def test_continuing_requests_send_only_appended_pages():
    pool = PagePool(num_pages=50, block_size=4)
    s = Scheduler(pool, SchedulerConfig(max_model_len=512), [2])
    s.add(make_request(0, 7, 10))
    known: dict[str, list] = {}
    plan, _ = s.schedule()
    assert list(plan.new_requests[0].page_ids) == s.running[0].page_table[:2]
    sent = []
    for _ in range(6):
        s.process(fake_result(plan, known))
        plan, _ = s.schedule()
        sent += [p for c in plan.continuing for p in c.new_page_ids]
        assert not plan.new_requests and len(plan.continuing) + len(plan.decodes) == 1
    assert sent == s.running[0].page_table[2:]


def test_integrity_check_catches_a_leak():
    pool = PagePool(num_pages=8, block_size=16)
    pool.allocate(2)
    with pytest.raises(AssertionError):
        pool.check_integrity([])
