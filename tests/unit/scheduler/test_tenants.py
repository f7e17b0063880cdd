"""Tenants file, API keys, fair admission (VTC), quotas, reserved pages and fair-share preemption, at the
scheduler level with a stand-in executor that checks KV contents (tests/support/fake_executor.py).
The host tier keeps tenants apart too."""

from __future__ import annotations

import pytest

from pagedkv.tenancy import InvalidTenant, Tenant, Tenants, Unauthenticated, hash_key
from scheduler_svc.pages import PagePool
from scheduler_svc.request import Finish, Status
from scheduler_svc.scheduler import SchedulerConfig
from scheduler_svc.wait_queue import WaitQueue
from tests.support.driven import Driven, driven
from tests.support.fake_executor import FakeExecutor, drive, make_request
from tests.support.scheduler_helpers import BS, assert_empty, new_scheduler

pytestmark = pytest.mark.unit


def load(tmp_path, text: str, num_pages: int = 100) -> Tenants:
    path = tmp_path / "tenants.toml"
    path.write_text(text)
    return Tenants.load(path, num_pages)


def test_tenants_file_is_parsed_and_keys_authenticate(tmp_path):
    t = load(tmp_path, f"""
[defaults]
page_budget = 32
[tenants.acme]
keys = ["{hash_key('k1')}", "{hash_key('k2')}"]
revoked_keys = ["{hash_key('old')}"]
weight = 2.5
page_quota = 0.5
reserved_pages = 10
[tenants.globex]
keys = ["{hash_key('g')}"]
page_budget = 8
overflow = "stop"
""")
    acme = t.authenticate([("authorization", "Bearer k2")])
    assert (acme.id, acme.weight, acme.page_quota, acme.reserved_pages, acme.page_budget) == ("acme", 2.5, 50, 10, 32)
    glob = t.authenticate([("authorization", "bearer g")])
    assert (glob.id, glob.page_budget, glob.overflow, glob.page_quota) == ("globex", 8, "stop", 100)
    for metadata, words in (([], "missing"), ([("authorization", "Bearer nope")], "unknown"),
                            ([("authorization", "Bearer old")], "revoked"), ([("authorization", "k1")], "Bearer")):
        with pytest.raises(Unauthenticated, match=words):
            t.authenticate(metadata)
    assert Tenants().authenticate([]).id == "default"  # single-tenant: nobody needs a key


@pytest.mark.parametrize("text,words", [
    ('[tenants.a]\nkeys = ["plain-text-key"]', "sha256"),
    ('[tenants.a]\nweigth = 2', "unknown field"),
    ('[tenants.a]\nreserved_pages = 60\n[tenants.b]\nreserved_pages = 60', "reserved_pages add up to 120"),
    ('[tenants.a]\npage_quota = 1.5', "fraction must be in"),
    ('[tenants.a]\npage_quota = 10\nreserved_pages = 20', "above its page_quota"),
    ('[tenants.a]\noverflow = "offload"', "overflow"),
    ('[tenants."bad id"]', "tenant id"),
    ('[tenant.a]', "unknown top-level"),
    ('[tenants.a]\nkeys = ["KEY"]\n[tenants.b]\nkeys = ["KEY"]', "share a key"),
    ('[tenants.a]\nmax_queued_requests = -1', r"tenants.a.max_queued_requests: must be an integer in \[0, "),
    ('[tenants.a]\nmax_queued_requests = 1.5', "max_queued_requests: must be an integer"),
])
def test_tenants_file_errors_name_the_field(tmp_path, text, words):
    text = text.replace('"KEY"', f'"{hash_key("same")}"')
    with pytest.raises(InvalidTenant, match=words):
        load(tmp_path, text)


def test_a_file_resolved_on_fewer_pages_is_cut_to_them_and_comes_back_on_more(tmp_path):
    """Loaded for 100 pages and resolved for the 40 that serve (an executor down): a count above the pool is cut
    to it, reserves that add up to more are scaled down together, a budget is cut to what its tenant can hold
    and a fraction that rounds to 0 pages is 1 (0 would be no quota). On 100 pages again the file's settings
    come back. Loading the file for 40 pages is still an error."""
    text = """
[tenants.a]
page_quota = 60
reserved_pages = 50
page_budget = 40
[tenants.b]
reserved_pages = 30
[tenants.c]
page_quota = 0.02
"""
    full = load(tmp_path, text)

    def settings(t: Tenants) -> dict:
        return {x.id: (x.page_quota, x.reserved_pages, x.page_budget) for x in t}
    few = full.resolve(40)
    assert settings(few) == {"a": (40, 22, 23), "b": (40, 17, 0), "c": (1, 0, 0)}
    assert few.total_reserved == 39
    assert settings(few.resolve(100)) == settings(full) == {"a": (60, 50, 40), "b": (100, 30, 0), "c": (2, 0, 0)}
    with pytest.raises(InvalidTenant, match="page_quota: 60 pages"):
        load(tmp_path, text, num_pages=40)


def test_vtc_serves_the_tenant_with_least_weighted_service():
    weights = {"a": 1.0, "b": 1.0, "c": 4.0}
    q = WaitQueue(fair=True, weight=weights.__getitem__)
    for i, t in enumerate(["a", "a", "a", "b", "c"]):
        q.append(make_request(i, 4, 4, tenant=t))
    q.charge("a", prompt_tokens=100)
    q.charge("b", prompt_tokens=50)
    q.charge("c", prompt_tokens=100)  # weight 4: 25
    assert q.head().tenant == "c"
    q.charge("c", output_tokens=40)  # 25 + 80 / 4 = 45 < b's 50
    assert q.head().tenant == "c"
    q.remove(q.head())  # c idle now
    assert q.head().tenant == "b"
    q.append(make_request(9, 4, 4, tenant="c"))  # back from idle: starts at the current minimum (b: 50)
    assert q.service("c") == 50
    fcfs = WaitQueue(fair=False)
    for i, t in enumerate(["a", "b", "a"]):
        fcfs.append(make_request(i, 4, 4, tenant=t))
    fcfs.charge("a", prompt_tokens=10**6)
    assert fcfs.head().arrival == 0


def two_tenants(a: Tenant, b: Tenant, pages: int = 24, seqs: int = 8, fair: bool = True) -> Driven:
    cfg = SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=64, max_model_len=96, watermark=0,
                          fairness=fair)
    return driven(PagePool(pages, BS), cfg, [2], tenants=Tenants([a, b]))


def test_a_capacity_is_never_negative_and_a_request_that_cannot_fit_ends_with_the_limit_named():
    """Tenants made in code are not fitted to the pool (no file to resolve): b reserves 40 of 24 pages. a's
    capacity is 0, not -16, and a's request ends at once with an error that names what a can hold."""
    s = two_tenants(Tenant("a"), Tenant("b", reserved_pages=40), pages=24)
    assert (s.fit_limits("a").capacity, s.fit_limits("b").capacity) == (0, 24)
    req = make_request(0, 8, 4, tenant="a")
    s.add(req)
    _, outputs = s.schedule()
    assert [(r, o.error) for r, o in outputs] == [
        (req, "8 tokens (prompt and output so far) do not fit what tenant a can hold (0 pages)")]


def test_quota_holds_while_the_other_tenant_runs():
    s = two_tenants(Tenant("a", page_quota=8), Tenant("b"))
    flood = [make_request(i, 12, 20, prompt=[10 + i] * 12, tenant="a") for i in range(6)]
    quiet = [make_request(10 + i, 8, 4, prompt=[50 + i] * 8, tenant="b") for i in range(3)]
    for r in flood + quiet:
        s.add(r)
    peak = {"a": 0}
    finished_at: dict[str, int] = {}

    def watch(sched):
        peak["a"] = max(peak["a"], sched.pool.used_by["a"])
        for r in flood + quiet:
            if r.finish is not None:
                finished_at.setdefault(r.request_id, sched.step_id)

    drive(s, on_step=watch)
    assert peak["a"] <= 8 and all(r.finish is Finish.LENGTH for r in flood + quiet)
    # b did not wait for a's queue: all of b finished before a's last four requests
    assert max(finished_at[r.request_id] for r in quiet) < min(finished_at[r.request_id] for r in flood[2:])
    assert s.stats("a").peak_used_pages <= 8


def test_reserved_pages_are_there_for_their_tenant_at_once():
    """a has no quota but b reserves 10 of the 24 pages: a never holds more than 14, and b is admitted in
    the very step it arrives."""
    s = two_tenants(Tenant("a"), Tenant("b", reserved_pages=10))
    for i in range(6):
        s.add(make_request(i, 12, 20, prompt=[10 + i] * 12, tenant="a"))
    ex = FakeExecutor(BS)
    for _ in range(5):
        plan, _ = s.schedule()
        s.process(ex.step(plan))
        assert s.pool.used_by["a"] <= 14
    b = make_request(50, 30, 4, prompt=[77] * 30, tenant="b")  # 8 pages
    s.add(b)
    plan, _ = s.schedule()
    assert b.status is Status.RUNNING and b.request_id in {r.request_id for r in plan.new_requests}
    s.process(ex.step(plan))
    drive(s, executor=ex)
    assert s.pool.num_used == 0


def test_a_tenant_over_its_share_gives_pages_back():
    """a holds the whole pool; b arrives with less than its fair share (half): a's requests are preempted
    until b fits, and b runs within two steps."""
    s = two_tenants(Tenant("a"), Tenant("b"), pages=20)
    for i in range(5):
        s.add(make_request(i, 16, 8, prompt=[10 + i] * 16, tenant="a"))  # 4 pages each + growth
    ex = FakeExecutor(BS)
    for _ in range(3):
        plan, _ = s.schedule()
        s.process(ex.step(plan))
    assert s.pool.used_by["a"] >= 19
    b = make_request(50, 12, 4, prompt=[77] * 12, tenant="b")
    s.add(b)
    for _ in range(2):
        plan, _ = s.schedule()
        s.process(ex.step(plan))
    assert b.status is Status.RUNNING or b.finish is not None
    assert s.stats("a").fair_share_preemptions >= 1
    drive(s, executor=ex)
    assert s.pool.num_used == 0 and b.finish is Finish.LENGTH


def test_concurrency_limit_per_tenant():
    s = two_tenants(Tenant("a", max_concurrent_requests=2), Tenant("b"), pages=60)
    for i in range(5):
        s.add(make_request(i, 8, 10, prompt=[10 + i] * 8, tenant="a"))
    s.add(make_request(9, 8, 10, prompt=[90] * 8, tenant="b"))
    most = 0

    def watch(sched):
        nonlocal most
        most = max(most, sum(1 for r in sched.running if r.tenant == "a"))

    drive(s, on_step=watch)
    assert most == 2


@pytest.mark.parametrize("seed", range(8))
def test_random_tenants_quotas_budgets_and_swaps(seed):
    """Property test: tenants with quotas, reserves, concurrency limits and weights, requests with page
    budgets (window or stop), forks, aborts and swaps: everything ends, KV contents stay exact, no tenant
    exceeds its quota, no request its budget, nothing leaks."""
    import random

    from scheduler_svc.policy import Mode
    from tests.support.scheduler_helpers import assert_empty, new_scheduler

    rng = random.Random(seed)
    pages = rng.choice([24, 32])
    tenants = Tenants([Tenant("a", weight=rng.choice([1.0, 3.0]), page_quota=rng.choice([0, 12, 20]),
                              max_concurrent_requests=rng.choice([0, 2])),
                       Tenant("b", reserved_pages=rng.choice([0, 5]), page_budget=rng.choice([0, 5]),
                              page_quota=rng.choice([0, 5, 8]), overflow=rng.choice(["window", "stop"])),
                       Tenant("c")])
    s = new_scheduler(pages=pages, host_pages=rng.choice([0, 24]), mode=Mode.AUTO, budget=rng.choice([16, 64]),
                      seqs=rng.choice([4, 8]), hot=rng.choice([0, 2]), max_len=200, tenants=tenants,
                      fair=rng.choice([True, False]))
    reqs = []
    ticks = iter(range(10_000))

    def feed(sched):
        for t in sched.tenants:
            quota = t.page_quota or pages
            assert sched.pool.used_by[t.id] <= quota, f"tenant {t.id} above its quota"
        if next(ticks) < 120 and rng.random() < 0.35:
            i = len(reqs)
            tenant = tenants.get(rng.choice("abc"))
            budget = tenant.page_budget
            sink, window = (BS, (budget - 2) * BS) if budget and tenant.overflow == "window" else (0, 0)
            prompt_len = rng.randint(1, 4 * budget - 1 if budget and tenant.overflow == "stop" else 40)
            req = make_request(i, 0, rng.randint(1, 30), prompt=[rng.randrange(3, 250) for _ in range(prompt_len)],
                               tenant=tenant.id, n=rng.choice([1, 1, 2]), page_budget=budget,
                               overflow=tenant.overflow, sink_tokens=sink, window_tokens=window)
            reqs.append(req)
            sched.add(req)
        if sched.requests and rng.random() < 0.02:
            sched.abort(rng.choice(list(sched.requests.values())).group)

    drive(s, on_step=feed, feed_ticks=120)
    assert len(reqs) > 20
    assert all(r.status is Status.FINISHED or (r.n > 1 and r.compute_target == 0) for r in reqs)
    assert_empty(s)


def test_a_tenant_over_its_share_of_seats_gives_one_back():
    """a runs on all 4 seats; b arrives (its counter starts at a's: no credit for idling): within two steps
    fairness takes one of a's seats back (b's weighted share is 2 of 4), without waiting for a's requests."""
    s = two_tenants(Tenant("a"), Tenant("b"), pages=60, seqs=4)
    for i in range(6):
        s.add(make_request(i, 8, 30, prompt=[10 + i] * 8, tenant="a"))
    ex = FakeExecutor(BS)
    for _ in range(3):
        plan, _ = s.schedule()
        s.process(ex.step(plan))
    assert sum(1 for r in s.running if r.tenant == "a") == 4
    b = make_request(50, 8, 4, prompt=[77] * 8, tenant="b")
    s.add(b)
    for _ in range(2):
        plan, _ = s.schedule()
        s.process(ex.step(plan))
    assert b.status is Status.RUNNING and s.stats("a").fair_share_preemptions == 1
    drive(s, executor=ex)
    assert s.pool.num_used == 0


def test_a_reload_that_lowers_a_quota_ends_what_no_longer_fits():
    s = two_tenants(Tenant("a", page_quota=24), Tenant("b"), pages=32)
    big = make_request(0, 40, 50, prompt=[5] * 40, tenant="a")  # up to 90 tokens: 23 pages
    small = make_request(1, 8, 4, prompt=[6] * 8, tenant="a")
    s.add(big)
    s.add(small)
    ex = FakeExecutor(BS)
    for _ in range(3):
        plan, _ = s.schedule()
        s.process(ex.step(plan))
    ended = s.set_tenants(Tenants([Tenant("a", page_quota=8), Tenant("b")]))
    assert [r for r, _ in ended] == [big] and "8 pages" in ended[0][1].error
    drive(s, executor=ex)
    assert small.finish is Finish.LENGTH and s.pool.num_used == 0


def test_a_tenant_served_alone_banks_no_credit_against_a_newcomer():
    """x is served alone; later x and a new tenant y arrive together: y starts at x's service (the last
    tenant to go idle), so the two alternate instead of y taking the next 10 admissions."""
    s = two_tenants(Tenant("x"), Tenant("y"), pages=200, seqs=1)
    for i in range(5):
        s.add(make_request(i, 8, 80, prompt=[10 + i] * 8, tenant="x"))  # 5 x (8 + 2 x 80) = 840 of service
    drive(s)
    order = []
    for i in range(10):  # y's burst lands first, while nobody is active
        s.add(make_request(200 + i, 8, 8, prompt=[70 + i] * 8, tenant="y"))
    for i in range(10):
        s.add(make_request(100 + i, 8, 8, prompt=[40 + i] * 8, tenant="x"))

    def watch(sched):
        for r in sched.running:
            if not order or order[-1] is not r:
                order.append(r)

    drive(s, on_step=watch)
    first = "".join(r.tenant for r in order[:10])
    assert first.count("x") >= 3, f"admission order {first}"


def test_host_tier_keeps_tenants_apart():
    s = new_scheduler(pages=10, host_pages=20)
    prefix = list(range(30, 58))  # 7 pages
    s.add(make_request(0, 0, 2, prompt=prefix + [3], tenant="a"))
    drive(s)
    for i in range(1, 3):
        s.add(make_request(i, 0, 2, prompt=[100 + i] * 33, tenant="a"))
        drive(s)
    assert s.counters.spilled_pages >= 7
    other = make_request(8, 0, 2, prompt=prefix + [4], tenant="b")
    s.add(other)
    drive(s)
    assert other.num_cached_tokens == 0 and s.counters.spill_hits == 0
    same = make_request(9, 0, 2, prompt=prefix + [4], tenant="a")
    s.add(same)
    drive(s)
    # (b's own pages spilled meanwhile and pushed some of a's out of the host LRU)
    assert same.num_cached_tokens >= 16 and s.counters.spill_hits >= 4
    assert_empty(s)
