"""Parallel sampling (n > 1): forks share the parent's pages and copy a shared partial last page on write; a
rejected plan keeps its copies; an abort during the parent's last chunk aborts the forks; a parent holds n
seats before it forks."""

from __future__ import annotations

import pytest

from scheduler_svc.pages import PagePool
from scheduler_svc.scheduler import SchedulerConfig
from tests.support.driven import Driven, driven
from tests.support.fake_executor import drive, make_request
from tests.support.scheduler_helpers import new_prefix_scheduler as new_scheduler

pytestmark = pytest.mark.unit


def test_fork_shares_pages_and_copies_the_partial_last_page():
    s = new_scheduler()
    prompt = [30 + i for i in range(40)]  # 2 full pages + 8 tokens: the forks share a partial page
    parent = make_request(0, 0, 5, prompt=prompt, n=4)
    s.add(parent)
    plan, _ = s.schedule()
    assert plan.new_requests[0].num_scheduled_tokens == 39 and len(plan.new_requests[0].token_ids) == 39
    from tests.support.fake_executor import fake_result

    known: dict = {}
    s.process(fake_result(plan, known))
    assert [r.request_id for r in s.running] == [f"r0/{i}" for i in range(4)]
    assert len({tuple(r.page_table) for r in s.running}) == 1  # every page shared
    plan, _ = s.schedule()
    assert list(plan.forget) == ["r0"]
    assert len(plan.page_ops.copy) == 3  # three forks copy the shared partial page; the last keeps it
    tables = [r.page_table for r in s.running]
    assert len({t[2] for t in tables}) == 4 and len({tuple(t[:2]) for t in tables}) == 1
    assert [r.sampling.seed - s.running[0].sampling.seed for r in s.running] == [0, 1, 2, 3]
    s.check_integrity()
    s.process(fake_result(plan, known))
    drive(s, known=known)
    assert s.pool.num_used == 0


def _forked(s: Driven, prompt_len: int = 10, n: int = 2):
    from tests.support.fake_executor import fake_result

    parent = make_request(0, 0, 4, prompt=list(range(3, 3 + prompt_len)), n=n)
    s.add(parent)
    known: dict = {}
    plan, _ = s.schedule()
    return parent, plan, known, fake_result


def test_rejected_plan_keeps_its_page_copies():
    from pagedkv.executor.v1 import executor_pb2 as pb

    s = driven(PagePool(40, 4), SchedulerConfig(max_model_len=64), [2])
    parent, plan, known, fake_result = _forked(s)
    s.process(fake_result(plan, known))
    plan, _ = s.schedule()
    copies = [(c.src, c.dst) for c in plan.page_ops.copy]
    assert copies
    s.process(pb.StepResult(step_id=plan.step_id, error="desync"))
    again, _ = s.schedule()  # the rejected plan's page operations go first, alone
    assert [(c.src, c.dst) for c in again.page_ops.copy] == copies
    assert not again.new_requests and not again.continuing and not again.decodes
    s.process(fake_result(again, known))
    then, _ = s.schedule()
    assert not then.page_ops.copy
    assert {r.request_id for r in then.new_requests} == {"r0/0", "r0/1"}
    s.process(fake_result(then, known))
    s.check_integrity()


def test_abort_during_the_last_parent_chunk_aborts_the_forks():
    s = new_scheduler()
    parent, plan, known, fake_result = _forked(s, prompt_len=40, n=3)
    s.abort(parent.group)  # the client goes away while the parent's prefill runs
    s.process(fake_result(plan, known))
    plan, outs = s.schedule()
    assert s.pool.num_used == 0 and not s.running
    assert {o.finish.value for _, o in outs} == {"abort"}


def test_a_parent_holds_n_seats_before_it_forks():
    s = new_scheduler(seqs=4)
    s.add(make_request(0, 0, 3, prompt=list(range(3, 30)), n=4))
    for i in range(1, 4):
        s.add(make_request(i, 0, 3, prompt=[50 + i] * 20))
    drive_steps = 0
    from tests.support.fake_executor import fake_result

    known: dict = {}
    while s.has_work and drive_steps < 100:
        plan, _ = s.schedule()
        if plan is None:
            break
        s.process(fake_result(plan, known))
        assert len(s.running) <= 4
        drive_steps += 1
    assert not s.has_work
