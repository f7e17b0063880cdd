"""Where a request's first token's time goes, from the scheduler's own timestamps (issue #49).

Each request carries one ``TtftTrace`` (``Request.trace``; the forks of a request share their parent's). Its
stamps are ``time.perf_counter()`` floats, the clock the Generate handler measures time to first token with, so the
parts add up to that figure exactly::

    received ─tokenize─▶ tokenized ─prepare─▶ queued ─queue─▶ planned ─prefill─▶ first token read ─send─▶ sent
                                                                 │◀ behind ▶│ chunk … chunk (sampled)

- tokenize: the call arrived → its prompt ids are ready (auth, chat template, the tokenizer thread's queue);
- prepare: → handed to the cluster (validation, echo text, a constraint's compile);
- queue: → the plan that first computes for it is built (as vLLM's queued interval: waiting for admission);
- prefill: → the result of the step that sampled its first token is read (as vLLM's prefill interval: first
  scheduled to first token, preemptions included). Of it, ``behind``: the first chunk's plan waiting for the plan
  in flight ahead of it (async scheduling's extra step; 0 without one), and ``steps``: the executor steps from the
  first chunk's plan to that result, counting that plan ahead;
- send: → the Generate handler takes the token from the stream's outbox (the event loop's delay).

Writers: the API stamps ``received``, ``tokenized``, ``queued`` (``arrived``, ``enqueued``); the wire
(step_stream.py) records each prefill chunk as it encodes a plan (``chunk``) and stamps it when the plan's result
is read (``answered``), or forgets it when the plan ran nothing (``discard``). ``report`` reads. Per chunk one small
object; nothing per decode step."""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler_svc import metrics


@dataclass(slots=True)
class Chunk:
    """One step's prefill tokens for a request, and what else that step computed."""

    step_id: int
    tokens: int
    decode_rows: int  # the step's other rows of one token (decodes)
    other_prefill_tokens: int  # the step's other tokens (other requests' prefill chunks)
    planned_at: float
    done_at: float = 0.0  # its result was read (0: not yet)


@dataclass(slots=True)
class TtftTrace:
    received: float = 0.0
    tokenized: float = 0.0
    queued: float = 0.0
    chunks: list[Chunk] = field(default_factory=list)
    ahead: int = 0  # plans in flight when its first chunk's plan was built (async scheduling: 0 or 1)
    started_at: float = 0.0  # when the executor could start its first chunk (the plan ahead's result read)
    sampling_step: int = -1  # the step that samples its first token, once planned
    first_token_at: float = 0.0  # that step's result was read

    # ---- the API ------------------------------------------------------------------------------
    def arrived(self, received: float, tokenized: float) -> None:
        self.received, self.tokenized = received, tokenized

    def enqueued(self, at: float) -> None:
        self.queued = at

    # ---- the wire -----------------------------------------------------------------------------
    @property
    def open(self) -> bool:
        """Its prefill chunks are still being planned (no step that samples its first token yet)."""
        return self.sampling_step < 0 and not self.first_token_at

    def chunk(self, step_id: int, tokens: int, samples: bool, decode_rows: int, other_prefill_tokens: int,
              ahead: int, at: float) -> None:
        """A plan computes ``tokens`` of its prefill (``samples``: and samples its first token)."""
        if not self.chunks:
            self.ahead = ahead
        self.chunks.append(Chunk(step_id, tokens, decode_rows, other_prefill_tokens, at))
        if samples:
            self.sampling_step = step_id

    def answered(self, step_id: int, started_at: float, at: float) -> None:
        """The result of step ``step_id`` was read at ``at``; the executor could start it at ``started_at``."""
        chunks = self.chunks
        for c in reversed(chunks):
            if c.step_id == step_id and not c.done_at:
                c.done_at = at
                if c is chunks[0]:
                    self.started_at = started_at
                break
        if step_id == self.sampling_step:
            self.first_token_at = at

    def discard(self, step_id: int) -> None:
        """Step ``step_id`` ran nothing (rejected, or its stream was lost): its chunk was not computed."""
        self.chunks = [c for c in self.chunks if c.step_id != step_id or c.done_at]
        if self.sampling_step == step_id and not self.first_token_at:
            self.sampling_step = -1

    @property
    def steps(self) -> int:
        """Executor steps from its first chunk's plan to its first token: the plan ahead of that one, and each step
        from the first chunk's to the sampling one (those it sat out too; on another executor after a migration,
        its chunks)."""
        first, last = self.chunks[0].step_id, self.sampling_step
        return self.ahead + (last - first + 1 if last >= first else len(self.chunks))


@dataclass(frozen=True, slots=True)
class Breakdown:
    """Seconds of each part of a time to first token (they add up to ``ttft``) and the prefill's shape."""

    tokenize: float
    prepare: float
    queue: float
    prefill: float
    behind: float  # of prefill: waiting behind the plan in flight ahead of the first chunk
    send: float
    ttft: float
    steps: int
    chunks: int
    ahead: int

    def log_fields(self) -> dict:
        return {"tokenize_s": round(self.tokenize, 6), "prepare_s": round(self.prepare, 6),
                "queue_s": round(self.queue, 6), "prefill_s": round(self.prefill, 6),
                "behind_s": round(self.behind, 6), "send_s": round(self.send, 6), "ttft_s": round(self.ttft, 6),
                "prefill_steps": self.steps, "prefill_chunks": self.chunks, "plans_ahead": self.ahead}


def breakdown(trace: TtftTrace, sent_at: float) -> Breakdown | None:
    """The parts of a first token sent at ``sent_at``; None when the trace is incomplete (no chunk was recorded, or
    the token did not come from a traced step: e.g. a request migrated mid-prefill whose plan was lost)."""
    if not trace.chunks or not trace.first_token_at or not trace.queued:
        return None
    planned = trace.chunks[0].planned_at
    behind = max(0.0, trace.started_at - planned) if trace.started_at else 0.0
    return Breakdown(tokenize=trace.tokenized - trace.received, prepare=trace.queued - trace.tokenized,
                     queue=planned - trace.queued, prefill=trace.first_token_at - planned, behind=behind,
                     send=sent_at - trace.first_token_at, ttft=sent_at - trace.received, steps=trace.steps,
                     chunks=len(trace.chunks), ahead=trace.ahead)


def report(trace: TtftTrace, sent_at: float, log) -> Breakdown | None:
    """Observes the histograms of a first token sent at ``sent_at`` and writes the DEBUG ``request_first_token``
    line (``log``: the request's bound logger), with each chunk as [step, tokens, decode rows, other prefill tokens,
    ms from its plan to its result]."""
    b = breakdown(trace, sent_at)
    if b is None:
        return None
    metrics.REQUEST_TOKENIZE_SECONDS.observe(b.tokenize)
    metrics.REQUEST_QUEUE_SECONDS.observe(b.queue)
    metrics.REQUEST_PREFILL_SECONDS.observe(b.prefill)
    metrics.REQUEST_PREFILL_STEPS.observe(b.steps)
    metrics.REQUEST_FIRST_TOKEN_SEND_SECONDS.observe(b.send)
    log.debug("request_first_token", **b.log_fields(),
              chunks=[[c.step_id, c.tokens, c.decode_rows, c.other_prefill_tokens,
                       round((c.done_at - c.planned_at) * 1e3, 3) if c.done_at else None] for c in trace.chunks[:64]])
    return b
