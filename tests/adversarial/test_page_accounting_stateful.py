"""A hypothesis state machine against the scheduler's page accounting (issue 13, the adversarial suite).

A real Scheduler drives a FakeExecutor (tests/support/fake_executor.py: it checks that every scheduled request reads
back exactly the KV it wrote, through swaps, spills and copies). Rules admit requests (random lengths, shared
prefixes, tenants with quotas, reserves and concurrency limits, n > 1 forks, page budgets with the window and
stop policies, sliding windows), plan and complete steps (separately, so cancels and failures land while a plan
is in flight; with async scheduling drawn on, a second plan is built and sent before the first is answered),
cancel, reject a plan (a desync), and fail the executor (evacuate, then the requests come back on
a fresh executor, as the cluster re-places them). Small pools make preemption (swap and recompute), spills to the
host tier and copy-on-write happen all the time.

After every rule: ``check_integrity()`` (refcounts equal the tables holding each page, on both tiers), every page
in exactly one of used / free-and-cached / free, per-tenant counts, quotas and page budgets. At the end the
machine drains: every client stream ends exactly once with every token it was owed, and no page is left used
(that bookkeeping and the drain: tests/support/page_accounting.py).
"""

from __future__ import annotations

import inspect
from collections import Counter, deque

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagedkv.executor.v1 import executor_pb2 as pb
from pagedkv.tenancy import Tenant, Tenants
from scheduler_svc.detokenizer import IncrementalDetokenizer
from scheduler_svc.fit import FitError, check_n, shape
from scheduler_svc.pages import PagePool
from scheduler_svc.policy import Mode, PreemptionConfig, PreemptionCosts
from scheduler_svc.prefix_cache import tenant_root
from scheduler_svc.request import Request, Retain, Sampling
from scheduler_svc.scheduler import SchedulerConfig
from tests.support.adversarial_profiles import LONG, profile
from tests.support.driven import Driven, driven
from tests.support.fake_executor import FakeExecutor, NullTokenizer
from tests.support.page_accounting import AccountingChecks

# in-process (no process, no socket), but a stateful property run of 5-10 s here: over the unit budget
pytestmark = pytest.mark.e2e

BS = 4
MAX_MODEL_LEN = 64
CHEAP_SWAP = PreemptionCosts(page_bytes=65536, swap_bytes_per_second=4e9, prefill_seconds_per_token=70e-6)
PREFIXES = [[(11 * k + j) % 200 + 3 for j in range(9)] for k in range(3)]  # shared prompt starts (2+ pages)
TENANTS = [
    Tenant("a", weight=2.0),
    Tenant("b", page_quota=8),
    Tenant("c", page_budget=4, overflow="stop", reserved_pages=2),
    Tenant("d", sliding_window=6, sink_tokens=3, max_concurrent_requests=2),
    Tenant("e", page_budget=5, overflow="window", page_quota=12),
]
# A reload (SIGHUP) swaps between these and TENANTS: quotas, reserves and concurrency lowered, a window narrowed.
RELOADED = [
    Tenant("a", weight=1.0),
    Tenant("b", page_quota=5),
    Tenant("c", page_budget=4, overflow="stop", reserved_pages=3),
    Tenant("d", sliding_window=5, sink_tokens=3, max_concurrent_requests=1),
    Tenant("e", page_budget=5, overflow="window", page_quota=7),
]
KEEP_CACHE = "keep_cache" in inspect.signature(Driven.evacuate).parameters  # a lost Run stream, same process


class PageAccounting(AccountingChecks, RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.s: Driven | None = None

    @initialize(pages=st.integers(8, 24), host_pages=st.sampled_from([0, 6, 16]),
                token_budget=st.sampled_from([4, 8, 16, 64]), seqs=st.sampled_from([2, 3, 8]),
                mode=st.sampled_from(list(Mode)), caching=st.booleans(), multi=st.booleans(),
                hot=st.sampled_from([0, 2, 64]), max_wait=st.sampled_from([0, 3, 64]),
                watermark=st.sampled_from([0.0, 0.1]), sliding=st.sampled_from([0, 0, 7]), overlap=st.booleans())
    def setup(self, pages, host_pages, token_budget, seqs, mode, caching, multi, hot, max_wait, watermark, sliding,
              overlap):
        cfg = SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=token_budget, max_model_len=MAX_MODEL_LEN,
                              watermark=watermark, enable_prefix_caching=caching, sliding_window=sliding,
                              sink_tokens=2 if sliding else 0,
                              preemption=PreemptionConfig(mode=mode, hot_steps=hot, cold_steps=max(hot, 4),
                                                          swap_in_max_wait=max_wait))
        host = PagePool(host_pages, BS, min_pages=0) if host_pages else None
        tenants = Tenants(list(TENANTS)) if multi else Tenants()
        self.s = driven(PagePool(pages, BS), cfg, [2], host_pool=host, costs=CHEAP_SWAP, tenants=tenants)
        self.now = 0.0  # the retentions' clock (seconds)
        self.s.retained.clock = lambda: self.now
        self.ex = FakeExecutor(BS)
        self.pending: deque[pb.StepPlan] = deque()  # sent, not yet answered (oldest first)
        self.depth = 2 if overlap else 1  # plans in flight at most (async scheduling: the next before the last result)
        self.next_id = 0
        self.groups: dict[str, Request] = {}  # client requests (the first Request object of each)
        self.cancelled: set[str] = set()
        self.finals: Counter[tuple[str, int]] = Counter()  # (group, index) -> final outputs seen
        self.tokens: Counter[tuple[str, int]] = Counter()  # (group, index) -> tokens streamed
        self.final_outputs: dict[tuple[str, int], object] = {}
        self.max_len_at_end: dict[tuple[str, int], int] = {}
        self.events: Counter[str] = Counter()
        # After a reload lowered a limit, what a tenant or request held above it may only go down.
        self.above_quota: dict[str, int] = {}
        self.above_limit: dict[str, int] = {}

    # ---- rules ---------------------------------------------------------------------------------
    @rule(tenant=st.sampled_from([t.id for t in TENANTS]), prefix=st.sampled_from([None, 0, 1, 2]),
          own=st.lists(st.integers(3, 250), min_size=0, max_size=36), max_tokens=st.integers(1, 30),
          n=st.sampled_from([1, 1, 1, 2, 3]), asked_budget=st.sampled_from([0, 0, 3, 4, 6]),
          priority=st.integers(0, 2), retain=st.sampled_from([None, None, "k0", "k1", "k2"]),
          ttl=st.integers(1, 20))
    def admit(self, tenant, prefix, own, max_tokens, n, asked_budget, priority, retain, ttl):
        s = self.s
        t = s.tenants.get(tenant if s.tenants.multi else "default")
        prompt = (PREFIXES[prefix] if prefix is not None else []) + own
        if not prompt:
            prompt = [5]
        # Only what the public API would accept (the fit rule, on this scheduler's limits).
        limits = s.fit_limits(t.id)
        try:
            shaped = shape(t, len(prompt), asked_budget, limits, MAX_MODEL_LEN)
            check_n(n, t, limits)
        except FitError:
            self.events["refused"] += 1
            return
        budget, sink, window = shaped.page_budget, shaped.sink, shaped.window
        if not window and len(prompt) >= shaped.max_len:
            return
        root = tenant_root(t.id) if not window else tenant_root(f"{t.id}\x00window:{sink}:{window}")
        rid = f"q{self.next_id}"
        req = Request(request_id=rid, prompt_ids=prompt, sampling=Sampling(max_tokens=max_tokens), arrival=self.next_id,
                      detokenizer=IncrementalDetokenizer(NullTokenizer(), prompt, [], False), n=n, tenant=t.id,
                      hash_root=root, priority=priority, page_budget=budget, overflow=t.overflow, sink_tokens=sink,
                      window_tokens=window, retain=Retain(retain, ttl) if retain else None)
        self.next_id += 1
        self.groups[rid] = req
        s.add(req)
        self.events["admitted"] += 1

    @precondition(lambda self: len(self.pending) < self.depth)
    @rule()
    def plan(self) -> None:
        plan, outputs = self.s.schedule()
        self._deliver(outputs)
        if plan is not None:
            self.pending.append(plan)

    @precondition(lambda self: self.pending)
    @rule()
    def complete(self) -> None:
        plan = self.pending.popleft()
        self._note(plan)
        self._deliver(self.s.process(self.ex.step(plan)))

    @rule(steps=st.integers(1, 12))
    def run_steps(self, steps: int) -> None:
        """Steps as the engine runs them: plan (while the last plan is in flight, with async scheduling), then
        complete the oldest once ``depth`` are in flight or nothing more could be planned."""
        for _ in range(steps):
            before = len(self.pending)
            if before < self.depth:
                self.plan()
            if not self.pending:
                return
            if len(self.pending) >= self.depth or len(self.pending) == before:  # (full, or nothing more to plan)
                self.complete()

    # (a rejection with another plan in flight is a lost executor: see executor_fails)
    @precondition(lambda self: len(self.pending) == 1 and not self.s.stream.resending)
    @rule(name_them=st.booleans(), odds=st.integers(0, 3))
    def reject(self, name_them: bool, odds: int) -> None:
        """The executor disagreed with the plan and ran nothing of it (a desync)."""
        if odds:
            return
        plan = self.pending.popleft()
        named = [r.request_id for r in plan.new_requests][:1] if name_them else []
        self._deliver(self.s.process(pb.StepResult(step_id=plan.step_id, error="injected desync",
                                                   desynced_request_ids=named)))
        self.events["rejected"] += 1

    @precondition(lambda self: self.s is not None and len(self.pending) < self.depth and self.s.running)
    @rule(data=st.data())
    def preempt(self, data) -> None:
        """A running request gives its pages back while planning (swapped or recomputed, as the policy picks), as
        the fair-share rules do it: with async scheduling, possibly while a plan computing for it is in flight."""
        s = self.s
        victim = data.draw(st.sampled_from(sorted(s.running, key=lambda r: r.request_id)))
        s._preempt(victim, s.step_id + 1)
        self.events["forced_preemptions"] += 1
        if self.pending:  # planning under a plan in flight: what it decided goes out before that plan's result
            self.plan()

    @precondition(lambda self: self.s is not None and self.s.tenants.multi)
    @rule(odds=st.integers(0, 5))
    def reload_tenants(self, odds: int) -> None:
        """SIGHUP with another tenants file, possibly while a plan is in flight: requests that no longer fit
        end with an error; the others keep their pages but may not grow past the new limits."""
        if odds:
            return
        s = self.s
        reloaded = s.tenants.get("b").page_quota == 8
        self._deliver(s.set_tenants(Tenants(list(RELOADED if reloaded else TENANTS))))
        for t in s.tenants:
            if t.page_quota and s.pool.used_by[t.id] > t.page_quota:
                self.above_quota[t.id] = s.pool.used_by[t.id]
        for r, pages in self._held():
            limit = r.page_budget or r.page_limit
            if limit and pages > limit:
                self.above_limit[r.request_id] = pages
        self.events["reloads"] += 1

    @rule(seconds=st.integers(0, 10))
    def clock_ticks(self, seconds: int) -> None:
        """Time passes: retentions past their TTL end at the next plan (their pages zeroed by it)."""
        self.now += seconds

    @precondition(lambda self: self.s is not None and len(self.s.retained))
    @rule(data=st.data())
    def release_kv(self, data) -> None:
        """ReleaseKv of a retention (possibly while a plan is in flight); another tenant's key is not found."""
        retained = self.s.retained
        tenant, key = data.draw(st.sampled_from(sorted((r.tenant, r.key) for r in retained)))
        assert retained.end(tenant + "-other", key) is None
        freed = retained.end(tenant, key)
        assert freed is not None and retained.get(tenant, key) is None
        self.events["released"] += 1

    @precondition(lambda self: self.s is not None and self.s.requests)
    @rule(data=st.data(), odds=st.integers(0, 3))
    def cancel(self, data, odds: int) -> None:
        if odds:  # (hypothesis has no rule weights: most draws of a rare rule do nothing)
            return
        live = sorted({r.group for r in self.s.requests.values()})
        group = data.draw(st.sampled_from(live))
        self.s.abort(group)
        self.cancelled.add(group)
        self.events["cancelled"] += 1

    @rule(odds=st.integers(0, 7), how=st.sampled_from(["restart", "stream_lost", "stream_lost_after_run"]))
    def executor_fails(self, odds: int, how: str) -> None:
        """The executor dies (with a plan in flight or not): its requests leave with no page held, and come
        back, oldest first, on a fresh executor with empty pools. Or (where the scheduler supports it) only the
        Run stream was lost and the same process comes back with its pages as they were, the plan in flight
        run or not: the prefix cache may keep what it knows for sure, and every later read must find it."""
        if odds:
            return
        s = self.s
        keep = how != "restart" and KEEP_CACHE
        if keep and how == "stream_lost_after_run":
            for plan in self.pending:
                self.ex.step(plan)  # they ran; the results never arrived
        moved, ended = s.evacuate(keep_cache=True) if keep else s.evacuate()
        self.pending.clear()
        self._deliver(ended)
        s.check_integrity()
        assert s.pool.num_used == self._retained_pages() and not s.requests, "pages or requests left on an executor"
        assert keep or not s.retained, "retained pages of a dead executor are still held"
        if s.host is not None:
            assert s.host.num_used == 0, "host pages left on a failed executor"
        old, self.ex = self.ex, FakeExecutor(BS)
        if keep:
            self.ex.device, self.ex.host = old.device, old.host
        else:
            assert s.pool.num_cached == 0, "the prefix cache still points at the dead executor's pages"
        for req in reversed(moved):
            s.add(req, front=True)
        self.events["failures"] += 1

    # ---- invariants ----------------------------------------------------------------------------
    @invariant()
    def accounting_holds(self) -> None:
        s = self.s
        if s is None:
            return
        s.check_integrity()
        for pool in (s.pool, s.host):
            if pool is None:
                continue
            used = sum(1 for rc in pool.refcounts if rc > 0)
            cached_free = sum(1 for p in pool.free_queue if pool.hash_of(p) is not None)
            plain_free = sum(1 for p in pool.free_queue if pool.hash_of(p) is None)
            assert used + cached_free + plain_free == pool.num_pages
            assert used == pool.num_used and sum(pool.used_by.values()) == used
            assert min(pool.refcounts) >= 0
        if not s.tenants.multi:  # (a reload may lower a tenant's cap below what it holds: only go down then)
            cap = s.limits.max_retained("default", s.config.kv_retention_max_share)
            assert self._retained_pages() <= cap, f"{self._retained_pages()} retained pages, cap {cap}"
        for t in s.tenants:
            if t.page_quota:
                used, cap = s.pool.used_by[t.id], max(t.page_quota, self.above_quota.get(t.id, 0))
                assert used <= cap, f"tenant {t.id} holds {used} pages, quota {t.page_quota}"
                self.above_quota[t.id] = used if used > t.page_quota else 0
        for r, held in self._held():
            limit = r.page_budget or r.page_limit
            if limit:
                cap = max(limit, self.above_limit.get(r.request_id, 0))
                assert held <= cap, f"{r.request_id} ({r.status.value}) holds {held} pages, limit {limit}"
                self.above_limit[r.request_id] = held if held > limit else 0


TestPageAccounting = PageAccounting.TestCase
TestPageAccounting.settings = profile(ci_examples=200, long_examples=3000,
                                      stateful_step_count=80 if LONG else 50)
