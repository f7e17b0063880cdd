"""A request's pages as it grows and ends: only appended pages go to the executor, an abort frees them at the
next step, and the page accounting catches a leak."""

from __future__ import annotations

import pytest

from scheduler_svc.pages import PagePool
from scheduler_svc.request import Finish, Status
from scheduler_svc.scheduler import SchedulerConfig
from tests.support.driven import driven
from tests.support.fake_executor import fake_result, make_request

pytestmark = pytest.mark.unit


def test_continuing_requests_send_only_appended_pages():
    pool = PagePool(num_pages=50, block_size=4)
    s = driven(pool, SchedulerConfig(max_model_len=512), [2])
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


def test_abort_frees_pages_at_the_next_step():
    pool = PagePool(num_pages=50, block_size=16)
    s = driven(pool, SchedulerConfig(max_model_len=512), [2])
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


def test_integrity_check_catches_a_leak():
    pool = PagePool(num_pages=8, block_size=16)
    pool.allocate(2)
    with pytest.raises(AssertionError):
        pool.check_integrity([])
