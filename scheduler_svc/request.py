"""A request's state as the scheduler sees it."""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

from scheduler_svc.detokenizer import IncrementalDetokenizer


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"  # preempted with its pages in the host tier
    FINISHED = "finished"


class Finish(enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


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
    hash_root: bytes = b""  # the tenant's prefix-cache chain root (a windowed request's own)
    # Parallel sampling: a parent with n > 1 computes prompt[:-1], then forks into n children.
    n: int = 1
    group: str = ""  # the internal id of the client request (shared by its forks)
    client_id: str = ""  # the id the client knows (responses and logs)
    index: int = 0  # fork index
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)  # the client stream's messages (outputs.deliver)

    # ---- progress (the scheduler: scheduler.py, admission.py, lifecycle.py) ------------------------
    status: Status = Status.WAITING
    output_ids: list[int] = field(default_factory=list)  # (outputs.py appends)
    num_computed: int = 0  # tokens whose KV is in this request's pages, counting those of plans in flight
    max_len: int = 1 << 30  # prompt + output it may reach (from its tenant's capacity: tenant_limits.apply)
    page_limit: int = 0  # pages a windowed request without a budget holds at most (tenant_limits.apply)
    budget_hit: bool = False
    last_scheduled: int = 0  # step id of the last plan that computed tokens for it (executor_session.py)
    swapped_at: int = 0  # step id when it was swapped out
    num_preemptions: int = 0
    num_migrations: int = 0  # moves to another executor (its executor failed or drained)
    num_cached_tokens: int = 0
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

    # ---- on the wire (executor_session.py) ---------------------------------------------------------
    num_pages_sent: int = -1  # -1: the executor does not know this request (send it in full)
    # Plans in flight (async scheduling: the next plan is built before the last result is read): the tokens
    # they compute (already in num_computed, not yet confirmed) and the tokens they sample (the executor
    # feeds them to the next decode itself; output_ids gets them when the result comes).
    num_inflight_tokens: int = 0
    num_pending: int = 0
    dropped_pending: list[int] = field(default_factory=list)  # dropped page indices not yet sent

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
    def in_flight(self) -> bool:
        """A plan in flight computes for it: it may not be admitted or swapped in until that plan is answered."""
        return bool(self.num_inflight_tokens)
