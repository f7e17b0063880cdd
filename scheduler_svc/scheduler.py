"""Continuous batching for one executor: which requests run this step, how many tokens each, which pages.

Each ``schedule`` call plans one step and hands it to the executor session (executor_session.py), which encodes
the StepPlan; ``process`` applies the executor's StepResult. Requests join and leave at every step; prefills
are cut into chunks so a step never computes more than ``max_num_batched_tokens`` tokens; pages are allocated
as tokens arrive and freed the moment a request ends. When pages run out a running request is preempted: the
victim, and whether it is swapped to the host tier or recomputed later, come from ``policy.py``. Swapped
requests come back after new prefills (TTFT first), unless one has waited ``swap_in_max_wait`` steps: then it
goes first.

Who does what around the loop: page accounting is ``kv_manager.py`` (over ``pages.py``); every tenant rule
(quota, reserves, seats, fair share, the fit rule) is ``tenant_limits.py`` over the scheduler-wide
``tenant_ledger.py``, and the victims that make room for a fair share are chosen in ``fair_share.py``; tokens
become text and finish reasons in ``outputs.py``; executor-lifecycle moves (evacuate, pool reset, tenant
reload) are in ``lifecycle.py``.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from pagedkv.executor.v1 import executor_pb2 as pb
from scheduler_svc import admission, fair_share, lifecycle, metrics
from scheduler_svc.executor_session import ExecutorSession
from scheduler_svc.fairness import WaitQueue
from scheduler_svc.kv_manager import KVManager, held
from scheduler_svc.outputs import OutputProcessor, TokenOutcome
from scheduler_svc.pages import PagePool
from scheduler_svc.policy import PreemptionConfig, PreemptionCosts, PreemptionPolicy
from scheduler_svc.request import Finish, Output, Request, Status, fork
from scheduler_svc.snapshot import Counters, SchedulerSnapshot
from scheduler_svc.tenancy import Tenants
from scheduler_svc.tenant_ledger import TenantLedger
from scheduler_svc.tenant_limits import TenantLimits, TenantStats


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    watermark: float = 0.01  # share of pages kept free when admitting new requests
    enable_prefix_caching: bool = True
    fairness: bool = True  # admission across tenants by weighted service (VTC); False: arrival order
    sliding_window: int = 0  # serve every request with attention over sink + the last N tokens (0: off)
    sink_tokens: int = 0
    model_window: int = 0  # the model's own window (Describe.model_sliding_window): every request's at most
    preemption: PreemptionConfig = field(default_factory=PreemptionConfig)


Outputs = list[tuple[Request, Output]]


class Scheduler:
    def __init__(self, pool: PagePool, config: SchedulerConfig, eos_token_ids: list[int],
                 host_pool: PagePool | None = None, costs: PreemptionCosts | None = None,
                 tenants: Tenants | None = None, ledger: TenantLedger | None = None) -> None:
        self.pool = pool
        self.config = config
        self.counters = Counters()
        self.kv = KVManager(pool, config.enable_prefix_caching, host_pool, self.counters)
        self.policy = PreemptionPolicy(config.preemption, costs or PreemptionCosts(page_bytes=0))
        self.session = ExecutorSession()
        self.outputs = OutputProcessor(set(eos_token_ids), pool.block_size)
        self.ledger = ledger if ledger is not None else TenantLedger(tenants)
        self.limits = TenantLimits(self.ledger, pool, config.max_model_len, config.max_num_batched_tokens,
                                   config.max_num_seqs)
        self.waiting = WaitQueue(config.fairness, lambda t: self.ledger.tenants.get(t).weight, self.ledger.service)
        self.running: list[Request] = []
        self.swapped: deque[Request] = deque()  # in swap-out order
        self.requests: dict[str, Request] = {}
        self.deferred_outputs: Outputs = []  # requests ended while planning
        self.step_id = 0
        self.watermark_pages = int(config.watermark * pool.num_pages)
        self.ledger.join(self)

    def join(self, ledger: TenantLedger) -> None:
        """Shares the scheduler-wide tenant ledger of a cluster (before any request arrives here)."""
        assert not self.requests, "join with live requests"
        self.ledger.leave(self)
        self.ledger = self.limits.ledger = ledger
        self.waiting.share(ledger.service)
        ledger.join(self)

    @property
    def host(self) -> PagePool | None:
        return self.kv.host

    @property
    def tenants(self) -> Tenants:
        return self.ledger.tenants

    def stats(self, tenant: str) -> TenantStats:
        return self.limits.stats(tenant)

    def tenant_capacity(self, tenant_id: str) -> int:
        return self.limits.capacity(tenant_id)

    def window_page_limit(self, tenant_id: str, sink: int, window: int) -> int:
        return self.limits.window_page_limit(tenant_id, sink, window)

    # ---- intake --------------------------------------------------------------------------------
    def add(self, req: Request, front: bool = False) -> None:
        """A new request, or (front) one migrated from another executor, which goes ahead of new work as a
        recompute-preempted one would."""
        t = req.tenant
        if req.admitted_at_step < 0:  # (a migrated request admitted elsewhere keeps that executor's figures)
            req.queued_at_step = self.step_id
        if self.config.fairness and not self.waiting.tenant_len(t) and not any(r.tenant == t for r in self.running):
            self.waiting.lift(t, self.ledger.active())  # no credit banked while idle
        self.limits.apply(req)
        problem = self.limits.fit_error(req)
        if problem:
            # (the API refuses these, and placement avoids executors too small for a migrated request; a
            # request that could never be admitted must not wait forever)
            self.requests[req.request_id] = req
            self.waiting.append(req)
            self.deferred_outputs.append((req, self.finish(req, Finish.ABORT, error=problem)))
            return
        if req.n > 1 and req.compute_target == 0:  # nothing to share: the forks start on their own
            for child in self._children(req):
                self.requests[child.request_id] = child
                self.waiting.append(child)
            return
        self.requests[req.request_id] = req
        if front:
            self.waiting.appendleft(req)
        else:
            self.waiting.append(req)

    def fits(self, req: Request) -> bool:
        """Whether this executor's pool can ever hold the request (what ``add`` would otherwise refuse)."""
        return not self.limits.fit_error(req)

    def prefix_hit_pages(self, req: Request) -> int:
        """Pages of the request's prompt this executor's prefix cache holds (placement; reads only)."""
        return len(self.kv.find_hits(req))

    def detach(self, req: Request) -> None:
        """Takes a live request away from this executor, to be placed on another (see lifecycle.detach)."""
        lifecycle.detach(self, req)

    def live_requests(self) -> list[Request]:
        """Every request on this executor (running, waiting or swapped), in no particular order."""
        return list(self.requests.values())

    def abort(self, group: str) -> None:
        """Marks a client request (all its forks); pages are freed when the next plan is built."""
        for req in self.requests.values():
            if req.group == group:
                req.aborted = True

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.swapped or self.session.has_work or self.deferred_outputs)

    # ---- planning ------------------------------------------------------------------------------
    def schedule(self) -> tuple[pb.StepPlan | None, Outputs]:
        """Returns the next plan (None if there is nothing to send) and outputs of reaped aborts."""
        outputs = self._reap_aborted()
        if self.deferred_outputs:
            outputs += self.deferred_outputs
            self.deferred_outputs = []
        if self.session.resend_ops is not None:
            self.step_id += 1
            return self.session.resend(self.step_id), outputs
        scheduled = self._plan()
        if not scheduled and not self.session.forget and not self.kv.ops:
            return None, outputs
        self.step_id += 1
        plan = self.session.encode(self.step_id, scheduled, self.kv.take_ops())
        self.counters.peak_used_pages = max(self.counters.peak_used_pages, self.pool.num_used)
        self.limits.record_peaks()
        return plan, outputs

    def _plan(self) -> list[tuple[Request, int]]:
        """The requests of the next step and the tokens each computes: the running ones first (growing,
        preempting others when pages are short), then admissions while the token budget lasts."""
        budget = self.config.max_num_batched_tokens
        scheduled: list[tuple[Request, int]] = []
        now = self.step_id + 1
        for victim in fair_share.victims_for_head(self):
            self._preempt(victim, now)  # (admission goes on this step)
            self.stats(victim.tenant).fair_share_preemptions += 1
        preempted = 0
        i = 0
        kv = self.kv
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if (req.num_pending and not self._plans_ahead(req)) or req.num_uncomputed <= 0:
                i += 1  # this step goes without it: its result comes first (a fork parent's: the fork)
                continue
            if kv.decodes_in_place(req):  # the steady decode: nothing to allocate, copy or drop
                scheduled.append((req, 1))
                budget -= 1
                i += 1
                continue
            n = kv.window_chunk_limit(req, min(req.num_uncomputed, budget))
            grown, victims = self._reserve(req, n, self.running[i:])
            preempted += victims
            if not grown:
                continue  # req itself was preempted; the list shrank
            scheduled.append((req, n))
            budget -= n
            i += 1
        if not preempted:
            admission.admit(self, budget, scheduled)
        elif self.tenants.total_reserved:  # pages are short, but reserved pages are there for their tenants
            admission.admit(self, budget, scheduled, only_reserved=True)
        return scheduled

    def _plans_ahead(self, req: Request) -> bool:
        """Whether a request whose sample is still in flight (async scheduling) goes on in this plan as if that
        sample did not end it. Not when the sample ends it by length (max_tokens, max_len, a 'stop' page budget:
        known now), nor when its table would have to go in full (a copy-on-write, a resend: the executor's copy
        of its tokens holds the sample, the scheduler's not yet). A stop token or stop string is known only from
        the result: then the token computed ahead is discarded."""
        if req.num_pages_sent < 0 or self.kv.writes_shared_page(req):
            return False
        pending = req.num_pending
        return self.outputs.length_end(req, req.num_tokens + pending, len(req.output_ids) + pending) is None

    def _reserve(self, req: Request, n: int, unscheduled: list[Request]) -> tuple[bool, int]:
        """Makes req's table cover num_computed + n tokens, preempting unscheduled requests (or req); returns
        (whether req got them, how many were preempted)."""
        now = self.step_id + 1
        self.drop_outside_window(req)
        over_share: set[str] | None = None
        tenant = self.limits.get(req.tenant)
        preempted = 0
        while not self.limits.can_take(req.tenant, need := self.kv.pages_to_grow(req, n)):
            if self.limits.over_quota(tenant, need):  # its own tenant's requests make room
                candidates = [r for r in unscheduled if r.tenant == req.tenant]
            else:
                candidates = unscheduled
            if over_share is None:
                over_share = self.limits.over_share()
            victim = self.policy.pick_victim(candidates, now, req, over_share)
            unscheduled.remove(victim)
            self._preempt(victim, now)
            preempted += 1
            if victim is req:
                return False, preempted
        if self.kv.grow(req, n):
            req.num_pages_sent = -1  # its table changed in place: send it in full
        return True, preempted

    def drop_outside_window(self, req: Request) -> None:
        dropped = self.kv.drop_outside_window(req)
        if not dropped:
            return
        req.dropped_pending += dropped
        if req.page_budget and not req.budget_hit:
            req.budget_hit = True
            self.stats(req.tenant).budget_hits += 1

    def _preempt(self, req: Request, now: int) -> None:
        """Swap req out to the host tier or release its pages for recompute, whichever the policy prefers."""
        self.running.remove(req)
        # (a fork parent under a plan in flight is recomputed: swapped, it would miss its fork)
        pages = None if req.n > 1 and req.in_flight else self.kv.swap_out_cost(req)
        if self.policy.should_swap(pages, req.num_computed - self.kv.shared_cached_tokens(req)):
            self.kv.swap_out(req)
            req.status = Status.SWAPPED
            req.swapped_at = now
            self.swapped.append(req)
            self.counters.swap_preemptions += 1
        else:
            self.kv.release(req)
            req.status = Status.WAITING
            self.waiting.appendleft(req)
            self.counters.recompute_preemptions += 1
        req.num_pages_sent = -1
        req.num_preemptions += 1
        self.session.forget.append(req.request_id)
        self.counters.preemptions += 1

    # ---- results -------------------------------------------------------------------------------
    def malformed(self, result: pb.StepResult, vocab_size: int = 0) -> str:
        """Why ``result`` cannot answer the oldest plan in flight (its samples name rows the plan lacks, or tokens
        outside the vocabulary), or ''."""
        return self.session.malformed(result, vocab_size)

    def process(self, result: pb.StepResult) -> Outputs:
        """Applies the result of the oldest plan in flight. A request preempted while that plan was in flight
        (async scheduling) still gets its sample: it was drawn from what the request had confirmed. A token that
        does not end its request goes straight to the request's stream (``Outbox.token``); the messages returned
        (for ``outputs.deliver``) are those of requests that ended."""
        if result.error:
            ended = self.session.rejected(result.error, set(result.desynced_request_ids))
            return [(req, self.finish(req, Finish.ABORT, error=f"executor rejected plan: {result.error}"))
                    for req in ended]
        sent = self.session.accepted()
        self.kv.confirm(sent.ops)
        if sent.resending:  # only page operations ran: the requests of the rejected plan are still to go
            return []
        self.counters.computed_tokens += result.num_computed_tokens
        bs, publish, running = self.pool.block_size, self.kv.publish, Status.RUNNING
        for req, n, samples in sent.scheduled:
            req.num_inflight_tokens -= n
            if samples:
                req.num_pending -= 1
            if req.status is running:
                confirmed = req.num_computed - req.num_inflight_tokens  # (req.num_confirmed)
                if confirmed >= (req.num_published + 1) * bs:  # a page filled up
                    publish(req)
                if req.n > 1 and confirmed == req.compute_target:
                    self._fork(req)
        outputs = []
        rows, on_token, charge = sent.rows, self.outputs.on_token, self.waiting.charge
        finished = Status.FINISHED
        charged: dict[str, int] = {}  # output tokens per tenant, charged once (before a finish: it may idle the tenant)
        streamed = 0
        for row, token, logprob in zip(result.sampled_rows, result.sampled_token_ids, result.sampled_logprobs):
            req = rows[row]  # (rows checked by malformed())
            if req.status is finished or req.aborted or req.n > 1:  # (ended, or forked: a parent's sample is unused)
                continue
            tenant = req.tenant
            charged[tenant] = charged.get(tenant, 0) + 1
            outcome = on_token(req, token)
            if outcome.__class__ is str:  # it goes on: its token and the text to stream, straight to its stream
                req.queue.token(req.index, outcome, token, logprob if req.sampling.logprobs else None)
                streamed += 1
            else:
                charge(tenant, output_tokens=charged.pop(tenant))
                outputs.append((req, self._ended_by_token(req, token, logprob, outcome)))
        for tenant, k in charged.items():
            charge(tenant, output_tokens=k)
        if streamed:
            metrics.GENERATED_TOKENS.inc(streamed)
        return outputs

    def _ended_by_token(self, req: Request, token: int, logprob: float, outcome: TokenOutcome) -> Output:
        if outcome.budget_hit:
            self.stats(req.tenant).budget_hits += 1
        out = self.finish(req, outcome.finish, outcome.stop_reason)
        out.token_ids, out.logprobs = [token], ([logprob] if req.sampling.logprobs else [])
        return out

    def _children(self, parent: Request) -> list[Request]:
        """Fork i samples with seed + i (request.fork)."""
        return [fork(parent, i, parent.detokenizer.fresh()) for i in range(parent.n)]

    def _fork(self, parent: Request) -> None:
        """The parent computed all but the last prompt token: n children take over its pages."""
        at = self.running.index(parent)
        children = self._children(parent)
        for child in children:
            self.kv.fork(parent, child)
            child.status = Status.RUNNING
            child.aborted = parent.aborted  # cancelled while its last prefill chunk ran: reaped next step
            self.requests[child.request_id] = child
        self.running[at:at + 1] = children
        self.kv.release(parent)
        parent.status = Status.FINISHED
        self.requests.pop(parent.request_id, None)
        self.session.forget.append(parent.request_id)

    def finish(self, req: Request, finish: Finish, stop_reason: str = "", error: str = "") -> Output:
        """Ends a request: pages back to the pool at once, the executor told to forget it."""
        if req.status is Status.RUNNING:
            self.running.remove(req)
            self.kv.release(req)
            self.session.forget.append(req.request_id)
        elif req.status is Status.SWAPPED:  # the executor forgot it when it was swapped out
            self.swapped.remove(req)
            self.kv.release(req)
        elif req.status is Status.WAITING:
            self.waiting.remove(req)
            if req.num_pages_sent >= 0:
                self.session.forget.append(req.request_id)
        req.status = Status.FINISHED
        req.finish = finish
        self.requests.pop(req.request_id, None)
        if self.config.fairness and not self.ledger.has_requests(req.tenant):
            self.waiting.went_idle(req.tenant)
        return self.outputs.final(req, finish, stop_reason, error)

    def _reap_aborted(self) -> Outputs:
        return [(r, self.finish(r, Finish.ABORT)) for r in list(self.requests.values()) if r.aborted]

    # ---- the executor's lifecycle and reports (lifecycle.py) -------------------------------------
    def fail_all(self, error: str) -> Outputs:
        return lifecycle.fail_all(self, error)

    def evacuate(self, keep_cache: bool = False) -> tuple[list[Request], Outputs]:
        return lifecycle.evacuate(self, keep_cache)

    def forget_cached_pages(self) -> None:
        self.kv.forget_cached()

    def drained(self) -> None:
        lifecycle.drained(self)

    def reset_pool(self, num_pages: int, block_size: int, num_host_pages: int = 0,
                   costs: PreemptionCosts | None = None) -> None:
        lifecycle.reset_pool(self, num_pages, block_size, num_host_pages, costs)

    def set_tenants(self, tenants: Tenants | None = None) -> Outputs:
        return lifecycle.set_tenants(self, tenants)

    def set_costs(self, costs: PreemptionCosts) -> None:
        """A (re)connected executor measured its copy bandwidth and prefill cost again."""
        self.policy = PreemptionPolicy(self.config.preemption, costs)

    def reset_peak(self, tenant: str, cluster: bool) -> None:
        """Peaks start again from what is held now: the tenant's, and with ``cluster`` the pool's."""
        self.stats(tenant).peak_used_pages = self.pool.used_by[tenant]
        if cluster:
            self.counters.peak_used_pages = self.pool.num_used

    def snapshot(self, tenants: bool = False) -> SchedulerSnapshot:
        return lifecycle.snapshot(self, tenants)

    def kv_slots_filled(self) -> int:
        return self.kv.slots_filled(self.running)

    def check_integrity(self) -> None:
        lifecycle.check_integrity(self)

    def pending_ops(self):
        """Page operations not yet confirmed by the executor: sent, to be resent, or still to send."""
        return [*self.session.unconfirmed_ops(), self.kv.ops]

    def held_tables(self):
        return (list(held(r.page_table)) for r in self.running)
