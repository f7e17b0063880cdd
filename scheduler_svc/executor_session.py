"""The scheduler's side of one executor's Run stream: step plans on the wire, and what is in flight.

``Scheduler.schedule`` decides, in plain data, which requests compute how many tokens and which page
operations run; the session encodes that as a ``StepPlan`` (deltas: a request's full page table the first
time, or after its table changed in place; appended page ids and dropped page indices after that; a bare id
in ``decodes`` for the steady one-token decode) and remembers it until the result comes back. With async
scheduling (engine.py) up to two plans are in flight, answered in order.

The resend protocol: a plan the executor rejects ran nothing. Its page operations must still run before
anything planned later (a later plan's swap-ins and copies may read what they write), so they go again,
alone, in the next plan, and so do the ids it told the executor to forget; every request of the rejected plan
is sent in full next time. (A rejection with another plan in flight is a lost stream instead: engine.py.) After
MAX_PLAN_RETRIES rejections in a row the requests the executor named end with an error, and a resend of the
same page operations rejected that often means the executor's state cannot be trusted (PlanLoopError).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from pagedkv.executor.v1 import executor_pb2 as pb
from scheduler_svc.kv_manager import PageOps
from scheduler_svc.request import Request, Status

MAX_PLAN_RETRIES = 3


class PlanLoopError(RuntimeError):
    """The executor keeps rejecting page operations: its state cannot be trusted any more."""


@dataclass(slots=True)
class InFlight:
    """One plan sent and not yet answered: its requests (tokens each, whether it samples), its page operations,
    whether it is a resend of page operations alone."""

    step_id: int
    scheduled: list[tuple[Request, int, bool]]
    ops: PageOps
    resending: bool = False
    forget: list[str] = field(default_factory=list)  # the request ids it told the executor to drop
    rows: list[Request] = field(default_factory=list)  # its requests in plan order (StepResult.sampled_rows)


class ExecutorSession:
    """Plans go out in order and results come back in order. With async scheduling one more plan is sent
    before the last result is read, so up to two are in flight; planning then counts what those will have
    done (``Request.num_inflight_tokens`` in ``num_computed``, ``Request.num_pending`` samples) and the
    result confirms it."""

    def __init__(self) -> None:
        self.forget: list[str] = []  # request ids the executor drops with the next plan
        self.in_flight: deque[InFlight] = deque()  # sent, not yet answered (oldest first)
        self.resend_ops: PageOps | None = None  # those of a rejected plan: sent again, alone, first
        self.ops_failures = 0  # consecutive rejections of such resends
        self.plan_failures = 0  # consecutive rejections of plans

    @property
    def has_work(self) -> bool:
        return bool(self.forget or self.resend_ops)

    @property
    def resending(self) -> bool:
        """The oldest plan in flight is a resend of page operations."""
        return bool(self.in_flight) and self.in_flight[0].resending

    # ---- encoding ------------------------------------------------------------------------------
    def encode(self, step_id: int, scheduled: list[tuple[Request, int]], ops: PageOps) -> pb.StepPlan:
        """The plan on the wire; what it will compute is counted at once (optimistically: the next plan may be
        built before its result is read)."""
        plan = pb.StepPlan(step_id=step_id, forget=self.forget)
        forget, self.forget = self.forget, []
        _add_ops(plan, ops)
        decodes, decoding = [], []
        entries, new, continuing = [], [], []  # (rows: new_requests, continuing, then decodes)
        for req, n in scheduled:
            if n == 1 and req.num_pages_sent == len(req.page_table) and not req.dropped_pending:
                decodes.append(req.request_id)
                decoding.append(req)
                req.last_scheduled = step_id
            else:
                (new if req.num_pages_sent < 0 else continuing).append(req)
                _add_request(plan, req, n)
            req.num_computed += n
            req.num_inflight_tokens += n
            samples = req.n == 1 and req.num_computed == req.num_tokens + req.num_pending
            if samples:
                req.num_pending += 1
            entries.append((req, n, samples))
        plan.decodes.extend(decodes)
        self.in_flight.append(InFlight(step_id, entries, ops, forget=forget, rows=new + continuing + decoding))
        return plan

    def resend(self, step_id: int) -> pb.StepPlan:
        """The page operations of a rejected plan, alone, before anything planned later."""
        plan = pb.StepPlan(step_id=step_id, forget=self.forget)
        forget, self.forget = self.forget, []
        ops, self.resend_ops = self.resend_ops, None
        _add_ops(plan, ops)
        self.in_flight.append(InFlight(step_id, [], ops, resending=True, forget=forget))
        return plan

    # ---- results -------------------------------------------------------------------------------
    def malformed(self, result: pb.StepResult, vocab_size: int = 0) -> str:
        """Why the result cannot be the answer to the oldest plan in flight, or '' (a peer is not trusted: a
        sample for a row the plan does not have, twice for one row, a token outside [0, vocab_size) when that is
        known, or lists of different lengths)."""
        if result.error:
            return ""
        rows = result.sampled_rows
        if not len(rows) == len(result.sampled_token_ids) == len(result.sampled_logprobs):
            return (f"sampled_rows, sampled_token_ids and sampled_logprobs differ in length ({len(rows)}, "
                    f"{len(result.sampled_token_ids)}, {len(result.sampled_logprobs)})")
        if not rows:
            return ""
        planned = len(self.in_flight[0].rows) if self.in_flight else 0
        if max(rows) >= planned:
            return f"sampled_rows: row {max(rows)} but the plan has {planned} rows"
        if len(set(rows)) != len(rows):
            return "sampled_rows: a row sampled twice"
        tokens = result.sampled_token_ids
        if min(tokens) < 0 or (vocab_size and max(tokens) >= vocab_size):
            bad = next(t for t in tokens if t < 0 or (vocab_size and t >= vocab_size))
            return f"sampled_token_ids: token {bad} outside the vocabulary [0, {vocab_size or 'its size'})"
        return ""

    def accepted(self) -> InFlight:
        """The executor ran the oldest plan in flight: it leaves the queue (its requests' in-flight counts are
        the caller's to settle, its page operations to confirm)."""
        sent = self.in_flight.popleft()
        self.ops_failures = 0
        if not sent.resending:
            self.plan_failures = 0
        return sent

    def rejected(self, error: str, desynced: set[str]) -> list[Request]:
        """The executor disagreed and ran nothing of the oldest plan in flight (the only one: a rejection
        with another in flight is a lost executor, see Engine): what it counted is taken back, its page
        operations go again, its requests in full. Returns the running requests that must end with an error
        (after MAX_PLAN_RETRIES rejections in a row: those the executor named, all of the plan's if it named
        none)."""
        sent = self.in_flight.popleft()
        assert not self.in_flight, "a rejected plan with another in flight"
        if sent.resending:
            self.ops_failures += 1
            if self.ops_failures >= MAX_PLAN_RETRIES:
                raise PlanLoopError(f"executor rejected the same page operations {self.ops_failures} times: {error}")
        else:
            self.plan_failures += 1
        if sent.ops:
            self.resend_ops = sent.ops
        self.forget[:0] = sent.forget  # (it dropped none of them either)
        _uncount(sent)
        ended = []
        for req, n, _samples in sent.scheduled:
            if req.status is Status.RUNNING:  # (an ended request's count went with its pages)
                req.num_computed -= n
            req.num_pages_sent = -1
            named = not desynced or req.request_id in desynced
            if self.plan_failures >= MAX_PLAN_RETRIES and named and req.status is Status.RUNNING:
                ended.append(req)
        return ended

    # ---- a lost stream -------------------------------------------------------------------------
    def unconfirmed_ops(self) -> list[PageOps]:
        """Page operations sent (or to be resent) that the executor has not confirmed."""
        return [*(sent.ops for sent in self.in_flight), *([self.resend_ops] if self.resend_ops is not None else [])]

    def drop_inflight(self) -> list[PageOps]:
        """Forgets the plans in flight and any resend; returns their page operations (to release). What they
        counted is taken back (their requests are recomputed, or end)."""
        ops = self.unconfirmed_ops()
        for sent in self.in_flight:
            _uncount(sent)
        self.in_flight.clear()
        self.resend_ops = None
        self.ops_failures = 0
        return ops

    def reset(self) -> None:
        """A new stream (or none): nothing to forget, no failures counted."""
        self.forget = []
        self.plan_failures = 0


def _uncount(sent: InFlight) -> None:
    """A plan's in-flight counts leave its requests (it was answered, rejected or lost)."""
    for req, n, samples in sent.scheduled:
        req.num_inflight_tokens -= n
        if samples:
            req.num_pending -= 1


def _add_ops(plan: pb.StepPlan, ops: PageOps) -> None:
    # Copies run after swap-ins: a copy source overwritten by a swap-in of the same plan would be read too
    # late. Today no page is freed and handed out again within a plan after a copy was planned from it
    # (sources stay referenced); this keeps it that way.
    if ops.copy and ops.swap_in:
        assert not {d for _, d in ops.swap_in} & {s for s, _ in ops.copy}, "swap-in over a copy source"
    for src, dst in ops.swap_out:
        plan.page_ops.swap_out.add(src=src, dst=dst)
    for src, dst in ops.swap_in:
        plan.page_ops.swap_in.add(src=src, dst=dst)
    for src, dst in ops.copy:
        plan.page_ops.copy.add(src=src, dst=dst)


def _add_request(plan: pb.StepPlan, req: Request, n: int) -> None:
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
