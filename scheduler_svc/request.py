"""A request's state as the scheduler sees it."""

from __future__ import annotations

import asyncio
import enum
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from scheduler_svc import metrics
from scheduler_svc.detokenizer import IncrementalDetokenizer
from scheduler_svc.logprobs import PromptLogprobs, TopEntry
from scheduler_svc.ttft_trace import TtftTrace


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"  # preempted with its pages in the host tier
    FINISHED = "finished"


class Finish(enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


@dataclass(frozen=True, slots=True)
class Retain:
    """GenerateRequest.retain_kv, checked: when the request ends (stop or length), its KV stays findable by its tenant
    under ``key`` for ``ttl_s`` seconds (retention.py)."""

    key: str
    ttl_s: int


@dataclass(slots=True)
class Sampling:
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: bool = False
    include_stop_str_in_output: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    min_tokens_stop_ids: list[int] = field(default_factory=list)  # stop_token_ids, and EOS unless ignore_eos
    logit_bias: dict[int, float] = field(default_factory=dict)
    allowed_token_ids: list[int] = field(default_factory=list)
    bad_words_ids: list[list[int]] = field(default_factory=list)  # bad_words, tokenized (bad_words_token_ids)
    constraint: object = None  # structured outputs: the executor's pb.Constraint (constraints.py), None: none
    top_logprobs: int = 0  # most likely tokens beside each sampled one's log-probability
    prompt_logprobs: int | None = None  # None: no prompt log-probabilities; k: with k most likely tokens each
    echo: bool = False  # the first message carries the prompt's ids and text


@dataclass(slots=True)
class Output:
    """One message for the client stream."""

    text: str
    token_ids: Sequence[int]  # (a tuple, per token: cheaper than a list)
    logprobs: Sequence[float]
    finish: Finish | None = None
    stop_reason: str = ""
    error: str = ""  # set when the server ends the request abnormally (e.g. the executor failed)
    index: int = 0  # fork index
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    top_logprobs: Sequence[TopEntry] = ()  # per token, when the request asks for top_logprobs
    prompt: PromptLogprobs | None = None  # a message of the prompt's log-probabilities (no tokens)
    error_code: str = ""  # with error: the grpc.StatusCode name the stream ends with ("": UNAVAILABLE, to resume)


class _Run:
    """Tokens of one fork that wait on a stream, to be read as one message."""

    __slots__ = ("index", "texts", "token_ids", "logprobs", "tops")

    def __init__(self, index: int, text: str, token_id: int, logprob: float | None, top: TopEntry | None) -> None:
        self.index, self.texts, self.token_ids = index, [text], [token_id]
        self.logprobs = [] if logprob is None else [logprob]
        self.tops = [] if top is None else [top]


class Outbox:
    """A client stream's messages, in order (a request and its forks share one; ``Output.index`` tells them apart).

    The scheduler puts each sampled token with ``token`` (no message object per token) and every other message
    (a request's final one, an error) with ``put_nowait``. The reader (the Generate handler) takes messages with
    ``get``: the tokens of one fork that arrived one after another while it was away come as one message, and so
    does such a run with the fork's final message right behind it (never an error). A stream that keeps up gets one
    message per token; one that fell behind (a slow client, or more tokens per step than the event loop writes)
    catches up in one write. Nothing is lost or reordered; ``pagedkv_stream_messages_coalesced_total`` counts the
    messages saved. The API of ``asyncio.Queue`` that the server and tests use: get, get_nowait, put_nowait,
    empty, qsize."""

    __slots__ = ("_items", "_tail", "_waiter")

    def __init__(self) -> None:
        self._items: deque[Output | _Run] = deque()
        self._tail: _Run | None = None  # the last item while tokens may still join it
        self._waiter: asyncio.Future | None = None  # the reader's, while it waits

    def token(self, index: int, text: str, token_id: int, logprob: float | None, top: TopEntry | None = None) -> None:
        """One sampled token of fork ``index`` (``logprob`` None: the client did not ask for logprobs; ``top``
        None: nor for top_logprobs)."""
        tail = self._tail
        if tail is not None and tail.index == index:
            tail.texts.append(text)
            tail.token_ids.append(token_id)
            if logprob is not None:
                tail.logprobs.append(logprob)
            if top is not None:
                tail.tops.append(top)
        else:
            self._tail = _Run(index, text, token_id, logprob, top)
            self._items.append(self._tail)
        if self._waiter is not None:
            self._wake()

    def put_nowait(self, out: Output) -> None:
        self._items.append(out)
        self._tail = None
        if self._waiter is not None:
            self._wake()

    def _wake(self) -> None:
        waiter, self._waiter = self._waiter, None
        if not waiter.done():
            waiter.set_result(None)

    def empty(self) -> bool:
        return not self._items

    def qsize(self) -> int:
        return len(self._items)

    async def get(self) -> Output:
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self.get_nowait()

    def get_nowait(self) -> Output:
        items = self._items
        if not items:
            raise asyncio.QueueEmpty
        item = items.popleft()
        if item.__class__ is not _Run:
            return item
        if item is self._tail:
            self._tail = None
        n = len(item.token_ids)
        text = item.texts[0] if n == 1 else "".join(item.texts)
        after = items[0] if items else None
        if (after is not None and after.__class__ is not _Run and after.index == item.index and not after.error
                and after.finish is not None):  # (the fork's final message: one message with the run)
            items.popleft()
            metrics.COALESCED_MESSAGES.inc(n)
            return Output(text + after.text, item.token_ids + list(after.token_ids),
                          item.logprobs + list(after.logprobs), after.finish, after.stop_reason, "", item.index,
                          after.prompt_tokens, after.completion_tokens, after.cached_tokens,
                          item.tops + list(after.top_logprobs))
        if n > 1:
            metrics.COALESCED_MESSAGES.inc(n - 1)
        return Output(text, item.token_ids, item.logprobs, None, "", "", item.index, top_logprobs=item.tops)


@dataclass(slots=True, eq=False)
class Request:
    """One sequence. Each group of fields has one writer, named in its heading; the others only read it."""

    # ---- what the client asked for (the API builds it; nothing changes it after) ------------------
    request_id: str  # internal, never reused (the executor's key)
    prompt_ids: list[int]
    sampling: Sampling
    arrival: int  # admission order; lower is older
    detokenizer: IncrementalDetokenizer  # (outputs.py feeds it)
    priority: int = 0  # lower is more important (preempted last)
    page_budget: int = 0  # most pages this request may hold (0: no limit)
    overflow: str = "window"  # past the budget: "window" or "stop"
    # Attention over the first sink_tokens positions plus the last window_tokens (0: full attention);
    # pages wholly outside leave the table (DROPPED entries), their indices go to the executor once.
    sink_tokens: int = 0
    window_tokens: int = 0
    tenant: str = "default"
    adapter: str = ""  # the LoRA adapter it generates with ("": the base model; adapters.py)
    hash_root: bytes = b""  # its prefix-cache chain root (prefix_cache.request_root: tenant, adapter, window)
    # Parallel sampling: a parent with n > 1 computes prompt[:-1], then forks into n children.
    n: int = 1
    group: str = ""  # the internal id of the client request (shared by its forks)
    client_id: str = ""  # the id the client knows (responses and logs)
    index: int = 0  # fork index
    outbox: Outbox = field(default_factory=Outbox)  # the client stream's messages (Scheduler.process, outputs.deliver)
    # A resumed fork (GenerateRequest.continuation): the output tokens its client had received before, which
    # output_ids starts with (its sampler continues at that draw).
    num_resumed: int = 0
    # The prompt's log-probabilities, gathered as its steps compute them (outputs.py) until complete (sampling's
    # prompt_logprobs; one sequence of the request gathers them: a fork parent, or the first of resumed forks).
    prompt_logprobs: PromptLogprobs | None = None
    retain: Retain | None = None  # keep its KV when it ends (fork 0's only)

    # ---- progress (the planner: scheduler.py; status only in queues.py, its transitions) -------------
    status: Status = Status.WAITING
    output_ids: list[int] = field(default_factory=list)  # (outputs.py appends)
    # tokens whose KV is in this request's pages, counting those of plans in flight (kv_manager.py sets it when
    # pages are given or taken back; the planner counts each step's tokens and takes back those of a lost plan)
    num_computed: int = 0
    max_len: int = 1 << 30  # prompt + output it may reach on its executor (fit.bounds, from its tenant's capacity)
    page_limit: int = 0  # pages a windowed request without a budget holds at most there (fit.bounds)
    budget_hit: bool = False
    last_scheduled: int = 0  # step id of the last plan that computed tokens for it
    swapped_at: int = 0  # step id when it was swapped out (queues.py)
    num_preemptions: int = 0
    num_migrations: int = 0  # moves to another executor (its executor failed or drained)
    num_cached_tokens: int = 0
    # Queueing, in the step ids of the executor that first admitted it: the last plan built there when it was
    # queued, and the plan that admitted it (-1: not yet). Fairness is checked by the order these give (logged
    # with request_finished), not by the clock.
    queued_at_step: int = -1
    admitted_at_step: int = -1
    finish: Finish | None = None
    aborted: bool = False  # the client went away (Cluster.abort): reaped at the next plan

    # ---- pages (kv_manager.py) ---------------------------------------------------------------------
    page_table: list[int] = field(default_factory=list)
    host_table: list[int] = field(default_factory=list)  # host-tier pages while swapped out
    # Prefix cache: the hashes of this request's full pages so far, how many of its pages it has published,
    # and the in-flight hashes it registered (others wait for those).
    page_hashes: list[bytes] = field(default_factory=list)
    num_published: int = 0
    registered: list[bytes] = field(default_factory=list)

    # ---- on the wire --------------------------------------------------------------------------------
    # Pages of its table the executor holds (step_stream.py, as it encodes); -1: the executor does not know this
    # request, or its table changed in place: send it in full (the planner says so when it preempts, moves or
    # copies on write, as the wire does when a plan is rejected).
    num_pages_sent: int = -1
    # Plans in flight (async scheduling: the next plan is built before the last result is read): the tokens
    # they compute (already in num_computed, not yet confirmed) and the tokens they sample (the executor
    # feeds them to the next decode itself; output_ids gets them when the result comes). The planner's: it
    # counts them as it plans a step and takes them back when the step is answered, rejected or lost (``count``,
    # ``uncount``: nowhere else).
    num_inflight_tokens: int = 0
    num_pending: int = 0
    dropped_pending: list[int] = field(default_factory=list)  # dropped page indices not yet sent (planner -> wire)

    # ---- where the first token's time goes (ttft_trace.py: the API stamps arrival, the wire each prefill chunk) ---
    trace: TtftTrace = field(default_factory=TtftTrace)  # (a request's forks share it)

    def __post_init__(self) -> None:
        if not self.group:
            self.group = self.request_id
        if not self.client_id:
            self.client_id = self.request_id

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def compute_target(self) -> int:
        """Tokens to compute before the next sample (a fork parent stops before the last prompt token)."""
        return self.num_tokens - 1 if self.n > 1 else self.num_tokens

    @property
    def num_confirmed(self) -> int:
        """Tokens whose KV the executor confirmed it wrote."""
        return self.num_computed - self.num_inflight_tokens

    @property
    def num_uncomputed(self) -> int:
        """Tokens to compute before the next sample, counting the samples of plans in flight."""
        return self.compute_target + self.num_pending - self.num_computed

    @property
    def computes_prompt_logprobs(self) -> bool:
        """Its prompt's log-probabilities are still to come: its prompt is computed whole (no prefix-cache hit)."""
        return self.prompt_logprobs is not None and not self.prompt_logprobs.complete

    @property
    def in_flight(self) -> bool:
        """A plan in flight computes for it: it may not be admitted or swapped in until that plan is answered."""
        return bool(self.num_inflight_tokens)

    def count(self, n: int, now: int) -> tuple[Request, int, bool]:
        """The planner counts what step ``now`` computes for this request: ``n`` tokens in flight (in ``num_computed``
        at once), and the sample that ends them when they reach it. Returns the step's entry (``step.Scheduled``)."""
        self.num_computed += n
        self.num_inflight_tokens += n
        self.last_scheduled = now
        samples = self.n == 1 and self.num_computed == self.num_tokens + self.num_pending
        if samples:
            self.num_pending += 1
        return self, n, samples

    def uncount(self, n: int, samples: bool) -> None:
        """A step's in-flight counts (``count``'s) leave the request: the step was answered, rejected or lost."""
        self.num_inflight_tokens -= n
        if samples:
            self.num_pending -= 1


def fork(parent: Request, index: int, detokenizer: IncrementalDetokenizer, output_ids: Sequence[int] = ()) -> Request:
    """Fork ``index`` of ``parent`` as a sequence of its own (n = 1): the parent's prompt and settings, sampling
    with seed + index (documented in the API), on the parent's stream. ``output_ids``: the tokens its client already
    received (a resumed request: its sampler continues at draw len(output_ids), ``detokenizer`` has replayed them)."""
    return Request(request_id=f"{parent.request_id}/{index}", prompt_ids=parent.prompt_ids,
                   sampling=replace(parent.sampling, seed=(parent.sampling.seed + index) % (1 << 64)),
                   arrival=parent.arrival, detokenizer=detokenizer, outbox=parent.outbox,
                   tenant=parent.tenant, adapter=parent.adapter, hash_root=parent.hash_root, group=parent.group,
                   index=index, client_id=parent.client_id, priority=parent.priority, page_budget=parent.page_budget,
                   overflow=parent.overflow, sink_tokens=parent.sink_tokens, window_tokens=parent.window_tokens,
                   max_len=parent.max_len, page_limit=parent.page_limit,
                   queued_at_step=parent.queued_at_step, admitted_at_step=parent.admitted_at_step,
                   num_cached_tokens=parent.num_cached_tokens if index == 0 else 0,
                   output_ids=list(output_ids), num_resumed=len(output_ids),
                   retain=parent.retain if index == 0 else None, trace=parent.trace)


def forks(parent: Request) -> list[Request]:
    """The n forks of a parent that has computed its shared prompt: fork i samples with seed + i."""
    return [fork(parent, i, parent.detokenizer.fresh()) for i in range(parent.n)]
