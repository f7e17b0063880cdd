"""Per-request page budgets and attention windows: the budget is never exceeded and the sink stays, the stop
policy ends a request at its budget, a sliding window frees pages as it goes, and all of it together with
swaps and forks."""

from __future__ import annotations

import random

import pytest

from scheduler_svc.policy import Mode
from scheduler_svc.request import Finish
from tests.support.fake_executor import FakeExecutor, drive, make_request
from tests.support.scheduler_helpers import BS, assert_empty, new_scheduler

pytestmark = pytest.mark.unit


def windowed(i: int, prompt_len: int, max_tokens: int, budget: int = 0, window: int = 0, sink: int = 0,
             overflow: str = "window", **kw):
    return make_request(i, prompt_len, max_tokens, prompt=[(7 * i + j) % 240 + 3 for j in range(prompt_len)],
                        page_budget=budget, window_tokens=window, sink_tokens=sink, overflow=overflow, **kw)


def test_window_budget_is_never_exceeded_and_keeps_the_sink():
    """Budget 5 pages of 4 tokens, sink one page: window (5 - 1 - 1) x 4 = 12 tokens. A 60-token prompt and
    40 outputs run in a pool that could hold it all; the request never holds more than 5 pages, its first
    page stays, and the executor is told which pages left."""
    s = new_scheduler(pages=64, host_pages=0, budget=64, max_len=200)
    req = windowed(0, 60, 40, budget=5, window=12, sink=4)
    s.add(req)
    ex = FakeExecutor(BS)
    first_page, peak, dropped = None, 0, 0
    while s.has_work:
        plan, _ = s.schedule()
        dropped += sum(len(c.dropped_page_indices) for c in plan.continuing)
        if req.page_table and first_page is None:
            first_page = req.page_table[0]
        if req.page_table:
            assert req.page_table[0] == first_page
        peak = max(peak, sum(1 for p in req.page_table if p != -1))
        s.process(ex.step(plan))  # KV read back only where the window lets the queries look
        s.check_integrity()  # asserts the budget too
    assert req.finish is Finish.LENGTH and len(req.output_ids) == 40
    assert peak == 5 and dropped == 25 - 5 and s.stats("default").budget_hits == 1
    assert_empty(s)


def test_stop_policy_ends_the_request_at_its_budget():
    s = new_scheduler(pages=64, host_pages=0)
    req = windowed(0, 10, 40, budget=4, overflow="stop")  # KV of 16 tokens fits: 10 prompt + 6 outputs,
    s.add(req)  # and the 7th output is sampled from them
    finished = drive(s)
    assert finished == [req] and req.finish is Finish.LENGTH and len(req.output_ids) == 7
    assert s.stats("default").budget_hits == 1
    assert_empty(s)


def test_sliding_window_frees_pages_as_it_goes():
    s = new_scheduler(pages=64, host_pages=0, max_len=200)
    req = windowed(0, 30, 50, window=8, sink=2)
    s.add(req)
    ex = FakeExecutor(BS)
    most = 0
    while s.has_work:
        plan, _ = s.schedule()
        most = max(most, sum(1 for p in req.page_table if p != -1))
        s.process(ex.step(plan))
        s.check_integrity()
    assert most <= 1 + 4 + -(-64 // BS) and s.pool.num_used == 0  # the first chunk is the prompt (8 pages)
    assert sum(1 for p in req.page_table if p != -1) == 0  # released at the end


@pytest.mark.parametrize("seed", range(4))
def test_windows_budgets_swaps_and_forks_together(seed):
    rng = random.Random(100 + seed)
    s = new_scheduler(pages=rng.choice([16, 24]), host_pages=rng.choice([0, 16, 32]), mode=Mode.AUTO,
                      budget=rng.choice([8, 16, 64]), seqs=rng.choice([3, 8]), hot=rng.choice([0, 2]))
    reqs = []
    for i in range(14):
        budget = rng.choice([0, 4, 6])
        sink = rng.choice([0, 4]) if budget else rng.choice([0, 3])
        sp = -(-sink // BS) if budget else 0
        window = (budget - max(sp, 1) - 1) * BS if budget else rng.choice([0, 6, 9])
        if budget and not sink:
            sink = BS
        req = windowed(i, rng.randint(2, 40), rng.randint(1, 30), budget=budget, window=window, sink=sink,
                       n=rng.choice([1, 1, 2]))
        reqs.append(req)
        s.add(req)
    drive(s)
    assert_empty(s)
