"""From sampled tokens to client messages: detokenizing, stop checks, finish reasons, delivery.

``OutputProcessor.on_token`` appends one sampled token to a request and decides whether it ends the request
(a stop token or EOS, a stop string, max_tokens or max_len, the 'stop' policy of a page budget); the scheduler
then frees what the request held; a request that goes on gets the text it can stream now. ``take_samples`` does
that for every token a step sampled. ``final`` is the one door every request ending goes through: it builds the last
message of a request (what it holds depends on who ends it: ``Ending``) and marks the request finished. ``deliver``
puts messages on the clients' streams and counts them.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

from scheduler_svc import metrics
from scheduler_svc.fit import pages_for
from scheduler_svc.logprobs import NO_TOP, sampled_tops
from scheduler_svc.request import Finish, Output, Request, Status


@dataclass(slots=True)
class TokenOutcome:
    finish: Finish
    stop_reason: str = ""
    budget_hit: bool = False  # it ended at its page budget ('stop' policy)
    error: str = ""  # the executor ended it (StepResult.failed_rows): a client error, INVALID_ARGUMENT


class OutputProcessor:
    def __init__(self, eos_token_ids: set[int], block_size: int) -> None:
        self.eos = eos_token_ids
        self.block_size = block_size

    def on_token(self, req: Request, token: int) -> str | TokenOutcome:
        """Appends token to req's output and text. Returns why it ends req (then ``final`` has the text left), or,
        when req goes on, the text it can stream now (``req.detokenizer.take(False)``)."""
        output_ids = req.output_ids
        output_ids.append(token)
        s = req.sampling
        detokenizer = req.detokenizer
        if token in s.stop_token_ids or (not s.ignore_eos and token in self.eos):
            detokenizer.add(token, emit_text=False)
            return TokenOutcome(Finish.STOP, str(token))
        num_outputs = len(output_ids)
        num_tokens = len(req.prompt_ids) + num_outputs
        if num_outputs < s.max_tokens and num_tokens < req.max_len and not req.page_budget:  # (no length end)
            text = detokenizer.push(token)
            if text is not None:
                return text
        detokenizer.add(token)
        if detokenizer.stopped_by is not None:
            return TokenOutcome(Finish.STOP, detokenizer.stopped_by)
        outcome = self.length_end(req, num_tokens, num_outputs)
        return detokenizer.take(False) if outcome is None else outcome

    def length_end(self, req: Request, num_tokens: int, num_outputs: int) -> TokenOutcome | None:
        """Whether a request holding ``num_tokens`` tokens, ``num_outputs`` of them sampled, has reached its length:
        max_tokens, max_len, or (the 'stop' policy) the page budget the next token's KV would exceed. The one rule
        for a sampled token (on_token) and for planning past a sample still in flight (the scheduler)."""
        if num_outputs >= req.sampling.max_tokens or num_tokens >= req.max_len:
            return TokenOutcome(Finish.LENGTH)
        if (req.page_budget and req.overflow == "stop"
                and pages_for(num_tokens, self.block_size) > req.page_budget):
            return TokenOutcome(Finish.LENGTH, f"page_budget: {req.page_budget} pages reached", budget_hit=True)
        return None

    def take_samples(self, rows: list[Request], result, charge: Callable[..., None],
                     end: Callable[[Request, TokenOutcome], Output]) -> list[tuple[Request, Output]]:
        """The tokens a step sampled (``result``: a StepResult; ``rows``: its plan's requests by row), each appended to
        its request: one that goes on streams straight to its request's outbox (``Outbox.token``); one that ends its
        request ends it (``end``: the planner frees what it held and returns its final message, which gets the token).
        Output tokens are charged to their tenants (``charge``), once per tenant, before a finish (it may idle the
        tenant). A request that ended, was aborted or forked (a parent's sample is unused) takes none. Returns the
        messages of the requests that ended. Prompt log-probabilities come first (``take_prompt_logprobs``); a sample's
        most likely tokens go with it to a request that asks for them (top_logprobs)."""
        if result.prompt_logprobs:
            self.take_prompt_logprobs(rows, result.prompt_logprobs)
        outputs = []
        on_token, finished = self.on_token, Status.FINISHED
        charged: dict[str, int] = {}
        streamed = 0
        tops = sampled_tops(result, [r.sampling.top_logprobs for r in rows]) if result.sampled_top_token_ids else None
        for row, token, logprob in zip(result.sampled_rows, result.sampled_token_ids, result.sampled_logprobs):
            req = rows[row]  # (rows checked by the wire: StepStream.malformed)
            if req.status is finished or req.aborted or req.n > 1:
                continue
            tenant = req.tenant
            charged[tenant] = charged.get(tenant, 0) + 1
            outcome = on_token(req, token)
            # (a request asking for top_logprobs gets an entry per token: none from the executor, an empty one)
            top = None if not req.sampling.top_logprobs else tops.get(row, NO_TOP) if tops else NO_TOP
            if outcome.__class__ is str:  # it goes on: its token and the text to stream, straight to its stream
                req.outbox.token(req.index, outcome, token, logprob if req.sampling.logprobs else None, top)
                streamed += 1
                continue
            charge(tenant, output_tokens=charged.pop(tenant))
            out = end(req, outcome)
            out.token_ids, out.logprobs = [token], ([logprob] if req.sampling.logprobs else [])
            out.top_logprobs = [] if top is None else [top]
            outputs.append((req, out))
        for tenant, k in charged.items():
            charge(tenant, output_tokens=k)
        if streamed:
            metrics.GENERATED_TOKENS.inc(streamed)
        if result.grammar_rows:
            self.take_grammar_costs(rows, result, charge)
        for row, error in zip(result.failed_rows, result.failed_errors):
            req = rows[row]
            if req.status is not finished and not req.aborted:  # (ended meanwhile: nothing to say)
                out = end(req, TokenOutcome(Finish.ABORT, error=error))
                out.error_code = "INVALID_ARGUMENT"
                outputs.append((req, out))
        return outputs

    @staticmethod
    def take_grammar_costs(rows: list[Request], result, charge: Callable[..., None]) -> None:
        """The CPU the constrained rows' grammar matchers used this step, charged to their tenants."""
        by_tenant: dict[str, float] = {}
        for row, cpu_us in zip(result.grammar_rows, result.grammar_cpu_us):
            tenant = rows[row].tenant
            by_tenant[tenant] = by_tenant.get(tenant, 0.0) + cpu_us / 1e6
        for tenant, cpu_s in by_tenant.items():
            charge(tenant, grammar_cpu_s=cpu_s)
            metrics.GRAMMAR_CPU_SECONDS.labels(tenant, "match").inc(cpu_s)

    @staticmethod
    def take_prompt_logprobs(rows: list[Request], entries) -> None:
        """Prompt log-probabilities a step computed (StepResult.prompt_logprobs, checked by the wire), each into its
        request's ``PromptLogprobs``; once a request holds all of its prompt's, they go to its stream in a message of
        their own, before any of its tokens (a fork parent's, the fork 0 message of the stream its forks share)."""
        for entry in entries:
            req = rows[entry.row]
            held = req.prompt_logprobs
            if held is None or req.aborted:
                continue
            if held.add(entry.first_token, entry.logprobs, entry.top_token_ids, entry.top_logprobs, entry.ranks):
                req.outbox.put_nowait(Output("", [], [], index=req.index, prompt=held))


class Ending(enum.Enum):
    """Who ends a request, which decides what its final message holds (``final``). A stream that is cut may still
    have its request on a planner: it is not marked finished there (the planner ends it when it reaps it)."""

    PLANNER = "planner"  # its planner (Scheduler.finish): the text left, flushed unless aborted, and its usage
    UNPLACED = "unplaced"  # before any planner took it (held unplaced, its grammar refused): its usage, no text
    CUT = "cut"  # its stream is cut (the scheduler shuts down, its key was revoked): the error alone


def final(req: Request, finish: Finish, stop_reason: str = "", error: str = "", error_code: str = "",
          ending: Ending = Ending.PLANNER) -> Output:
    """The one door every request ending goes through: the last message of ``req``, which is marked finished
    (``req.finish``; its planner moved it out of its queues already), unless its stream is only cut (``Ending.CUT``).
    ``error_code``: with ``error``, the grpc.StatusCode name the stream ends with ("": UNAVAILABLE)."""
    if ending is Ending.CUT:
        return Output("", [], [], finish, stop_reason, error, index=req.index, error_code=error_code)
    req.finish = finish
    if ending is Ending.UNPLACED:
        return Output("", [], [], finish, stop_reason, error, index=req.index, prompt_tokens=len(req.prompt_ids),
                      completion_tokens=len(req.output_ids), error_code=error_code)
    if finish is not Finish.ABORT:
        req.detokenizer.flush()
    return Output(req.detokenizer.take(final=True), [], [], finish, stop_reason, error, index=req.index,
                  prompt_tokens=len(req.prompt_ids), completion_tokens=len(req.output_ids),
                  cached_tokens=req.num_cached_tokens, error_code=error_code)


def deliver(outputs: list[tuple[Request, Output]]) -> None:
    """Puts each message on its client's stream."""
    tokens = 0
    for req, out in outputs:
        req.outbox.put_nowait(out)
        tokens += len(out.token_ids)
        if out.finish is not None:
            metrics.FINISHED.labels(out.finish.value).inc()
    if tokens:
        metrics.GENERATED_TOKENS.inc(tokens)

