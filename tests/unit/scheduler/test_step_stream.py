"""When the executor disagrees or goes away: a rejected plan's page operations are resent alone and first, a
request the executor keeps rejecting fails alone, endless rejections end the Run stream, executor failure frees
both tiers, and counters survive a new pool geometry."""

from __future__ import annotations

import pytest

from pagedkv.executor.v1 import executor_pb2 as pb
from scheduler_svc.request import Finish, Status
from tests.support.fake_executor import FakeExecutor, drive, make_request, scheduled
from tests.support.scheduler_helpers import BS, CHEAP_SWAP, assert_empty, new_scheduler

pytestmark = pytest.mark.unit


def test_rejected_plan_resends_its_swaps_alone_and_first():
    s = new_scheduler(pages=9, hot=0, cold=0)
    reqs = [make_request(i, 12, 20, prompt=[40 + i] * 12) for i in range(3)]
    for r in reqs:
        s.add(r)
    ex = FakeExecutor(BS)
    plan, _ = s.schedule()
    s.process(ex.step(plan))
    plan, _ = s.schedule()
    assert plan.page_ops.swap_out
    ops = [(c.src, c.dst) for c in plan.page_ops.swap_out]
    s.process(pb.StepResult(step_id=plan.step_id, error="desync"))
    again, _ = s.schedule()
    assert [(c.src, c.dst) for c in again.page_ops.swap_out] == ops
    assert not again.new_requests and not again.continuing and not again.decodes
    s.check_integrity()
    s.process(ex.step(again))
    drive(s, executor=ex)
    assert_empty(s)


def test_a_request_the_executor_keeps_rejecting_fails_alone():
    """Plans with swaps in them are rejected because of one request: its plans fail three times and it
    is aborted; the rejected page operations still run (resent alone) and nothing else fails."""
    from scheduler_svc.step_stream import MAX_PLAN_RETRIES

    s = new_scheduler(pages=9, hot=0, cold=0, seqs=4)
    reqs = [make_request(i, 12, 12, prompt=[80 + i] * 12) for i in range(4)]
    for r in reqs:
        s.add(r)
    ex = FakeExecutor(BS)
    bad = reqs[1].request_id
    rejected = 0
    for _ in range(500):
        plan, _ = s.schedule()
        if plan is None and not s.has_work:
            break
        ids = {rid for rid, _ in scheduled(plan)}
        if bad in ids:
            rejected += 1
            s.process(pb.StepResult(step_id=plan.step_id, error=f"{bad} is cursed", desynced_request_ids=[bad]))
        else:
            s.process(ex.step(plan))
        s.check_integrity()
    assert rejected == MAX_PLAN_RETRIES and reqs[1].finish is Finish.ABORT
    assert all(r.finish is Finish.LENGTH for r in reqs if r is not reqs[1])
    assert_empty(s)


def test_page_operations_rejected_again_and_again_end_the_run_stream():
    from scheduler_svc.step_stream import PlanLoopError

    s = new_scheduler(pages=9, hot=0, cold=0)
    for i in range(3):
        s.add(make_request(i, 12, 20, prompt=[90 + i] * 12))
    ex = FakeExecutor(BS)
    plan, _ = s.schedule()
    s.process(ex.step(plan))
    plan, _ = s.schedule()
    assert plan.page_ops.swap_out
    with pytest.raises(PlanLoopError):
        for _ in range(10):
            s.process(pb.StepResult(step_id=plan.step_id, error="bad page id"))
            plan, _ = s.schedule()
    s.fail_all("executor state lost")
    assert_empty(s)


def test_abort_and_executor_failure_free_both_tiers():
    s = new_scheduler(pages=9, hot=0, cold=0)
    reqs = [make_request(i, 12, 20, prompt=[60 + i] * 12) for i in range(3)]
    for r in reqs:
        s.add(r)
    ex = FakeExecutor(BS)
    for _ in range(3):
        plan, _ = s.schedule()
        s.process(ex.step(plan))
    swapped = [r for r in reqs if r.status is Status.SWAPPED]
    assert swapped and s.host.num_used > 0
    s.abort(swapped[0].group)
    plan, outs = s.schedule()
    assert any(o.finish is Finish.ABORT for _, o in outs)
    s.check_integrity()
    outs = s.fail_all("executor gone")
    assert all(o.error for _, o in outs)
    assert_empty(s)
    assert s.host.num_cached == 0 and s.pool.num_cached == 0


def test_counters_survive_a_new_pool_geometry():
    s = new_scheduler(pages=9, hot=0, cold=0)
    for i in range(3):
        s.add(make_request(i, 12, 20, prompt=[70 + i] * 12))
    drive(s)
    swaps = (s.counters.pages_swapped_out, s.counters.pages_swapped_in)
    assert swaps[0] > 0
    s.fail_all("executor restarted")
    s.reconnected(20, BS, num_host_pages=10, costs=CHEAP_SWAP)
    assert (s.counters.pages_swapped_out, s.counters.pages_swapped_in) == swaps and s.host.num_pages == 10


def test_drained_forgets_plans_its_closed_stream_never_answered():
    """The executor closes its stream once a draining executor is empty, possibly with a plan unanswered (one that
    only forgets a cancelled request): that plan leaves the stream, or every later result was settled against
    the plan before it (found in review of async scheduling)."""
    s = new_scheduler()
    r = make_request(1, 6, 5)
    s.add(r)
    plan, _ = s.schedule()
    FakeExecutor(BS).step(plan)  # run, but the result is never read
    s.abort(r.group)
    s.schedule()  # the reaped abort: a plan that only forgets it
    assert not s.live_requests()
    s.drained()
    assert not s.stream.in_flight
    s.reconnected(kept=False)  # another process answers at the address
    r2 = make_request(2, 6, 5)
    s.add(r2)
    done = drive(s, max_steps=200, executor=FakeExecutor(BS))
    assert r2 in done and len(r2.output_ids) == 5
    assert_empty(s)


def test_a_rejected_plan_tells_the_executor_to_forget_again():
    """A rejected plan ran nothing, its forget list included: the ids go again with the next plan (else the
    executor kept the state of requests that ended, until its stream was reset)."""
    s = new_scheduler()
    a, b = make_request(1, 6, 1), make_request(2, 6, 30)
    s.add(a)
    s.add(b)
    ex = FakeExecutor(BS)
    plan, _ = s.schedule()
    s.process(ex.step(plan))  # a's one token: it ended, and the next plan tells the executor to forget it
    plan, _ = s.schedule()
    assert list(plan.forget) == [a.request_id]
    s.process(pb.StepResult(step_id=plan.step_id, error="desync", desynced_request_ids=[b.request_id]))
    again, _ = s.schedule()
    assert a.request_id in again.forget
    s.process(ex.step(again))
    drive(s, executor=ex)
    assert_empty(s)
