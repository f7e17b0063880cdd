"""Continuous batching: which requests run this step, how many tokens each, which pages they get.

Each call of ``schedule`` builds one StepPlan; ``process`` applies the executor's StepResult.
Requests join and leave at every step; prefills are cut into chunks so a step never computes more
than ``max_num_batched_tokens`` tokens; pages are allocated as tokens arrive and freed the moment a
request ends. When pages run out a running request is preempted: the victim and whether it is swapped to
the host tier or recomputed later come from ``scheduler_svc.policy``. Swapped requests come back after new
prefills (TTFT first), unless one has waited ``swap_in_max_wait`` steps: then it goes first.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, replace

from pagedkv.executor.v1 import executor_pb2 as pb
from scheduler_svc.fairness import WaitQueue
from scheduler_svc.kv_manager import DROPPED, KVManager, PageOps, held
from scheduler_svc.pages import PagePool
from scheduler_svc.policy import Costs, PreemptionConfig, PreemptionPolicy
from scheduler_svc.request import Finish, Output, Request, Status
from scheduler_svc.tenancy import Tenant, Tenants

MAX_PLAN_RETRIES = 3


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
    preemption: PreemptionConfig = field(default_factory=PreemptionConfig)


@dataclass(slots=True)
class TenantStats:
    peak_used_pages: int = 0
    budget_hits: int = 0  # requests that reached their page budget
    fair_share_preemptions: int = 0  # of this tenant's requests, to give another tenant its share
    admitted: int = 0


@dataclass(slots=True)
class StepStats:
    preempted: int = 0
    swapped_in: int = 0
    admitted: int = 0
    tokens: int = 0


class PlanLoopError(RuntimeError):
    """The executor keeps rejecting page operations: its state cannot be trusted any more."""


class Scheduler:
    def __init__(self, pool: PagePool, config: SchedulerConfig, eos_token_ids: list[int],
                 host_pool: PagePool | None = None, costs: Costs | None = None,
                 tenants: Tenants | None = None) -> None:
        self.pool = pool
        self.config = config
        self.tenants = tenants if tenants is not None else Tenants()
        self.kv = KVManager(pool, config.enable_prefix_caching, host_pool)
        self.policy = PreemptionPolicy(config.preemption, costs or Costs(page_bytes=0))
        self.inflight_ops = PageOps()  # page operations of the plan in flight
        self.resend_ops: PageOps | None = None  # those of a rejected plan: sent again, alone, first
        self.resending = False  # the plan in flight is a resend of page operations
        self.ops_failures = 0  # consecutive rejections of such resends
        self.peak_used_pages = 0
        self.num_computed_tokens = 0
        self.eos = set(eos_token_ids)
        self.waiting = WaitQueue(config.fairness, lambda t: self.tenants.get(t).weight)
        self.tenant_stats: dict[str, TenantStats] = {}
        self.deferred_outputs: list[tuple[Request, Output]] = []  # requests ended while planning
        self.running: list[Request] = []
        self.swapped: deque[Request] = deque()  # in swap-out order
        self.requests: dict[str, Request] = {}
        self.to_forget: list[str] = []
        self.inflight: list[tuple[Request, int]] = []
        self.step_id = 0
        self.plan_failures = 0
        self.watermark_pages = int(config.watermark * pool.num_pages)
        self.num_preemptions = 0
        self.num_swap_preemptions = 0
        self.num_recompute_preemptions = 0

    @property
    def host(self) -> PagePool | None:
        return self.kv.host

    # ---- tenants -------------------------------------------------------------------------------
    def stats(self, tenant: str) -> TenantStats:
        st = self.tenant_stats.get(tenant)
        if st is None:
            st = self.tenant_stats[tenant] = TenantStats()
        return st

    def _reserved_for_others(self, tenant: str) -> int:
        """Free pages other tenants' reserved minimums still claim."""
        if not self.tenants.total_reserved:
            return 0
        used = self.pool.used_by
        return sum(max(0, t.reserved_pages - used[t.id]) for t in self.tenants if t.id != tenant)

    def tenant_capacity(self, tenant_id: str) -> int:
        """The most pages one request of the tenant can ever get: its quota, less every other tenant's
        reserved minimum."""
        t = self.tenants.get(tenant_id)
        others = self.tenants.total_reserved - (t.reserved_pages if t.id in self.tenants.by_id else 0)
        return min(t.page_quota or self.pool.num_pages, self.pool.num_pages - others)

    def max_len_for(self, req: Request) -> int:
        """Longest prompt + output the request can reach: max_model_len, lower when its tenant's capacity
        holds fewer tokens (a request with a window holds a bounded number of pages at any length)."""
        if req.window_tokens:
            return self.config.max_model_len
        return min(self.config.max_model_len, self.tenant_capacity(req.tenant) * self.pool.block_size)

    def window_page_limit(self, tenant_id: str, sink: int, window: int) -> int:
        """Pages a windowed request without a budget may hold: its sink and window, plus a prefill chunk,
        within its tenant's capacity (0: the window alone does not fit)."""
        bs = self.pool.block_size
        least = -(-sink // bs) + -(-window // bs) + 2
        capacity = self.tenant_capacity(tenant_id)
        if least > capacity:
            return 0
        return min(capacity, least + -(-self.config.max_num_batched_tokens // bs))

    def _over_quota(self, tenant: Tenant, need: int) -> bool:
        return bool(tenant.page_quota) and self.pool.used_by[tenant.id] + need > tenant.page_quota

    def _can_take(self, tenant_id: str, need: int, slack: int = 0) -> bool:
        """need more pages for the tenant: within its quota, leaving other tenants' reserved minimums free."""
        if self._over_quota(self.tenants.get(tenant_id), need):
            return False
        return self.pool.can_allocate(need + slack + self._reserved_for_others(tenant_id))

    def fair_shares(self) -> dict[str, float]:
        """Pages each active tenant (running, waiting or swapped requests) is entitled to under pressure:
        the pool split by weight, at least its reserved minimum, at most its quota."""
        active = {r.tenant for r in self.running} | {t for t, q in self.waiting.queues.items() if q} | {
            r.tenant for r in self.swapped}
        if not active:
            return {}
        weights = {t: self.tenants.get(t).weight for t in active}
        total = sum(weights.values())
        shares = {}
        for t in active:
            ten = self.tenants.get(t)
            share = max(ten.reserved_pages, self.pool.num_pages * weights[t] / total)
            shares[t] = min(share, ten.page_quota) if ten.page_quota else share
        return shares

    def _over_share(self) -> set[str]:
        return {t for t, share in self.fair_shares().items() if self.pool.used_by[t] > share}

    def _make_room_for_fair_share(self, stats: StepStats) -> None:
        """The request fairness would admit next cannot get a seat (max_num_seqs) or pages, and its tenant
        holds less than its fair share of them: tenants above theirs give one back (preemption) until it fits.
        The victims are chosen first, on paper, and preempted only if together they make the room: a
        preemption that leaves the request still unable to start frees nothing for it, and its victims would
        come straight back (a livelock the page-accounting state machine found)."""
        if not self.config.fairness or not self.tenants.multi or not self.waiting:
            return
        req = self.waiting.head()
        if req is None:
            return
        hits = self.kv.find_hits(req)
        if self.kv.waits_for_inflight(req, len(hits)):
            return
        tenant = self.tenants.get(req.tenant)
        limit = tenant.max_concurrent_requests
        if limit and self._seats_of(req.tenant) + req.n > limit:
            return  # its own limit holds it back: taking from others would not help
        hits, n = self._first_chunk(req, hits, self.config.max_num_batched_tokens)
        need = self.kv.pages_to_admit(hits, n)
        if self._over_quota(tenant, need):
            return
        now = self.step_id + 1
        victims = self._seat_victims(req, now)
        if victims is not None:
            victims = self._page_victims(req, need, victims, now)
        for victim in victims or ():
            self._preempt(victim, now)  # (not counted in stats.preempted: admission goes on this step)
            self.stats(victim.tenant).fair_share_preemptions += 1

    def _page_victims(self, req: Request, need: int, victims: list[Request], now: int) -> list[Request] | None:
        """victims (those giving up a seat) plus the requests of tenants above their fair share of pages that
        must give theirs back for req to start, while its tenant holds less than its share; None when even
        that would not make room."""
        shares = self.fair_shares()
        used = self.pool.used_by.copy()
        free = self.pool.num_free
        holders: dict[int, int] = {}

        def give_back(victim: Request) -> None:
            nonlocal free
            for p in held(victim.page_table):
                holders[p] = holders.get(p, 0) + 1
                if holders[p] == self.pool.refcount(p):  # (pages other requests hold stay used)
                    free += 1
                    used[self.pool.owner[p]] -= 1

        def fits() -> bool:
            slack = self.watermark_pages if len(self.running) > len(victims) else 0
            reserved = sum(max(0, t.reserved_pages - used[t.id]) for t in self.tenants if t.id != req.tenant)
            # NOTE: the running requests that stay are scheduled (and grow) before anything is admitted: room
            # they would take is no room for req (another livelock the state machine found).
            tokens = self.config.max_num_batched_tokens
            growth = sum(self.kv.pages_to_grow(r, self.kv.window_chunk_limit(r, min(r.num_uncomputed, tokens)))
                         for r in self.running if r not in victims)
            return need + slack + reserved + growth <= free

        for victim in victims:
            give_back(victim)
        if fits():
            return victims
        if self.pool.used_by[req.tenant] >= shares.get(req.tenant, 0):
            return None
        while not fits():
            over = {t for t, share in shares.items() if t != req.tenant and used[t] > share}
            victim = self._next_fair_share_victim(req, over, victims, now)
            if victim is None:
                return None
            victims.append(victim)
            give_back(victim)
        return victims

    def _next_fair_share_victim(self, req: Request, over: set[str], victims: list[Request],
                                now: int) -> Request | None:
        """The next running request of a tenant in ``over`` to preempt for req (None: no candidate): not one
        already chosen, nor one fair order would bring straight back ahead of req."""
        candidates = [r for r in self.running
                      if r.tenant in over and r not in victims and not self._requeued_first(r, req)]
        return self.policy.pick_victim(candidates, now) if candidates else None

    def _requeued_first(self, victim: Request, req: Request) -> bool:
        """Whether fair order would admit victim, preempted and back at the front of its tenant's queue, before
        req. Taking its seat or pages for req would only bring it straight back, step after step (a livelock
        the page-accounting state machine found: a recompute victim re-admitted from its cached prefix each
        step, its last prompt token never computed)."""
        q = self.waiting
        service = q.service(victim.tenant)
        if not q.tenant_len(victim.tenant):  # it would return from idle: lifted to the least backlogged service
            others = [q.service(t) for t, w in q.queues.items() if w and t != victim.tenant]
            if others:
                service = max(service, min(others))
        return (service, victim.arrival) <= (q.service(req.tenant), req.arrival)

    def _seats_of(self, tenant: str) -> int:
        return sum(r.n for r in self.running if r.tenant == tenant)

    def _first_chunk(self, req: Request, hits: list, budget: int) -> tuple[list, int]:
        """The cache hits a request admitted now uses and the tokens its first step computes: with a page
        budget (or a window's page limit) at most limit - 1 pages come from the cache, the rest fit it."""
        limit = req.page_budget or req.page_limit
        if limit:
            hits = hits[: limit - 1]
        n = min(req.compute_target - len(hits) * self.pool.block_size, budget)
        if limit:
            n = min(n, (limit - len(hits)) * self.pool.block_size)
        return hits, n

    def _seat_victims(self, req: Request, now: int) -> list[Request] | None:
        """Requests of tenants above their share of seats (max_num_seqs, split by weight) that must give theirs
        up for req to start: [] when a seat is free, None when none can be made for it."""
        seats: dict[str, int] = {}
        for r in self.running:
            seats[r.tenant] = seats.get(r.tenant, 0) + r.n
        limit = self.config.max_num_seqs
        if sum(seats.values()) + req.n <= limit:
            return []
        active = set(seats) | {req.tenant}
        total = sum(self.tenants.get(t).weight for t in active)
        share = {t: limit * self.tenants.get(t).weight / total for t in active}
        if seats.get(req.tenant, 0) + req.n > share[req.tenant]:
            return None  # its tenant already has its share of seats
        victims: list[Request] = []
        while sum(seats.values()) + req.n > limit:
            over = {t for t in seats if t != req.tenant and seats[t] > share[t]}
            victim = self._next_fair_share_victim(req, over, victims, now)
            if victim is None:
                return None
            victims.append(victim)
            seats[victim.tenant] -= victim.n
        return victims

    # ---- intake --------------------------------------------------------------------------------
    def add(self, req: Request, front: bool = False) -> None:
        """A new request, or (front) one migrated from another executor, which goes ahead of new work as a
        recompute-preempted one would."""
        t = req.tenant
        if self.config.fairness and not self.waiting.tenant_len(t) and not any(r.tenant == t for r in self.running):
            active = {r.tenant for r in self.running} | {u for u, q in self.waiting.queues.items() if q}
            self.waiting.lift(t, active)  # no credit banked while idle
        req.max_len = self.max_len_for(req)
        if req.window_tokens and not req.page_budget:
            req.page_limit = self.window_page_limit(req.tenant, req.sink_tokens, req.window_tokens)
        if req.num_tokens >= req.max_len or (req.window_tokens and not req.page_budget and not req.page_limit):
            # (the API refuses these, and placement avoids executors too small for a migrated request; a
            # request that could never be admitted must not wait forever)
            self.requests[req.request_id] = req
            self.waiting.append(req)
            self.deferred_outputs.append((req, self.finish(
                req, Finish.ABORT, error=f"{req.num_tokens} tokens (prompt and output so far) do not fit what tenant "
                f"{req.tenant} can hold ({self.tenant_capacity(req.tenant)} pages)")))
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
        if req.n > self.config.max_num_seqs:
            return False
        if req.window_tokens and not req.page_budget:
            return self.window_page_limit(req.tenant, req.sink_tokens, req.window_tokens) > 0
        return req.num_tokens < self.max_len_for(req)

    def detach(self, req: Request) -> None:
        """Takes a live request away from this executor, to be placed on another: its pages here are freed
        (both tiers; its KV is recomputed there, prompt and the tokens streamed so far), and the executor is
        told to forget it. Only between steps (never while a plan holding it is in flight)."""
        if req.status is Status.RUNNING:
            self.running.remove(req)
            self.to_forget.append(req.request_id)
        elif req.status is Status.SWAPPED:
            self.swapped.remove(req)
        else:
            self.waiting.remove(req)
            if req.num_pages_sent >= 0:
                self.to_forget.append(req.request_id)
        self.kv.release(req)
        self.requests.pop(req.request_id, None)
        req.status = Status.WAITING
        req.num_pages_sent = -1
        req.dropped_pending = []
        req.num_migrations += 1
        if self.config.fairness and not any(r.tenant == req.tenant for r in self.requests.values()):
            self.waiting.went_idle(req.tenant)

    def abort(self, group: str) -> None:
        """Marks a client request (all its forks); pages are freed when the next plan is built."""
        for req in self.requests.values():
            if req.group == group:
                req.aborted = True

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.swapped or self.to_forget or self.resend_ops
                    or self.deferred_outputs)

    # ---- planning ------------------------------------------------------------------------------
    def schedule(self) -> tuple[pb.StepPlan | None, list[tuple[Request, Output]]]:
        """Returns the next plan (None if there is nothing to send) and outputs of reaped aborts."""
        outputs = self._reap_aborted()
        if self.deferred_outputs:
            outputs += self.deferred_outputs
            self.deferred_outputs = []
        if self.resend_ops is not None:
            return self._resend_plan(), outputs
        budget = self.config.max_num_batched_tokens
        scheduled: list[tuple[Request, int]] = []
        stats = StepStats()
        self._make_room_for_fair_share(stats)
        i = 0
        bs, refcounts = self.pool.block_size, self.pool.refcounts
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            # Fast path, the steady decode: one token into the request's own last page (not shared, not
            # full), no window. Nothing to allocate, copy or drop, so nothing _reserve could refuse.
            computed = req.num_computed
            if (computed % bs and not req.window_tokens and req.compute_target - computed == 1
                    and refcounts[req.page_table[computed // bs]] == 1):
                scheduled.append((req, 1))
                budget -= 1
                i += 1
                continue
            n = self.kv.window_chunk_limit(req, min(req.num_uncomputed, budget))
            if not self._reserve(req, n, self.running[i:], stats):
                continue  # req itself was preempted; the list shrank
            scheduled.append((req, n))
            budget -= n
            i += 1
        if not stats.preempted:
            budget = self._admit(budget, scheduled, stats)
        elif self.tenants.total_reserved:  # pages are short, but reserved pages are there for their tenants
            budget = self._admit(budget, scheduled, stats, only_reserved=True)
        if not scheduled and not self.to_forget and not self.kv.ops:
            return None, outputs
        self.step_id += 1
        plan = pb.StepPlan(step_id=self.step_id, forget=self.to_forget)
        self.to_forget = []
        self.inflight_ops = self.kv.take_ops()
        self._add_ops(plan, self.inflight_ops)
        self.resending = False
        decodes = []
        for req, n in scheduled:
            if n == 1 and req.num_pages_sent == len(req.page_table) and not req.dropped_pending:
                decodes.append(req.request_id)
                req.last_scheduled = plan.step_id
            else:
                self._add_to_plan(plan, req, n)
        plan.decodes.extend(decodes)
        self.inflight = scheduled
        self.peak_used_pages = max(self.peak_used_pages, self.pool.num_used)
        for tenant, used in self.pool.used_by.items():
            st = self.stats(tenant)
            st.peak_used_pages = max(st.peak_used_pages, used)
        return plan, outputs

    @staticmethod
    def _add_ops(plan: pb.StepPlan, ops: PageOps) -> None:
        # Copies run after swap-ins: a copy source overwritten by a swap-in of the same plan would be read
        # too late. Today no page is freed and handed out again within a plan after a copy was planned from
        # it (sources stay referenced); this keeps it that way.
        if ops.copy and ops.swap_in:
            assert not {d for _, d in ops.swap_in} & {s for s, _ in ops.copy}, "swap-in over a copy source"
        for src, dst in ops.swap_out:
            plan.page_ops.swap_out.add(src=src, dst=dst)
        for src, dst in ops.swap_in:
            plan.page_ops.swap_in.add(src=src, dst=dst)
        for src, dst in ops.copy:
            plan.page_ops.copy.add(src=src, dst=dst)

    def _resend_plan(self) -> pb.StepPlan:
        """The page operations of a rejected plan, alone, before anything planned later (whose operations
        may depend on them running first)."""
        self.step_id += 1
        plan = pb.StepPlan(step_id=self.step_id, forget=self.to_forget)
        self.to_forget = []
        self.inflight_ops, self.resend_ops = self.resend_ops, None
        self._add_ops(plan, self.inflight_ops)
        self.resending = True
        return plan

    def _reserve(self, req: Request, n: int, unscheduled: list[Request], stats: StepStats) -> bool:
        """Makes req's table cover num_computed + n tokens, preempting unscheduled requests (or req)."""
        now = self.step_id + 1
        self._drop_outside_window(req)
        over_share: set[str] | None = None
        tenant = self.tenants.get(req.tenant)
        while not self._can_take(req.tenant, need := self.kv.pages_to_grow(req, n)):
            if self._over_quota(tenant, need):  # its own tenant's requests make room
                candidates = [r for r in unscheduled if r.tenant == req.tenant]
            else:
                candidates = unscheduled
            if over_share is None:
                over_share = self._over_share()
            victim = self.policy.pick_victim(candidates, now, req, over_share)
            unscheduled.remove(victim)
            self._preempt(victim, now)
            stats.preempted += 1
            if victim is req:
                return False
        if self.kv.grow(req, n):
            req.num_pages_sent = -1  # its table changed in place: send it in full
        return True

    def _drop_outside_window(self, req: Request) -> None:
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
        pages = self.kv.swap_out_cost(req)
        if self.policy.should_swap(pages, req.num_computed - self.kv.shared_cached_tokens(req)):
            self.kv.swap_out(req)
            req.status = Status.SWAPPED
            req.swapped_at = now
            self.swapped.append(req)
            self.num_swap_preemptions += 1
        else:
            self.kv.release(req)
            req.status = Status.WAITING
            self.waiting.appendleft(req)
            self.num_recompute_preemptions += 1
        req.num_pages_sent = -1
        req.num_preemptions += 1
        self.to_forget.append(req.request_id)
        self.num_preemptions += 1

    def _swap_in(self, req: Request, budget: int, seats: int, scheduled: list[tuple[Request, int]]) -> int | None:
        """Brings a swapped request back if it fits; returns the tokens it takes, 0 when the pool or the
        seats are short (wait), None when its own tenant's limits hold it back (others may go)."""
        if seats + req.n > self.config.max_num_seqs:
            return 0
        limit = self.tenants.get(req.tenant).max_concurrent_requests
        if limit and self._seats_of(req.tenant) + req.n > limit:
            return None
        self._drop_outside_window(req)  # host pages outside the window are not worth copying back
        n = self.kv.window_chunk_limit(req, min(req.num_uncomputed, budget))
        need = self.kv.pages_to_swap_in(req, n)
        if need > self.tenant_capacity(req.tenant):  # it can never come back (e.g. a quota lowered by reload)
            self.deferred_outputs.append((req, self.finish(
                req, Finish.ABORT, error=f"request needs {need} pages; tenant {req.tenant} can hold at most "
                f"{self.tenant_capacity(req.tenant)}")))
            return None
        if not self._can_take(req.tenant, need, self.watermark_pages if self.running else 0):
            return None if self._over_quota(self.tenants.get(req.tenant), need) else 0
        self.swapped.remove(req)
        self.kv.swap_in(req, n)
        req.status = Status.RUNNING
        self.running.append(req)
        scheduled.append((req, n))
        return n

    def _admit(self, budget: int, scheduled: list[tuple[Request, int]], stats: StepStats,
               only_reserved: bool = False) -> int:
        """Swapped requests that waited too long first (nothing else is admitted until they fit); then new
        and recompute-preempted requests in fair order (one whose shared prefix another request is computing
        waits); then the other swapped requests, in swap-out order. only_reserved: just new requests of
        tenants below their reserved minimum (a step that preempted admits nothing else)."""
        if not self.waiting and not self.swapped:
            return budget
        if only_reserved:
            used = self.pool.used_by
            skip = {t for t in self.waiting.queues if used[t] >= self.tenants.get(t).reserved_pages}
            return self._admit_waiting(budget, scheduled, stats, sum(r.n for r in self.running), skip)[0]
        seats = sum(r.n for r in self.running)  # a parent that has not forked yet holds n seats
        now = self.step_id + 1
        wait = self.policy.config.swap_in_max_wait
        for req in [r for r in self.swapped if now - r.swapped_at >= wait]:
            if budget <= 0:
                break
            n = self._swap_in(req, budget, seats, scheduled)
            if n == 0:
                return budget  # an overdue request waits for room: nothing else goes ahead of it
            if n is not None:
                seats += req.n
                budget -= n
                stats.swapped_in += 1
        budget, seats, blocked = self._admit_waiting(budget, scheduled, stats, seats, set())
        for req in list(self.swapped):
            if blocked or budget <= 0:
                break
            n = self._swap_in(req, budget, seats, scheduled)
            if n == 0:
                break
            if n is not None:
                seats += req.n
                budget -= n
                stats.swapped_in += 1
        return budget

    def _admit_waiting(self, budget: int, scheduled: list[tuple[Request, int]], stats: StepStats, seats: int,
                       skip_tenants: set[str]) -> tuple[int, int, bool]:
        """New and recompute-preempted requests in fair order; returns (budget, seats, blocked). Tenants in
        skip_tenants (and those reaching their quota or concurrency limit) are passed over."""
        skip: set[int] = set()  # requests waiting for another's in-flight prefix pages
        running_by_tenant: dict[str, int] = {}
        for r in self.running:
            running_by_tenant[r.tenant] = running_by_tenant.get(r.tenant, 0) + r.n
        blocked = False
        while budget > 0:
            req = self.waiting.head(skip, skip_tenants)
            if req is None:
                break
            if seats + req.n > self.config.max_num_seqs:
                blocked = True
                break
            tenant = self.tenants.get(req.tenant)
            limit = tenant.max_concurrent_requests
            if limit and running_by_tenant.get(req.tenant, 0) + req.n > limit:
                skip_tenants.add(req.tenant)
                continue
            hits = self.kv.find_hits(req)
            if self.kv.waits_for_inflight(req, len(hits)):
                skip.add(id(req))
                continue
            hits, n = self._first_chunk(req, hits, budget)
            need = self.kv.pages_to_admit(hits, n)
            slack = self.watermark_pages if self.running else 0
            if not self._can_take(req.tenant, need, slack):
                if self._over_quota(tenant, need) or self.pool.can_allocate(need + slack):
                    skip_tenants.add(req.tenant)  # its quota, or other tenants' reserves: others may go
                    continue
                blocked = True
                break
            self.waiting.pop(req)
            self.kv.admit(req, hits, n)
            if req.num_preemptions == 0:  # weighted service: the prompt tokens it will compute
                self.waiting.charge(req.tenant, prompt_tokens=req.compute_target - len(hits) * self.pool.block_size)
                self.stats(req.tenant).admitted += 1
            req.status = Status.RUNNING
            self.running.append(req)
            running_by_tenant[req.tenant] = running_by_tenant.get(req.tenant, 0) + req.n
            seats += req.n
            scheduled.append((req, n))
            budget -= n
            stats.admitted += 1
        return budget, seats, blocked

    def _add_to_plan(self, plan: pb.StepPlan, req: Request, n: int) -> None:
        if req.num_pages_sent < 0:
            s = req.sampling
            plan.new_requests.add(
                request_id=req.request_id, token_ids=req.all_token_ids[: req.compute_target],
                num_computed_tokens=req.num_computed, num_scheduled_tokens=n, page_ids=req.page_table,
                sampling=pb.SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                                           seed=s.seed, logprobs=s.logprobs),
                num_output_tokens=len(req.output_ids), sink_tokens=req.sink_tokens,
                window_tokens=req.window_tokens,
            )
        else:
            plan.continuing.add(request_id=req.request_id, num_scheduled_tokens=n,
                                new_page_ids=req.page_table[req.num_pages_sent:],
                                dropped_page_indices=req.dropped_pending)
        req.dropped_pending = []
        req.num_pages_sent = len(req.page_table)
        req.last_scheduled = plan.step_id

    # ---- results -------------------------------------------------------------------------------
    def process(self, result: pb.StepResult) -> list[tuple[Request, Output]]:
        inflight, self.inflight = self.inflight, []
        if result.error:
            return self._plan_rejected(inflight, result.error, set(result.desynced_request_ids))
        self.kv.confirm(self.inflight_ops)
        self.inflight_ops = PageOps()
        self.ops_failures = 0
        if self.resending:  # only page operations ran: the requests of the rejected plan are still to go
            return []
        self.plan_failures = 0
        self.num_computed_tokens += result.num_computed_tokens
        for req, n in inflight:
            if req.status is Status.RUNNING:
                req.num_computed += n
                self.kv.publish(req)
                if req.n > 1 and req.num_computed == req.compute_target:
                    self._fork(req)
        outputs = []
        for s in result.sampled:
            req = self.requests.get(s.request_id)
            if req is None or req.status is not Status.RUNNING or req.aborted or req.n > 1:
                continue
            outputs.append((req, self._append_token(req, s.token_id, s.logprob)))
        return outputs

    def _children(self, parent: Request) -> list[Request]:
        """Fork i samples with seed + i (documented in the API)."""
        return [
            Request(request_id=f"{parent.request_id}/{i}", prompt_ids=parent.prompt_ids,
                    sampling=replace(parent.sampling, seed=(parent.sampling.seed + i) % (1 << 64)),
                    arrival=parent.arrival, detokenizer=parent.detokenizer.fresh(), queue=parent.queue,
                    tenant=parent.tenant, hash_root=parent.hash_root, group=parent.group, index=i,
                    client_id=parent.client_id, priority=parent.priority, page_budget=parent.page_budget,
                    overflow=parent.overflow, sink_tokens=parent.sink_tokens, window_tokens=parent.window_tokens,
                    max_len=parent.max_len, page_limit=parent.page_limit,
                    num_cached_tokens=parent.num_cached_tokens if i == 0 else 0)
            for i in range(parent.n)
        ]

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
        self.to_forget.append(parent.request_id)

    def _plan_rejected(self, inflight, error: str, desynced: set[str]) -> list[tuple[Request, Output]]:
        """The executor disagreed with us and ran nothing of the step: its page operations go again, alone,
        and every request of the plan is sent in full next time. After MAX_PLAN_RETRIES rejections in a row
        the requests the executor named (all of the plan's if it named none) end with an error."""
        if self.resending:
            self.ops_failures += 1
            if self.ops_failures >= MAX_PLAN_RETRIES:
                raise PlanLoopError(f"executor rejected the same page operations {self.ops_failures} times: {error}")
        else:
            self.plan_failures += 1
        if self.inflight_ops:
            self.resend_ops = self.inflight_ops
        self.inflight_ops = PageOps()
        outputs = []
        for req, _ in inflight:
            req.num_pages_sent = -1
            named = not desynced or req.request_id in desynced
            if self.plan_failures >= MAX_PLAN_RETRIES and named and req.status is Status.RUNNING:
                outputs.append((req, self.finish(req, Finish.ABORT, error=f"executor rejected plan: {error}")))
        return outputs

    def _append_token(self, req: Request, token: int, logprob: float) -> Output:
        req.output_ids.append(token)
        self.waiting.charge(req.tenant, output_tokens=1)
        s = req.sampling
        finish, reason = None, ""
        stop_token = token in s.stop_token_ids or (not s.ignore_eos and token in self.eos)
        req.detokenizer.add(token, emit_text=not stop_token)
        if stop_token:
            finish, reason = Finish.STOP, str(token)
        elif req.detokenizer.stopped_by is not None:
            finish, reason = Finish.STOP, req.detokenizer.stopped_by
        elif len(req.output_ids) >= s.max_tokens or req.num_tokens >= req.max_len:
            finish = Finish.LENGTH
        elif req.page_budget and req.overflow == "stop" and self.pool.pages_for(req.num_tokens) > req.page_budget:
            # the next token's KV would need a page beyond the request's budget
            finish, reason = Finish.LENGTH, f"page_budget: {req.page_budget} pages reached"
            self.stats(req.tenant).budget_hits += 1
        logprobs = [logprob] if s.logprobs else []
        if finish is None:
            return Output(req.detokenizer.take(final=False), [token], logprobs, index=req.index)
        out = self.finish(req, finish, reason)
        out.token_ids, out.logprobs = [token], logprobs
        return out

    def finish(self, req: Request, finish: Finish, stop_reason: str = "", error: str = "") -> Output:
        """Ends a request: pages back to the pool at once, the executor told to forget it."""
        if req.status is Status.RUNNING:
            self.running.remove(req)
            self.kv.release(req)
            self.to_forget.append(req.request_id)
        elif req.status is Status.SWAPPED:  # the executor forgot it when it was swapped out
            self.swapped.remove(req)
            self.kv.release(req)
        elif req.status is Status.WAITING:
            self.waiting.remove(req)
            if req.num_pages_sent >= 0:
                self.to_forget.append(req.request_id)
        req.status = Status.FINISHED
        req.finish = finish
        self.requests.pop(req.request_id, None)
        if self.config.fairness and not any(r.tenant == req.tenant for r in self.requests.values()):
            self.waiting.went_idle(req.tenant)
        if finish is not Finish.ABORT:
            req.detokenizer.flush()
        return Output(req.detokenizer.take(final=True), [], [], finish, stop_reason, error, index=req.index,
                      prompt_tokens=len(req.prompt_ids), completion_tokens=len(req.output_ids),
                      cached_tokens=req.num_cached_tokens)

    def _reap_aborted(self) -> list[tuple[Request, Output]]:
        return [(r, self.finish(r, Finish.ABORT)) for r in list(self.requests.values()) if r.aborted]

    def fail_all(self, error: str) -> list[tuple[Request, Output]]:
        """The executor is gone, and its pages with it (both tiers): every live request ends with an error,
        all pages return, and the prefix cache forgets every page (a restarted executor holds none)."""
        self._drop_inflight()
        outputs = [(r, self.finish(r, Finish.ABORT, error=error)) for r in list(self.requests.values())]
        self._forget_executor_state()
        return outputs

    def evacuate(self, keep_cache: bool = False) -> tuple[list[Request], list[tuple[Request, Output]]]:
        """The executor is gone, and its pages with it: its live requests come back ready to be placed on
        another executor (oldest first), aborted ones end; all pages return and the prefix cache forgets
        every page. A request's sampler continues there: draws are numbered by output position.

        keep_cache: only the Run stream was lost, and the same executor process may come back with its pages
        as they were (the engine forgets them all if another process answers). Published pages stay findable,
        except those that unconfirmed page operations were filling: whether those ran is unknown."""
        unsure = self._unconfirmed_pages() if keep_cache else None
        self._drop_inflight()
        ended = self._reap_aborted() + self.deferred_outputs
        self.deferred_outputs = []
        moved = sorted(self.requests.values(), key=lambda r: r.arrival)
        for req in moved:
            self.detach(req)
        if unsure is None:
            self._forget_executor_state()
        else:
            self.kv.take_ops()
            self.to_forget = []
            self.plan_failures = 0
            self.kv.inflight.clear()
            self.pool.unpublish(unsure[0])
            if self.host is not None:
                self.host.unpublish(unsure[1])
        return moved, ended

    def _unconfirmed_pages(self) -> tuple[set[int], set[int]]:
        """(device, host) pages that page operations not yet confirmed by the executor write into."""
        device, host = set(), set()
        for ops in (self.inflight_ops, self.resend_ops, self.kv.ops):
            if ops is not None:
                device.update(dst for _, dst in ops.swap_in)
                device.update(dst for _, dst in ops.copy)
                host.update(dst for _, dst in ops.swap_out)
        return device, host

    def _drop_inflight(self) -> None:
        self.inflight = []
        for ops in (self.inflight_ops, self.resend_ops, self.kv.take_ops()):
            if ops is not None:
                self.kv.confirm(ops)  # drops the host references they held
        self.inflight_ops, self.resend_ops = PageOps(), None
        self.resending, self.ops_failures = False, 0

    def _forget_executor_state(self) -> None:
        self.kv.take_ops()
        self.to_forget = []
        self.plan_failures = 0
        self.forget_cached_pages()

    def forget_cached_pages(self) -> None:
        """The executor's pages hold nothing any more (another process): no prefix-cache hit may point there."""
        self.pool.forget_hashes()
        if self.host is not None:
            self.host.forget_hashes()
        self.kv.inflight.clear()

    def reset_pool(self, num_pages: int, block_size: int, num_host_pages: int = 0, costs: Costs | None = None) -> None:
        """A (re)connected executor with another pool geometry; only when nothing is live."""
        assert not self.requests, "reset_pool with live requests"
        self.pool = PagePool(num_pages, block_size)
        host = PagePool(num_host_pages, block_size, min_pages=0) if num_host_pages else None
        old = self.kv
        self.kv = KVManager(self.pool, self.config.enable_prefix_caching, host)
        if self.tenants.path is not None:  # quotas and reserves given as fractions follow the new pool
            try:
                self.tenants = Tenants.load(self.tenants.path, num_pages)
            except ValueError:
                pass  # the old settings stay; the next reload reports the file's error
        self.kv.swaps, self.kv.num_cached_prompt_tokens = old.swaps, old.num_cached_prompt_tokens  # "since start"
        self.kv.num_prompt_tokens_queried = old.num_prompt_tokens_queried
        if costs is not None:
            self.set_costs(costs)
        self.watermark_pages = int(self.config.watermark * num_pages)

    def set_tenants(self, tenants: Tenants) -> list[tuple[Request, Output]]:
        """New tenant settings (a reload): live requests get their limits again; those that no longer fit
        their tenant (a quota lowered below what they hold or need, or below their page budget, or n above its
        concurrency limit) end with an error."""
        self.tenants = tenants
        ended = []
        for req in list(self.requests.values()):
            req.max_len = self.max_len_for(req)
            if req.window_tokens and not req.page_budget:
                req.page_limit = self.window_page_limit(req.tenant, req.sink_tokens, req.window_tokens)
            too_long = req.num_tokens >= req.max_len or (req.window_tokens and not req.page_budget
                                                         and not req.page_limit)
            too_long = too_long or req.page_budget > self.tenant_capacity(req.tenant)  # (it could never grow)
            seats = tenants.get(req.tenant).max_concurrent_requests
            if req.aborted:
                continue
            if too_long:
                ended.append((req, self.finish(req, Finish.ABORT, error=(
                    f"tenant {req.tenant}'s new limits hold {self.tenant_capacity(req.tenant)} pages; this "
                    "request needs more"))))
            elif seats and req.n > seats:  # (a parent not yet forked: it could never be admitted again)
                ended.append((req, self.finish(req, Finish.ABORT, error=(
                    f"tenant {req.tenant}'s new limits allow {seats} concurrent sequences; this request asked "
                    f"for n={req.n}"))))
        return ended

    def set_costs(self, costs: Costs) -> None:
        """A (re)connected executor measured its copy bandwidth and prefill cost again."""
        self.policy = PreemptionPolicy(self.config.preemption, costs)

    def kv_slots_filled(self) -> int:
        """Token slots of the device pages in use that hold KV (each page once, however many share it)."""
        bs = self.pool.block_size
        fill: dict[int, int] = {}
        for r in self.running:
            full, rest = divmod(r.num_computed, bs)
            for j, page in enumerate(r.page_table):
                if page == DROPPED:
                    continue
                n = bs if j < full else (rest if j == full else 0)
                if n > fill.get(page, 0):
                    fill[page] = n
        return sum(fill.values())

    # ---- checks --------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Both tiers: every page's refcount equals the tables (and pending swap-ins) holding it."""
        self.pool.check_integrity(list(held(r.page_table)) for r in self.running)
        for r in self.running:
            if r.page_budget:
                pages = sum(1 for _ in held(r.page_table))
                assert pages <= r.page_budget, f"{r.request_id} holds {pages} pages, budget {r.page_budget}"
        if self.host is not None:
            pending = [ops.host_release for ops in (self.inflight_ops, self.resend_ops, self.kv.ops) if ops is not None]
            self.host.check_integrity([*(list(held(r.host_table)) for r in self.swapped), *pending])
        for h, owner in self.kv.inflight.items():
            assert owner.status is Status.RUNNING and h in owner.registered, "stale in-flight page claim"
        for r in self.waiting:
            assert not r.page_table and not r.host_table, f"waiting request {r.request_id} holds pages"
        for r in self.running:
            assert not r.host_table, f"running request {r.request_id} holds host pages"
        for r in self.swapped:
            assert not r.page_table and r.status is Status.SWAPPED, f"swapped request {r.request_id} holds device pages"
            assert len(r.host_table) == self.pool.pages_for(r.num_computed), f"{r.request_id}: host table size"
        assert len(self.running) + len(self.waiting) + len(self.swapped) == len(self.requests), "request lists disagree"
