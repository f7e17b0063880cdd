"""Continuous batching for one executor: which requests run this step, how many tokens each, which pages.

``Scheduler`` is one executor's planner (the name predates the cluster: the process-wide scheduler is ``Cluster``,
and each executor has an ``Engine`` that drives its ``Scheduler``). Each ``plan`` call plans one step and returns
it as plain data (``step.Step``); the wire (step_stream.py) encodes it as a StepPlan and hands the executor's
answer back to ``process``. Requests join and leave at every step; prefills are cut into chunks so a step never
computes more than ``max_num_batched_tokens`` tokens; pages are allocated as tokens arrive and freed the moment a
request ends. When pages run out a running request is preempted: the victim, and whether it is swapped to the
host tier or recomputed later, come from ``policy.py``. Swapped requests come back after new prefills (TTFT
first), unless one has waited ``swap_in_max_wait`` steps: then it goes first.

Around it (ARCHITECTURE.md has the map): the lists are ``queues.py``'s, pages ``kv_manager.py``'s; ``admission.py``
and ``fair_share.py`` decide over a read-only ``PlanView``, and the planner applies what they return.
"""

from __future__ import annotations

from pagedkv.tenancy import Tenants
from scheduler_svc import fair_share, fit, priority
from scheduler_svc.adapter_slots import AdapterSlots
from scheduler_svc.admission import Admit, Evict, PageIn, Reclaim, Refuse, SwapIn, admissions
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.kv_manager import KVManager
from scheduler_svc.outputs import OutputProcessor, TokenOutcome, final
from scheduler_svc.pages import PagePool
from scheduler_svc.plan_view import PlanView, plans_ahead
from scheduler_svc.policy import PreemptionCosts, PreemptionPolicy, shared_cached_tokens
from scheduler_svc.queues import RequestQueues
from scheduler_svc.report import snapshot_of
from scheduler_svc.request import Finish, Output, Request, Status, forks
from scheduler_svc.retention import KvRetention
from scheduler_svc.scheduler_lifecycle import ExecutorLifecycle
from scheduler_svc.slo_budget import step_budget
from scheduler_svc.snapshot import Counters, SchedulerSnapshot
from scheduler_svc.step import InFlight, PageOps, Scheduled, Step
from scheduler_svc.tenant_ledger import TenantLedger
from scheduler_svc.tenant_limits import TenantLimits, TenantStats

__all__ = ["Outputs", "Scheduler", "SchedulerConfig"]

Outputs = list[tuple[Request, Output]]


class Scheduler(ExecutorLifecycle):
    """One executor's planner. Its parts (``queues``, ``kv``, ``retained``, ``limits``, ``ledger``, ``counters``,
    ``config``) are attributes for tests to inspect; the rest of the service calls its methods and reads its
    ``snapshot`` (ReleaseKv ends a retention through ``retained``: retention_api.py)."""

    def __init__(self, pool: PagePool, config: SchedulerConfig, eos_token_ids: list[int],
                 host_pool: PagePool | None = None, costs: PreemptionCosts | None = None,
                 tenants: Tenants | None = None, ledger: TenantLedger | None = None, counters: Counters | None = None,
                 tenant_stats: dict[str, TenantStats] | None = None) -> None:
        """``ledger``: the scheduler-wide tenant ledger to join (a cluster's; else one of its own, over
        ``tenants``). ``counters`` and ``tenant_stats``: the counts so far, when this replaces another planner."""
        self.adapters: AdapterSlots | None = None  # the executor's LoRA device slots (use_adapters)
        self.clock = None  # the executor's step-time model (plan_clock.StepClock, the engine's): slo_budget.py
        self._pool = pool
        self.config = config
        self._eos_token_ids = list(eos_token_ids)
        self.counters = counters if counters is not None else Counters()  # cumulative ("since start")
        self.kv = KVManager(pool, config.enable_prefix_caching, host_pool, self.counters, config.exact_tail_pages)
        self.retained = KvRetention(pool, self.kv.host, lambda pages: self.kv.ops.zero.extend(pages))  # retention.py
        self._policy = PreemptionPolicy(config.preemption, costs or PreemptionCosts(page_bytes=0))
        self._outputs = OutputProcessor(set(eos_token_ids), pool.block_size)
        self.ledger = ledger if ledger is not None else TenantLedger(tenants)
        self.queues = RequestQueues(config.fairness, self.ledger, config.scheduling_policy == "priority")
        self.limits = TenantLimits(self.ledger, pool, self.queues, tenant_stats)
        self._deferred: Outputs = []  # requests ended between plans (handed out with the next)
        self._rode = False  # the step being planned admitted a request sharing pages a plan computes (rides.py)
        self.step_id = 0
        self._watermark_pages = int(config.watermark * pool.num_pages)

    def fit_limits(self, tenant_id: str) -> fit.FitLimits:
        """What this executor lets one request of the tenant hold (the fit rule's input)."""
        return fit.limits_for(tenant_id, self.limits.capacity(tenant_id), self._pool.block_size, self.config)

    # ---- intake --------------------------------------------------------------------------------
    def add(self, req: Request, front: bool = False) -> None:
        """A new request, or (front) one migrated from another executor, which goes ahead of new work as a
        recompute-preempted one would."""
        if req.admitted_at_step < 0:  # (a migrated request admitted elsewhere keeps that executor's figures)
            req.queued_at_step = self.step_id
        queues, limits = self.queues, self.fit_limits(req.tenant)
        req.max_len, req.page_limit = fit.bounds(req, limits)
        problem = fit.misfit(req, limits)
        if problem:
            # (the API refuses these, and placement avoids executors too small for a migrated request; a
            # request that could never be admitted must not wait forever)
            queues.enqueue(req)
            self._deferred.append((req, self.finish(req, Finish.ABORT, error=problem)))
            return
        if req.n > 1 and req.compute_target == 0:  # nothing to share: the forks start on their own
            for child in forks(req):
                queues.enqueue(child)
            return
        queues.enqueue(req, front)

    def placement(self, req: Request) -> int | None:
        """For placement (reads only): None when this executor can never hold the request, else the pages of its
        prompt that its prefix cache holds."""
        if fit.misfit(req, self.fit_limits(req.tenant)):
            return None
        return len(self.kv.find_hits(req))

    def live_requests(self) -> list[Request]:
        """Every request on this executor (running, waiting or swapped), in no particular order."""
        return list(self.queues.requests.values())

    def abort(self, group: str) -> None:
        """Marks a client request (all its forks); pages are freed when the next plan is built."""
        for req in self.queues.requests.values():
            if req.group == group:
                req.aborted = True

    @property
    def has_work(self) -> bool:
        return bool(self.queues or self.queues.has_forget or self._deferred)

    # ---- planning ------------------------------------------------------------------------------
    def plan(self, resend: bool = False, rides: bool = True) -> tuple[Step | None, Outputs]:
        """The next step (None: nothing to send) and the messages of requests ended since the last. ``resend``: plan
        nothing (the wire resends a rejected plan's page operations), only the ids to forget. ``rides``: a request
        may share prefix pages another request's plans compute (rides.py)."""
        outputs = [(r, self.finish(r, Finish.ABORT)) for r in list(self.queues.requests.values()) if r.aborted]
        self.retained.expire()  # (their pages are zeroed by the plan below)
        outputs += self._deferred
        self._deferred.clear()
        if resend:
            self.step_id += 1
            loads = self.adapters.all_loads() if self.adapters is not None else []
            return Step(self.step_id, [], PageOps(), self.queues.take_forget(), resend=True,
                        adapter_loads=loads), outputs
        self.kv.set_rides(rides)
        self._rode = False
        scheduled = self._plan_step()
        if not scheduled and not self.queues.has_forget and not self.kv.ops:
            return None, outputs
        self.step_id += 1
        self.counters.peak_used_pages = max(self.counters.peak_used_pages, self._pool.num_used)
        self.limits.record_peaks()
        loads = [] if self.adapters is None else self.adapters.step_loads(scheduled, self.step_id)
        return Step(self.step_id, scheduled, self.kv.take_ops(), self.queues.take_forget(), rides=self._rode,
                    adapter_loads=loads), outputs

    def _plan_step(self) -> list[Scheduled]:
        """The requests of the next step, the tokens each computes and whether it samples: the running ones first
        (growing, preempting others when pages are short), then admissions while the token budget (slo_budget.py)
        lasts. What the step computes is counted at once (optimistically: the next may be planned before its result)."""
        budget = step_budget(self.clock, self.config, self.queues.running, self.queues.waiting, self._pool.block_size)
        scheduled: list[Scheduled] = []
        now = self.step_id + 1
        view = PlanView(self.config, self.queues, self.kv, self.retained, self.limits, self.ledger, self._policy,
                        self._watermark_pages, now, self.adapters)
        while (victims := fair_share.victims_for_head(view)) and (key := self.retained.reclaimable()) is not None:
            self.retained.end(*key)  # retained pages go before any running request
        for victim in victims:
            self._preempt(victim, now)  # (admission goes on this step)
            self.limits.stats(victim.tenant).fair_share_preemptions += 1
        if not victims:  # one request gets room a step: its fair share first, else its class's (priority.py)
            while (victims := priority.victims_for_head(view)) and (key := self.retained.reclaimable()) is not None:
                self.retained.end(*key)
            for victim in victims:
                self._preempt(victim, now)
        preempted = 0
        i = 0
        kv, running, outputs = self.kv, self.queues.running, self._outputs
        while i < len(running) and budget > 0:
            req = running[i]
            if (req.num_pending and not plans_ahead(req, kv, outputs)) or req.num_uncomputed <= 0:
                i += 1  # this step goes without it: its result comes first (a fork parent's: the fork)
                continue
            if kv.decodes_in_place(req):  # the steady decode: nothing to allocate, copy or drop
                scheduled.append(req.count(1, now))
                budget -= 1
                i += 1
                continue
            n = kv.window_chunk_limit(req, min(req.num_uncomputed, budget))
            grown, victims = self._reserve(req, n, running[i:], now)
            preempted += victims
            if not grown:
                continue  # req itself was preempted; the list shrank
            scheduled.append(req.count(n, now))
            budget -= n
            i += 1
        if not preempted:
            self._admit(view, budget, scheduled)
        elif self.ledger.tenants.total_reserved:  # pages are short, but reserved pages are there for their tenants
            self._admit(view, budget, scheduled, only_reserved=True)
        return scheduled

    def _admit(self, view: PlanView, budget: int, scheduled: list[Scheduled], only_reserved: bool = False) -> None:
        """Applies admission's decisions (admission.py), each before the next is decided."""
        for d in admissions(view, budget, only_reserved):
            if d.__class__ is Reclaim:
                self.retained.end(*d.key)
                continue
            if d.__class__ is PageIn or d.__class__ is Evict:
                self.adapters.apply(d, view.now)
                continue
            req = d.req
            if d.__class__ is Admit:
                self.queues.admit(req)
                self._rode |= any(not host and self._pool.hash_of(p) is None for p, host in d.hits)  # (rides.py)
                self.kv.admit(req, d.hits, d.n)
                if req.num_preemptions == 0:  # weighted service: the prompt tokens it will compute
                    self.queues.waiting.charge(req.tenant, prompt_tokens=req.compute_target
                                               - len(d.hits) * self._pool.block_size)
                if req.admitted_at_step < 0:
                    req.admitted_at_step = view.now
                scheduled.append(req.count(d.n, view.now))
            elif d.__class__ is SwapIn:
                self.queues.swap_in(req)
                self.kv.swap_in(req, d.n)
                scheduled.append(req.count(d.n, view.now))
            elif d.__class__ is Refuse:
                self._deferred.append((req, self.finish(req, Finish.ABORT, error=d.error)))
            else:  # Trim
                self._drop_outside_window(req)

    def _reserve(self, req: Request, n: int, unscheduled: list[Request], now: int) -> tuple[bool, int]:
        """Makes req's table cover num_computed + n tokens, preempting unscheduled requests (or req); returns
        (whether req got them, how many were preempted)."""
        self._drop_outside_window(req)
        over_share: set[str] | None = None
        ledger = self.ledger
        tenant = ledger.tenants.get(req.tenant)
        preempted = 0
        while not self.limits.can_take(req.tenant, need := self.kv.pages_to_grow(req, n)):
            own = ledger.over_quota(tenant, need)  # its own tenant's retained KV, then requests make room
            if (key := self.retained.reclaimable(req.tenant if own else None)) is not None:
                self.retained.end(*key)  # retained pages go before any running request
                continue
            if own and self.adapters is not None and (
                    idle := self.adapters.idle_owned(req.tenant, self.queues.running_adapters())):
                self.adapters.evict(idle)  # an idle adapter of its own goes before its requests
                continue
            candidates = [r for r in unscheduled if r.tenant == req.tenant] if own else unscheduled
            if over_share is None:
                over_share = ledger.over_share()
            victim = self._policy.pick_victim(candidates, now, req, over_share)
            unscheduled.remove(victim)
            self._preempt(victim, now)
            preempted += 1
            if victim is req:
                return False, preempted
        if self.kv.grow(req, n):
            req.num_pages_sent = -1  # its table changed in place: send it in full
        return True, preempted

    def _drop_outside_window(self, req: Request) -> None:
        dropped = self.kv.drop_outside_window(req)
        if not dropped:
            return
        req.dropped_pending += dropped
        if req.page_budget and not req.budget_hit:
            req.budget_hit = True
            self.limits.stats(req.tenant).budget_hits += 1

    def _preempt(self, req: Request, now: int) -> None:
        """Swap req out to the host tier or release its pages for recompute, whichever the policy prefers."""
        # (a fork parent under a plan in flight is recomputed: swapped, it would miss its fork)
        tier = self.kv.host_tier  # (None: no swap space)
        pages = None if tier is None or (req.n > 1 and req.in_flight) else tier.swap_out_cost(req)
        swap = self._policy.should_swap(pages, req.num_computed - shared_cached_tokens(self._pool, req))
        if swap:
            self.kv.swap_out(req)
            self.counters.swap_preemptions += 1
        else:
            self.kv.release(req)
            self.counters.recompute_preemptions += 1
        self.queues.preempt(req, swap, now)
        req.num_pages_sent = -1
        req.num_preemptions += 1
        self.counters.preemptions += 1

    # ---- results -------------------------------------------------------------------------------
    def process(self, sent: InFlight, result) -> Outputs:
        """Applies the executor's result (a StepResult) of the plan ``sent``; returns the messages of the requests that
        ended (each other token went straight to its stream). A request preempted while that plan was in flight
        (async scheduling) still gets its sample: it was drawn from what the request had confirmed."""
        self.kv.confirm(sent.ops)
        if sent.resending:  # only page operations ran: the requests of the rejected plan are still to go
            return []
        self.counters.computed_tokens += result.num_computed_tokens
        bs, publish, running = self._pool.block_size, self.kv.publish, Status.RUNNING
        for req, n, samples in sent.scheduled:
            req.uncount(n, samples)
            if req.status is running:
                confirmed = req.num_computed - req.num_inflight_tokens  # (req.num_confirmed)
                if confirmed >= (req.num_published + 1) * bs:  # a page filled up
                    publish(req)
                if req.n > 1 and confirmed == req.compute_target:
                    self._fork(req)

        def end(req: Request, outcome: TokenOutcome) -> Output:
            if outcome.budget_hit:
                self.limits.stats(req.tenant).budget_hits += 1
            return self.finish(req, outcome.finish, outcome.stop_reason, outcome.error)

        return self._outputs.take_samples(sent.rows, result, self.queues.waiting.charge, end)

    def _fork(self, parent: Request) -> None:
        """The parent computed all but the last prompt token: n children take over its pages."""
        children = forks(parent)
        for child in children:
            self.kv.fork(parent, child)
            child.aborted = parent.aborted  # cancelled while its last prefill chunk ran: reaped next step
        self.queues.fork(parent, children)
        self.kv.release(parent)

    def finish(self, req: Request, finish: Finish, stop_reason: str = "", error: str = "") -> Output:
        """Ends a request: pages back to the pool at once (those it asked to retain held on: retention.py), the
        executor told to forget it; its final message from the one door (``outputs.final``)."""
        was = self.queues.finish(req, finish)
        if req.retain is not None and not error:
            self.retained.keep(req, finish, self.limits.max_retained(req.tenant, self.config.kv_retention_max_share))
        if was in (Status.RUNNING, Status.SWAPPED):
            self.kv.release(req)
        return final(req, finish, stop_reason, error)

    def set_tenants(self, tenants: Tenants | None = None) -> Outputs:
        """New tenant settings (a reload; None: the ledger's, already replaced): live requests get their limits
        again; those that no longer fit their tenant (a quota lowered below what they hold or need, or below their
        page budget, or n above its concurrency limit) end with an error."""
        if tenants is not None:
            self.ledger.set_tenants(tenants)
        ended = []
        for req in self.live_requests():
            limits = self.fit_limits(req.tenant)
            req.max_len, req.page_limit = fit.bounds(req, limits)
            problem = fit.reload_misfit(req, limits, self.ledger.tenants.get(req.tenant))
            if problem and not req.aborted:
                ended.append((req, self.finish(req, Finish.ABORT, error=problem)))
        return ended

    # ---- reports -------------------------------------------------------------------------------
    def reset_peak(self, tenant: str, cluster: bool) -> None:
        """Peaks start again from what is held now: the tenant's, and with ``cluster`` the pool's."""
        self.limits.reset_peak(tenant)
        if cluster:
            self.counters.peak_used_pages = self._pool.num_used

    def snapshot(self, tenants: bool = False) -> SchedulerSnapshot:
        """The scheduler's state as frozen values; with ``tenants`` also per-tenant figures and the KV slots filled
        (these walk the requests)."""
        return snapshot_of(self._pool, self.kv, self.queues, self.limits, self.ledger, self.counters,
                           self.config.max_num_seqs, self._policy.costs.page_bytes, tenants,
                           self.retained.pages_by_tenant, self.config.kv_retention_max_share)

    def kv_expiry_due(self, now: float) -> bool:
        """A retention's TTL has elapsed: the next plan ends it (the cluster wakes an idle engine for it)."""
        due = self.retained.next_expiry()
        return due is not None and due <= now

    def check_integrity(self, unconfirmed: list[PageOps]) -> None:
        """Every page's refcount equals the tables (and pending swap-ins: ``unconfirmed``, the wire's) holding it, in
        both tiers; each request is where its status says. (The wire checks the in-flight counts.)"""
        self.kv.check_integrity(self.queues.running, self.queues.swapped, [*unconfirmed, self.kv.ops],
                                self.retained.checked_tables())
        self.queues.check_integrity()
