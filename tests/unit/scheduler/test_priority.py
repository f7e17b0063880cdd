"""Priority classes (--scheduling-policy priority, scheduler_svc/priority.py): admission order inside a tenant, fcfs
unchanged, the fair share across tenants unchanged by priorities, preemption of a less important running request by
the cost rule without thrash, and the tenants file's max_priority.

A FakeExecutor models page contents (tests/support/fake_executor.py): every step checks that each request reads
back exactly the KV it wrote, through the swap-outs and recomputes the preemptions cause."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagedkv.bounds import InvalidRequest, check_priority
from pagedkv.tenancy import InvalidTenant, Tenant, Tenants
from pagedkv.trusted_hop import OBJECTIVE_HEADER
from scheduler_svc.pages import PagePool
from scheduler_svc.policy import Mode, PreemptionConfig, PreemptionCosts
from scheduler_svc.priority import PREEMPT_AFTER_STEPS
from scheduler_svc.request import Finish
from scheduler_svc.scheduler import SchedulerConfig
from tests.support.driven import Driven, driven
from tests.support.fake_executor import drive, make_request
from tests.support.scheduler_helpers import BS, CHEAP_SWAP, assert_empty

pytestmark = pytest.mark.unit

# recompute far cheaper than copying pages out and back
CHEAP_RECOMPUTE = PreemptionCosts(page_bytes=65536, swap_bytes_per_second=1e6, prefill_seconds_per_token=1e-9)


def planner(policy: str, seqs: int = 1, pages: int = 64, fair: bool = True, tenants: Tenants | None = None,
            costs: PreemptionCosts = CHEAP_SWAP, max_wait: int = 64) -> Driven:
    cfg = SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=64, max_model_len=128, watermark=0,
                          fairness=fair, scheduling_policy=policy,
                          preemption=PreemptionConfig(mode=Mode.AUTO, swap_in_max_wait=max_wait))
    return driven(PagePool(pages, BS), cfg, [2], host_pool=PagePool(64, BS, min_pages=0), costs=costs,
                  tenants=tenants)


def admission_order(s: Driven) -> list[str]:
    finished = drive(s)
    assert all(r.finish is Finish.LENGTH for r in finished)
    assert_empty(s)
    return [r.request_id for r in sorted(finished, key=lambda r: r.admitted_at_step)]


@pytest.mark.parametrize("fair", [True, False])
def test_priority_orders_admission_within_a_tenant_ties_by_arrival(fair):
    priorities = [5, 0, -3, 0, -3, 1000, -1000]
    orders = {}
    for policy in ("priority", "fcfs"):
        s = planner(policy, fair=fair)
        for i, p in enumerate(priorities):
            s.add(make_request(i, 4, 3, priority=p))
        orders[policy] = admission_order(s)
        assert s.counters.preemptions == 0  # one seat, and the most important always holds it
    assert orders["priority"] == ["r6", "r2", "r4", "r1", "r3", "r0", "r5"]
    assert orders["fcfs"] == [f"r{i}" for i in range(len(priorities))], "fcfs: arrival order, priorities ignored"


def test_fair_share_across_tenants_is_unchanged_by_priorities():
    """a asks for the most important class it may, b for the least: the tenants still take turns by weighted
    service exactly as under fcfs, and only the order inside each tenant changes. (Requests of one size: which of a
    tenant's requests runs then charges the tenant the same service.)"""
    tenants = Tenants([Tenant("a", max_priority=-1000), Tenant("b")])
    turns, orders = {}, {}
    for policy in ("priority", "fcfs"):
        s = planner(policy, tenants=tenants)
        for i in range(12):
            tenant = "a" if i % 3 == 0 else "b"
            s.add(make_request(i, 4, 3, tenant=tenant, priority=-1000 + i if tenant == "a" else 1000 - i))
        order = admission_order(s)
        orders[policy] = order
        turns[policy] = [turns_of(order, tenant) for tenant in ("a", "b")]
    assert turns["priority"] == turns["fcfs"], "a tenant's priorities moved its requests past another tenant's share"
    assert orders["priority"] != orders["fcfs"]  # (the order inside each tenant did change)
    b_order = [r for r in orders["priority"] if int(r[1:]) % 3]
    assert b_order == sorted(b_order, key=lambda r: -int(r[1:])), "b's most important (latest) first"


def turns_of(order: list[str], tenant: str) -> list[int]:
    """The positions in the admission order that were the tenant's turns."""
    return [k for k, r in enumerate(order) if (int(r[1:]) % 3 == 0) == (tenant == "a")]


def _preempting_run(policy: str, costs: PreemptionCosts, seqs: int = 2, pages: int = 64, arrive_at: int = 4,
                    max_tokens: int = 20):
    """Two batch requests (priority 5, 8 + max_tokens tokens) hold the seats (or the pages); an interactive one
    (priority -5) arrives at plan ``arrive_at``. Returns the scheduler, the interactive request and the batch ones."""
    s = planner(policy, seqs=seqs, pages=pages, costs=costs)
    batch = [make_request(i, 8, max_tokens, prompt=[10 + i] * 8, priority=5) for i in range(2)]  # (no shared prefix)
    for r in batch:
        s.add(r)
    urgent = make_request(9, 6, 4, prompt=[50] * 6, priority=-5)
    plans = []

    def on_step(sched: Driven) -> None:
        plans.append(None)
        if len(plans) == arrive_at:
            # (the room is short: both seats taken, or 3 pages free where its 6 tokens need 2 and each batch
            # request is about to take one more)
            assert sched.pool.num_free <= 3 or len(sched.running) == seqs
            sched.add(urgent)

    drive(s, on_step=on_step)
    assert_empty(s)
    return s, urgent, batch


@pytest.mark.parametrize("costs,swapped", [(CHEAP_SWAP, True), (CHEAP_RECOMPUTE, False)])
@pytest.mark.parametrize("short", ["seats", "pages"])
def test_an_important_request_preempts_a_less_important_one_by_the_cost_rule(costs, swapped, short):
    # seats: both of 2 taken; pages: 19 of 4 tokens, the two batch requests (8 + 28 tokens) hold 16 by the 26th plan
    run = (2, 64, 4, 20) if short == "seats" else (8, 19, 26, 28)
    s, urgent, batch = _preempting_run("priority", costs, *run)
    waited = urgent.admitted_at_step - urgent.queued_at_step
    assert waited <= PREEMPT_AFTER_STEPS + 1, f"the interactive request waited {waited} plans"
    assert urgent.num_preemptions == 0
    assert s.counters.preemptions == 1, "one victim makes the room: one preemption"
    assert batch[1].num_preemptions == 1 and batch[0].num_preemptions == 0, "the newest batch request is the victim"
    assert (s.counters.swap_preemptions, s.counters.recompute_preemptions) == ((1, 0) if swapped else (0, 1))
    fcfs, late, _ = _preempting_run("fcfs", costs, *run)
    assert fcfs.counters.preemptions == 0 and late.admitted_at_step - late.queued_at_step > waited, (
        "under fcfs the interactive request waits for a batch request to end")


def test_two_classes_do_not_thrash():
    """Batch requests (priority 5) fill the two seats all the time; interactive ones (priority -5) arrive every 7
    plans. Each interactive request takes one seat once; no interactive request is ever a victim, no batch request
    preempts another, and a request admitted a plan ago is not preempted again at once (it is hot)."""
    s = planner("priority", seqs=2, pages=64)
    batch = [make_request(i, 8, 30, priority=5) for i in range(6)]
    for r in batch:
        s.add(r)
    urgent = [make_request(100 + i, 4, 3, priority=-5) for i in range(5)]
    ticks = [0]

    def on_step(sched: Driven) -> None:
        ticks[0] += 1
        if ticks[0] % 7 == 0 and ticks[0] // 7 <= len(urgent):
            sched.add(urgent[ticks[0] // 7 - 1])

    finished = drive(s, on_step=on_step, feed_ticks=60)
    assert len(finished) == len(batch) + len(urgent)
    assert all(u.num_preemptions == 0 for u in urgent)
    assert s.counters.preemptions <= len(urgent), "more preemptions than interactive requests: classes thrashed"
    assert all(u.admitted_at_step - u.queued_at_step <= PREEMPT_AFTER_STEPS + 1 for u in urgent)
    assert_empty(s)


@pytest.mark.parametrize("a_batch_priority", [5, -10])
def test_priority_does_not_take_from_another_tenant(a_batch_priority):
    """a and b each run one request on the two seats (each its fair share); a's important request (-10) arrives. It
    takes the seat of a's own less important request (5), never b's; when a's running request is as important as it
    (-10), it waits for a seat: b's less important request is not preempted for it."""
    s = planner("priority", seqs=2, tenants=Tenants([Tenant("a", max_priority=-10), Tenant("b")]))
    a_batch = make_request(0, 8, 30, tenant="a", priority=a_batch_priority)
    b_batch = make_request(1, 8, 30, tenant="b", priority=5)
    s.add(a_batch)
    s.add(b_batch)
    urgent = make_request(2, 4, 3, tenant="a", priority=-10)
    plans = []

    def on_step(sched: Driven) -> None:
        plans.append(None)
        if len(plans) == 4:
            sched.add(urgent)

    drive(s, on_step=on_step)
    assert_empty(s)
    assert b_batch.num_preemptions == 0, "priority took another tenant's seat"
    assert urgent.num_preemptions == 0
    if a_batch_priority == 5:
        assert a_batch.num_preemptions == 1 and urgent.admitted_at_step - urgent.queued_at_step <= 3
    else:
        assert s.counters.preemptions == 0 and urgent.admitted_at_step - urgent.queued_at_step > 20


@pytest.mark.parametrize("overlap", [False, True])
def test_an_overdue_swapped_victim_does_not_go_back_ahead_of_the_request_it_made_room_for(overlap):
    """With --swap-in-max-wait 0 the swapped-out victim is overdue at once, and an overdue request goes ahead of new
    work; not ahead of a more important request of its own tenant (else it would take its seat straight back, and
    the important request would preempt again: thrash)."""
    s = planner("priority", seqs=2, max_wait=0)
    batch = [make_request(i, 8, 30, priority=5) for i in range(2)]
    for r in batch:
        s.add(r)
    urgent = make_request(9, 4, 6, priority=-5)
    plans = []

    def on_step(sched: Driven) -> None:
        plans.append(None)
        if len(plans) == 4:
            sched.add(urgent)

    drive(s, on_step=on_step, overlap=overlap)  # (with overlap the victim is in flight the step it is swapped out)
    assert_empty(s)
    assert s.counters.swap_preemptions == 1 and s.counters.preemptions == 1
    assert urgent.admitted_at_step - urgent.queued_at_step <= PREEMPT_AFTER_STEPS + 1


# ---- the tenants file's max_priority, and the range --------------------------------------------------------------
def test_max_priority_is_read_from_the_tenants_file_and_checked(tmp_path: Path):
    path = tmp_path / "tenants.toml"
    path.write_text("[tenants.gold]\nmax_priority = -10\n[tenants.plain]\n")
    tenants = Tenants.load(path, 100)
    assert (tenants.get("gold").max_priority, tenants.get("plain").max_priority) == (-10, 0)
    assert Tenants().get("default").max_priority == -1000, "one tenant without a file may ask for any priority"
    for bad in ("-1001", "5.5", "true", '"high"'):
        path.write_text(f"[tenants.gold]\nmax_priority = {bad}\n")
        with pytest.raises(InvalidTenant, match=r"tenants\.gold\.max_priority: must be an integer in \[-1000, 1000\]"):
            Tenants.load(path, 100)


def test_a_request_more_important_than_its_tenant_may_ask_is_refused():
    plain, gold = Tenant("plain"), Tenant("gold", max_priority=-10)
    check_priority(0, plain)
    check_priority(7, plain)
    check_priority(-10, gold)
    with pytest.raises(InvalidRequest) as err:
        check_priority(-1, plain)
    assert str(err.value) == ("priority: -1; tenant plain may ask for 0 or more (its max_priority in the tenants "
                              "file; lower is more important)")
    with pytest.raises(InvalidRequest, match=r"^priority: -11; tenant gold may ask for -10 or more"):
        check_priority(-11, gold)
    with pytest.raises(InvalidRequest, match=r"^priority: -10 \(the objective in x-gateway-inference-objective\); "):
        check_priority(-10, plain, from_hop=OBJECTIVE_HEADER)


@pytest.mark.parametrize("value", [1001, -1001, 2**31 - 1, -(2**31)])
def test_an_out_of_range_priority_names_the_range(value):
    with pytest.raises(InvalidRequest, match=rf"^priority: {value}; must be in \[-1000, 1000\]$"):
        check_priority(value, Tenant("gold", max_priority=-1000))


def test_the_waiting_request_of_a_class_is_requeued_at_the_front_of_its_class():
    s = planner("priority")
    q = s.waiting
    low, mid, mid_back = (make_request(0, 4, 3, priority=3), make_request(1, 4, 3, priority=1),
                          make_request(2, 4, 3, priority=1))
    for r in (low, mid):
        q.append(r)
    q.appendleft(mid_back)  # a recompute-preempted request: the front of its class, not ahead of a better class
    q.appendleft(make_request(3, 4, 3, priority=0))
    assert [r.request_id for r in q] == ["r3", "r2", "r1", "r0"]
    assert q.first("default").request_id == "r3" and mid_back in q
