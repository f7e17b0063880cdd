"""Scheduler policy and page accounting, driven by a fake executor (no processes)."""

from __future__ import annotations

import random

import pytest

from pagedkv.executor.v1 import executor_pb2 as pb
from scheduler_svc.detokenizer import IncrementalDetokenizer
from scheduler_svc.pages import PagePool
from scheduler_svc.request import Finish, Request, Sampling, Status
from scheduler_svc.scheduler import Scheduler, SchedulerConfig


class NullTokenizer:
    def decode(self, ids, **_):
        return "".join(chr(97 + i % 26) for i in ids)


def make_request(i: int, prompt_len: int, max_tokens: int) -> Request:
    return Request(request_id=f"r{i}", prompt_ids=[5] * prompt_len, sampling=Sampling(max_tokens=max_tokens),
                   arrival=i, detokenizer=IncrementalDetokenizer(NullTokenizer(), [], [], False))


def fake_result(plan: pb.StepPlan, known: dict[str, list]) -> pb.StepResult:
    """A stand-in executor: tracks computed counts and 'samples' token 7 when a request is caught up."""
    result = pb.StepResult(step_id=plan.step_id)
    for rid in plan.forget:
        known.pop(rid, None)
    for new in plan.new_requests:
        known[new.request_id] = [len(new.token_ids), new.num_computed_tokens]
    for item in [*plan.new_requests, *plan.continuing]:
        total, done = known[item.request_id]
        done += item.num_scheduled_tokens
        assert done <= total
        if done == total:
            total += 1
            result.sampled.add(request_id=item.request_id, token_id=7)
        known[item.request_id] = [total, done]
    return result


def drive(s: Scheduler, max_steps: int = 10_000) -> list:
    known: dict[str, list] = {}
    finished = []
    for _ in range(max_steps):
        plan, outs = s.schedule()
        if plan is None and not s.has_work:
            break
        assert plan is not None
        assert sum(r.num_scheduled_tokens for r in plan.new_requests) + sum(
            c.num_scheduled_tokens for c in plan.continuing) <= s.config.max_num_batched_tokens
        assert len(s.running) <= s.config.max_num_seqs
        outs = s.process(fake_result(plan, known))
        s.check_integrity()
        finished += [req for req, o in outs if o.finish is not None]
    return finished


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
    assert len(finished) == 4 and s.num_preemptions > 0
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
        sent += list(plan.continuing[0].new_page_ids)
        assert not plan.new_requests
    assert sent == s.running[0].page_table[2:]


def test_integrity_check_catches_a_leak():
    pool = PagePool(num_pages=8, block_size=16)
    pool.allocate(2)
    with pytest.raises(AssertionError):
        pool.check_integrity([])
