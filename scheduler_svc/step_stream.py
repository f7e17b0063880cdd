"""The scheduler's side of one executor's Run stream: each step the planner decides goes out as a StepPlan, and what
is in flight until its result comes back. ``StepStream`` is the one owner of the wire: the per-executor loop
(engine.py, or a test or benchmark driving a planner in one process) plans, sends and applies through it.

``Scheduler.plan`` decides, in plain data (``step.Step``), which requests compute how many tokens and which page
operations run; the stream encodes that as a ``StepPlan`` (deltas: a request's full page table the first time, or
after its table changed in place; appended page ids and dropped page indices after that; a bare id in ``decodes``
for the steady one-token decode) and keeps it (``InFlight``, with when it was planned and sent) until the result
comes back, which it checks and hands to the planner. With async scheduling (engine.py) up to two plans are in
flight, answered in order.

The resend protocol: a plan the executor rejects ran nothing. Its page operations must still run before
anything planned later (a later plan's swap-ins and copies may read what they write), so they go again,
alone, in the next plan, and so do the ids it told the executor to forget; every request of the rejected plan
is sent in full next time. (A rejection with another plan in flight is a lost stream instead: engine.py.) After
MAX_PLAN_RETRIES rejections in a row the requests the executor named end with an error, and a resend of the
same page operations rejected that often means the executor's state cannot be trusted (PlanLoopError).
"""

from __future__ import annotations

import time
from collections import deque

from pagedkv.executor.v1 import executor_pb2 as pb
from scheduler_svc import logprobs
from scheduler_svc.plan_clock import step_features
from scheduler_svc.request import Request, Status
from scheduler_svc.scheduler import Outputs, Scheduler
from scheduler_svc.step import InFlight, PageOps, Step

MAX_PLAN_RETRIES = 3


class PlanLoopError(RuntimeError):
    """The executor keeps rejecting page operations: its state cannot be trusted any more."""


class StepStream:
    """Plans go out in order and results come back in order. With async scheduling one more plan is sent
    before the last result is read, so up to two are in flight; planning then counts what those will have
    done (``Request.num_inflight_tokens`` in ``num_computed``, ``Request.num_pending`` samples) and the
    result confirms it."""

    def __init__(self, scheduler: Scheduler) -> None:
        self._scheduler = scheduler
        self._in_flight: deque[InFlight] = deque()  # sent, not yet answered (oldest first)
        self._resend_ops: PageOps | None = None  # those of a rejected plan: sent again, alone, first
        self._ops_failures = 0  # consecutive rejections of such resends
        self._plan_failures = 0  # consecutive rejections of plans
        self._last_read_at = 0.0  # perf_counter when the last result was read (the next plan could start)

    @property
    def has_work(self) -> bool:
        return self._resend_ops is not None or self._scheduler.has_work

    @property
    def in_flight(self) -> int:
        """Plans sent and not yet answered."""
        return len(self._in_flight)

    @property
    def oldest(self) -> InFlight:
        """The plan the next result answers."""
        return self._in_flight[0]

    @property
    def resending(self) -> bool:
        """The oldest plan in flight is a resend of page operations."""
        return bool(self._in_flight) and self._in_flight[0].resending

    # ---- out ----------------------------------------------------------------------------------
    def next_plan(self, rides: bool = True) -> tuple[pb.StepPlan | None, Outputs]:
        """The next plan on the wire (None: nothing to send) and the messages of requests that ended meanwhile. The
        plan is in flight from here on (``sent`` says when it went out). ``rides``: Scheduler.plan's."""
        step, outputs = self._scheduler.plan(resend=self._resend_ops is not None, rides=rides)
        if step is None:
            return None, outputs
        return (self._resend(step) if step.resend else self._encode(step)), outputs

    def sent(self, at: float, plan_seconds: float) -> None:
        """The newest plan went out at ``at`` (perf_counter), after ``plan_seconds`` of planning."""
        last = self._in_flight[-1]
        last.sent_at, last.plan_seconds = at, plan_seconds

    def _encode(self, step: Step) -> pb.StepPlan:
        plan = pb.StepPlan(step_id=step.step_id, forget=step.forget)
        _add_ops(plan, step.ops)
        for name, slot in step.adapter_loads:
            plan.adapter_loads.add(name=name, slot=slot)
        decodes, decoding = [], []
        new, continuing = [], []  # (rows: new_requests, continuing, then decodes)
        traced = None  # rows of a prefill whose first token is still to be planned (ttft_trace.py)
        tokens = one_token_rows = 0
        for req, n, samples in step.scheduled:
            if n == 1 and req.num_pages_sent == len(req.page_table) and not req.dropped_pending:
                decodes.append(req.request_id)
                decoding.append(req)
            else:
                (new if req.num_pages_sent < 0 else continuing).append(req)
                _add_request(plan, req, n)
                tokens += n
                one_token_rows += n == 1
                if req.trace.open:
                    (traced := traced or []).append((req, n, samples))
        plan.decodes.extend(decodes)
        sent = InFlight(step.step_id, step.scheduled, step.ops, forget=step.forget, rows=new + continuing + decoding,
                        features=step_features(step.scheduled), rides=step.rides)
        if traced:
            _trace_chunks(sent, traced, tokens + len(decodes), one_token_rows + len(decodes), len(self._in_flight))
        self._in_flight.append(sent)
        return plan

    def _resend(self, step: Step) -> pb.StepPlan:
        """The page operations of a rejected plan, alone, before anything planned later."""
        plan = pb.StepPlan(step_id=step.step_id, forget=step.forget)
        ops, self._resend_ops = self._resend_ops, None
        _add_ops(plan, ops)
        for name, slot in step.adapter_loads:  # (every slot's: the rejected plan's loads did not run)
            plan.adapter_loads.add(name=name, slot=slot)
        self._in_flight.append(InFlight(step.step_id, [], ops, resending=True, forget=step.forget,
                                        features=step_features([])))
        return plan

    # ---- back ---------------------------------------------------------------------------------
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
        planned = self._in_flight[0].rows if self._in_flight else []
        if rows:
            if max(rows) >= len(planned):
                return f"sampled_rows: row {max(rows)} but the plan has {len(planned)} rows"
            if len(set(rows)) != len(rows):
                return "sampled_rows: a row sampled twice"
            tokens = result.sampled_token_ids
            if min(tokens) < 0 or (vocab_size and max(tokens) >= vocab_size):
                bad = next(t for t in tokens if t < 0 or (vocab_size and t >= vocab_size))
                return f"sampled_token_ids: token {bad} outside the vocabulary [0, {vocab_size or 'its size'})"
        if result.sampled_top_token_ids or result.sampled_top_logprobs or result.prompt_logprobs:
            return logprobs.malformed(result, [r.sampling.top_logprobs for r in planned],
                                      [r.prompt_logprobs.k if r.prompt_logprobs else None for r in planned],
                                      [len(r.prompt_ids) for r in planned], vocab_size)
        return ""

    def apply(self, result: pb.StepResult) -> Outputs:
        """Applies the result of the oldest plan in flight (checked by ``malformed``); returns the messages of the
        requests that ended (for ``outputs.deliver``)."""
        sent = self._in_flight.popleft()
        at = time.perf_counter()
        started, self._last_read_at = max(sent.sent_at, self._last_read_at), at
        if sent.traced:  # (before the samples go to the streams: the first token's read time)
            for req in sent.traced:
                if result.error:
                    req.trace.discard(sent.step_id)
                else:
                    req.trace.answered(sent.step_id, started, at)
        if result.error:
            ended = self._rejected(sent, set(result.desynced_request_ids), result.error)
            return self._scheduler.rejected(sent, ended, result.error)
        self._ops_failures = 0
        if not sent.resending:
            self._plan_failures = 0
        return self._scheduler.process(sent, result)

    def _rejected(self, sent: InFlight, desynced: set[str], error: str) -> list[Request]:
        """The executor disagreed and ran nothing of ``sent`` (the only plan in flight: a rejection with another in
        flight is a lost executor, see Engine): its page operations go again, its requests in full. Returns the
        running requests that must end with an error (after MAX_PLAN_RETRIES rejections in a row: those the executor
        named, all of the plan's if it named none)."""
        assert not self._in_flight, "a rejected plan with another in flight"
        if sent.resending:
            self._ops_failures += 1
            if self._ops_failures >= MAX_PLAN_RETRIES:
                raise PlanLoopError(f"executor rejected the same page operations {self._ops_failures} times: {error}")
        else:
            self._plan_failures += 1
        if sent.ops:
            self._resend_ops = sent.ops
        ended = []
        for req, _n, _samples in sent.scheduled:
            req.num_pages_sent = -1
            named = not desynced or req.request_id in desynced
            if self._plan_failures >= MAX_PLAN_RETRIES and named and req.status is Status.RUNNING:
                ended.append(req)
        return ended

    # ---- the stream ends -----------------------------------------------------------------------
    def _drop_in_flight(self) -> tuple[list[InFlight], list[PageOps]]:
        """Forgets the plans in flight and any resend: (those plans, every page operation not confirmed)."""
        unanswered, ops = list(self._in_flight), self._unconfirmed()
        for sent in unanswered:
            for req in sent.traced:
                req.trace.discard(sent.step_id)
        self._in_flight.clear()
        self._resend_ops = None
        self._ops_failures = 0
        return unanswered, ops

    def _unconfirmed(self) -> list[PageOps]:
        """Page operations sent (or to be resent) that the executor has not confirmed."""
        return [*(sent.ops for sent in self._in_flight), *([self._resend_ops] if self._resend_ops is not None else [])]

    def lost(self, keep_cache: bool = False) -> tuple[list[Request], Outputs]:
        """The stream is gone, and with it the executor's state (``keep_cache``: perhaps not its pages): the live
        requests to place elsewhere, and the messages of those that ended (``Scheduler.evacuate``)."""
        moved, ended = self._scheduler.evacuate(*self._drop_in_flight(), keep_cache=keep_cache)
        self._plan_failures = 0
        return moved, ended

    def fail_all(self, error: str) -> Outputs:
        """The executor is gone and its requests end with ``error`` (a scheduler bug mid-step)."""
        _, ended = self._scheduler.evacuate(*self._drop_in_flight(), error=error)
        self._plan_failures = 0
        return ended

    def drained(self) -> Outputs:
        """Nothing is left on a draining executor that is about to close: its plans are never answered, every page
        is accounted for, and no prefix-cache hit may point there (a process that comes back at its address starts
        empty). Returns the messages of requests that ended meanwhile."""
        _, ended = self._scheduler.evacuate(*self._drop_in_flight())
        self.check_integrity()
        return ended

    def check_integrity(self) -> None:
        """The planner's page accounting, and every request's in-flight counts are those of the plans in flight."""
        self._scheduler.check_integrity(self._unconfirmed())
        tokens: dict[int, int] = {}
        samples: dict[int, int] = {}
        for sent in self._in_flight:
            for r, n, sampled in sent.scheduled:
                tokens[id(r)] = tokens.get(id(r), 0) + n
                samples[id(r)] = samples.get(id(r), 0) + sampled
        for r in self._scheduler.live_requests():
            assert r.num_inflight_tokens == tokens.get(id(r), 0) and r.num_pending == samples.get(id(r), 0), (
                f"{r.request_id}: in-flight counts {r.num_inflight_tokens}/{r.num_pending} disagree with the plans "
                f"in flight")


def _trace_chunks(sent: InFlight, traced: list[tuple[Request, int, bool]], tokens: int, one_token_rows: int,
                  ahead: int) -> None:
    """Records the prefill chunks of a plan on their requests' traces: ``tokens`` and ``one_token_rows`` are the
    plan's, ``ahead`` the plans in flight before it."""
    at = time.perf_counter()
    sent.traced = [req for req, _, _ in traced]
    for req, n, samples in traced:
        others = one_token_rows - (n == 1)
        req.trace.chunk(sent.step_id, n, samples, others, tokens - n - others, ahead, at)


def _add_ops(plan: pb.StepPlan, ops: PageOps) -> None:
    # Copies run after swap-ins: a copy source overwritten by a swap-in of the same plan would be read too
    # late. Today no page is freed and handed out again within a plan after a copy was planned from it
    # (sources stay referenced); this keeps it that way.
    if ops.copy and ops.swap_in:
        assert not {d for _, d in ops.swap_in} & {s for s, _ in ops.copy}, "swap-in over a copy source"
    for src, dst in ops.swap_out:
        plan.page_ops.swap_out.add(src=src, dst=dst)
    plan.page_ops.zero.extend(ops.zero)
    for src, dst in ops.swap_in:
        plan.page_ops.swap_in.add(src=src, dst=dst)
    for src, dst in ops.copy:
        plan.page_ops.copy.add(src=src, dst=dst)


def _add_request(plan: pb.StepPlan, req: Request, n: int) -> None:
    if req.num_pages_sent < 0:
        s = req.sampling
        prompt_logprobs = req.computes_prompt_logprobs
        # (a fork parent stops one token short of its prompt, so that it never samples; one that computes prompt
        # log-probabilities is sent its last prompt token too, whose log-probability its last position gives)
        plan.new_requests.add(
            request_id=req.request_id,
            token_ids=req.all_token_ids if prompt_logprobs else req.all_token_ids[: req.compute_target],
            num_computed_tokens=req.num_computed - n,  # (the planner counted this step's n already)
            num_scheduled_tokens=n, page_ids=req.page_table,
            sampling=pb.SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                                       seed=s.seed, logprobs=s.logprobs, presence_penalty=s.presence_penalty,
                                       frequency_penalty=s.frequency_penalty,
                                       repetition_penalty=s.repetition_penalty, min_p=s.min_p,
                                       min_tokens=s.min_tokens, min_tokens_stop_ids=s.min_tokens_stop_ids,
                                       logit_bias=s.logit_bias, allowed_token_ids=s.allowed_token_ids,
                                       bad_words=[pb.TokenSequence(token_ids=w) for w in s.bad_words_ids],
                                       top_logprobs=s.top_logprobs, prompt_logprobs=prompt_logprobs,
                                       prompt_top_logprobs=s.prompt_logprobs or 0),
            num_output_tokens=len(req.output_ids), sink_tokens=req.sink_tokens,
            window_tokens=req.window_tokens, constraint=s.constraint, adapter=req.adapter,
        )
    else:
        plan.continuing.add(request_id=req.request_id, num_scheduled_tokens=n,
                            new_page_ids=req.page_table[req.num_pages_sent:],
                            dropped_page_indices=req.dropped_pending)
    req.dropped_pending = []
    req.num_pages_sent = len(req.page_table)
