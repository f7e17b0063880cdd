"""Priority classes (``--scheduling-policy priority``, as vLLM's and SGLang's): a waiting request more important than
running requests of its own tenant takes their seats or pages when it cannot start otherwise.

Who asks: the request admission would take next (``WaitQueue.head``: fair order across tenants, priority order inside
each), once it has waited ``PREEMPT_AFTER_STEPS`` plans (it was passed over at least once: a request that the next
step would admit anyway preempts nothing). Who gives: running requests of its own tenant with a strictly higher
``priority`` value, in the policy's victim order (``PreemptionPolicy.pick_victim``: coldest, least important, newest);
each is swapped out or recomputed by the cost rule (``Scheduler._preempt``). Across tenants priority moves nothing:
a tenant below its fair share gets room from tenants above theirs (fair_share.py) whatever the priorities, and a
tenant above its share gets none from another tenant, however important its request.

No thrash between classes: a victim is strictly less important than the request it makes room for, so it can never
preempt that request back, and requeued it waits behind it in its tenant's queue. The victims are chosen on paper
and preempted only if together they make the room (else none is: a preemption that leaves the request still unable
to start frees nothing for it); one request gets room a step.

``victims_for_head`` is a pure function of the planner's read-only view; the planner preempts what it returns.
"""

from __future__ import annotations

from scheduler_svc.fair_share import ReleasePreview
from scheduler_svc.plan_view import PlanView, first_chunk
from scheduler_svc.request import Request

PREEMPT_AFTER_STEPS = 2  # plans a request waits (passed over at least once) before it may preempt for its class


def waited_steps(req: Request, now: int) -> int:
    """Plans since the request was queued or last scheduled (a recompute-preempted one waits again)."""
    return now - max(req.queued_at_step, req.last_scheduled)


def victims_for_head(view: PlanView) -> list[Request]:
    """The running requests of its tenant to preempt so that the head of the wait queue can start under the priority
    policy ([] when none need to, when it has not waited long enough, or when preempting would not make the room)."""
    waiting = view.queues.waiting
    if not waiting.by_priority or not waiting:
        return []
    req = waiting.head()
    if req is None or req.in_flight or waited_steps(req, view.now) < PREEMPT_AFTER_STEPS:
        return []
    candidates = [r for r in view.queues.running if r.tenant == req.tenant and r.priority > req.priority]
    if not candidates:
        return []
    kv = view.kv
    hits = kv.find_hits(req)
    if kv.waits_for_inflight(req, len(hits)):
        return []  # another request computes its prefix: it starts after that, whatever is preempted
    hits, n = first_chunk(view, req, hits, view.config.max_num_batched_tokens)
    room = _Room(view, req, kv.pages_to_admit(hits, n))
    victims: list[Request] = []
    while not room.fits(victims):
        if not candidates:
            return []
        victim = view.policy.pick_victim(candidates, view.now)
        candidates.remove(victim)
        victims.append(victim)
        room.add(victim)
    return victims


class _Room:
    """Whether req could start if some running requests of its tenant gave back their seats and pages (on paper)."""

    def __init__(self, view: PlanView, req: Request, need: int) -> None:
        self._view, self._req, self._need = view, req, need
        self._preview = ReleasePreview(view.kv.pool)
        self._seats = sum(r.n for r in view.queues.running)
        self._tenant_seats = view.ledger.seats_of(req.tenant)
        tenant = req.tenant
        self._used_elsewhere = view.ledger.used_pages(tenant) - view.kv.pool.used_by[tenant]
        # NOTE: the running requests that stay are scheduled (and grow) before anything is admitted: room they would
        # take is no room for req (fair_share.py's livelock, the same here).
        self._growth = sum(self._grows(r) for r in view.queues.running)

    def _grows(self, r: Request) -> int:
        kv, tokens = self._view.kv, self._view.config.max_num_batched_tokens
        return kv.pages_to_grow(r, kv.window_chunk_limit(r, min(r.num_uncomputed, tokens)))

    def add(self, victim: Request) -> None:
        self._preview.add(victim)
        self._seats -= victim.n
        self._tenant_seats -= victim.n
        self._growth -= self._grows(victim)

    def fits(self, victims: list[Request]) -> bool:
        view, req, preview = self._view, self._req, self._preview
        tenant = view.ledger.tenants.get(req.tenant)
        if self._seats + req.n > view.config.max_num_seqs:
            return False
        if tenant.max_concurrent_requests and self._tenant_seats + req.n > tenant.max_concurrent_requests:
            return False
        if tenant.page_quota and self._used_elsewhere + preview.used_pages(req.tenant) + self._need > tenant.page_quota:
            return False
        slack = view.watermark_pages if len(view.queues.running) > len(victims) else 0
        return preview.fits(view.limits, req.tenant, self._need + slack + self._growth)
