"""The matchers' work of a step, on threads of its own, each row within a CPU budget.

A constrained row that samples this step needs its matcher to accept the tokens sampled since it last ran (for a
request sent in full: all its output tokens, the replay) and then to fill its bitmask. That work is one job per row,
started before the forward and run on ``MatcherPool``'s threads (xgrammar releases the GIL), so it overlaps the
forward; sampling then waits for the jobs (``StepGrammar.wait``), each only while its CPU stays within its budget:

- a row's job may use ``step_budget_s`` of CPU (a replay ``replay_allowance`` per token more);
- the jobs of one scope (a tenant) may use ``tenant_budget_s`` together in a step, replays aside.

A job past either ends its request (the error names the flag), and sampling goes on without it at once: the job is
abandoned to finish on its own thread (a fresh thread takes its place) and its matcher is never used again. A
grammar's per-token cost can grow with each token (an ambiguous grammar's matcher state does), so a request is ended
at the first step past its budget, not after it has slowed everyone for minutes. The CPU is each job's own thread's
(``pthread_getcpuclockid``), not wall time: a job that waited for a core is not charged for the wait.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from executor_svc.grammar import DEFAULT_STEP_BUDGET_MS, DEFAULT_TENANT_BUDGET_MS, FIELD, Key, new_matcher
from executor_svc.grammar_mask import GrammarMask

REPLAY_TOKENS_PER_BUDGET = 16  # a replay's allowance: a step budget per this many tokens replayed


@dataclass(slots=True, eq=False)
class GrammarState:
    """One constrained request's matcher on this executor. ``pending``: tokens it has yet to accept (the first
    ``replay`` of them the request's outputs when it was sent in full); ``failed``: why the executor ended it."""

    key: Key
    compiled: object
    end_token_ids: tuple[int, ...]
    words: int  # int32 words of a bitmask row
    pending: list[int] = field(default_factory=list)
    replay: int = 0
    matcher: object = None
    terminated: bool = False  # it accepted an end token: nothing follows (sampled unconstrained)
    failed: str = ""
    reported: bool = False  # its failure went out in a result
    bitmask: torch.Tensor | None = None  # [1, words] int32, its own (an abandoned job may still write to it)
    cpu_s: float = 0.0  # its matcher's CPU so far


@dataclass(slots=True, eq=False)
class Job:
    """One row's work in a step."""

    index: int  # the row's index among the step's sampled rows
    state: GrammarState
    tokens: list[int]
    replay: int  # of tokens, how many are a replay of outputs
    limit_s: float  # CPU budget
    allowance_s: float  # of it, what a replay may use beyond the step budget (outside the tenant's budget)
    cpu_s: float = 0.0  # when done
    done: bool = False
    counted: bool = False  # its step no longer waits for it (done, or given up)
    error: str = ""
    refused: int = 0  # sampled tokens the matcher refused (none unless a bug)


@dataclass(slots=True, eq=False)
class Chunk:
    """Rows a thread runs one after another (fewer hand-offs than a row each): ``jobs[at:stop]``."""

    step: StepGrammar
    jobs: list[Job]
    stop: int
    at: int = 0  # the job it runs now (or next)
    clock: int | None = None  # its thread's CPU clock, once a thread runs it (Linux's are negative numbers)
    cpu0: float = 0.0  # that clock when the job at ``at`` started
    abandoned: bool = False  # its job at ``at`` was given up: the thread ends when that call returns

    def used(self) -> float:
        """CPU of the job at ``at`` so far."""
        try:
            return time.clock_gettime(self.clock) - self.cpu0
        except OSError:  # (its thread just ended)
            return 0.0


class MatcherPool:
    """Threads that run chunks of matcher jobs, taken from one queue. A job given up past its budget ends its
    thread's chunk there: the rest of the chunk goes back on the queue and a fresh thread takes the place of the one
    still in that job's call, which ends when the call returns."""

    def __init__(self, threads: int = 2) -> None:
        self._cond = threading.Condition()
        self._queue: deque[Chunk] = deque()
        self._threads = 0
        self._retiring = 0  # threads that end once their abandoned job returns
        self.running: dict[int, Chunk] = {}  # by thread: the chunk each runs now (what a waiting step looks at)
        self.abandoned = 0  # jobs given up while they ran, since start
        for _ in range(max(1, threads)):
            self._spawn()

    @property
    def threads(self) -> int:
        """Threads that run jobs now (those retiring after an abandoned job aside)."""
        return self._threads - self._retiring

    def _spawn(self) -> None:
        self._threads += 1
        threading.Thread(target=self._loop, name=f"grammar-match-{self._threads}", daemon=True).start()

    def submit(self, jobs: Sequence[Job], step: StepGrammar) -> None:
        """Jobs in chunks, a few per thread (so that one slow row delays few)."""
        size = max(1, -(-len(jobs) // (4 * max(1, self.threads))))
        self._queue.extend(Chunk(step, list(jobs[i:i + size]), min(size, len(jobs) - i))
                           for i in range(0, len(jobs), size))
        with self._cond:
            self._cond.notify_all()

    def _loop(self) -> None:
        ident = threading.get_ident()
        clock = time.pthread_getcpuclockid(ident)
        while True:
            with self._cond:
                while not self._queue:
                    self._cond.wait()
            while True:
                try:
                    chunk = self._queue.popleft()
                except IndexError:
                    break
                if self._run_chunk(chunk, ident, clock):
                    return

    def _run_chunk(self, chunk: Chunk, ident: int, clock: int) -> bool:
        """Runs the chunk's jobs; True when this thread must end (its job was given up mid-call)."""
        cond = self._cond
        with cond:
            chunk.clock = clock
            self.running[ident] = chunk
        while True:
            with cond:
                if chunk.at >= chunk.stop:
                    del self.running[ident]
                    return False
                job = chunk.jobs[chunk.at]
                chunk.cpu0 = time.clock_gettime(clock)
            _run(job)
            with cond:
                job.cpu_s = time.clock_gettime(clock) - chunk.cpu0
                job.done = True
                retire = chunk.abandoned and self._retiring > 0
                if retire:
                    self._retiring -= 1
                    self._threads -= 1
                    del self.running[ident]
                else:
                    chunk.at += 1
            chunk.step.finished(job)
            if retire:
                return True

    def give_up(self, chunk: Chunk, job: Job) -> bool:
        """``job`` (the one ``chunk`` runs now) is past its budget: nobody waits for it; the chunk's other jobs go
        back on the queue, a fresh thread takes its thread's place. False if it was done meanwhile."""
        with self._cond:
            if job.done or chunk.abandoned or chunk.jobs[chunk.at] is not job:
                return False
            chunk.abandoned = True
            rest = chunk.jobs[chunk.at + 1:chunk.stop]
            chunk.stop = chunk.at + 1
            if rest:
                self._queue.appendleft(Chunk(chunk.step, rest, len(rest)))
            self.abandoned += 1
            self._retiring += 1
            self._spawn()
            self._cond.notify_all()
            return True


def _run(job: Job) -> None:
    """Accepts the job's tokens, then fills the row's mask (on a matcher thread; xgrammar releases the GIL)."""
    st = job.state
    try:
        if st.matcher is None:
            st.matcher = new_matcher(st.compiled, st.end_token_ids)
        matcher = st.matcher
        accept = matcher.accept_token
        for i, token in enumerate(job.tokens):
            if not accept(token):
                if matcher.is_terminated():  # (tokens after its end: the request ended there)
                    break
                if i < job.replay:
                    job.error = f"output token {i} ({token}) does not follow its {FIELD}"
                    return
                job.refused += 1
        st.terminated = matcher.is_terminated()
        if not st.terminated:
            matcher.fill_next_token_bitmask(st.bitmask, 0)
    except Exception as err:  # noqa: BLE001 -- xgrammar's errors end the request, never the step
        job.error = f"{FIELD}: the grammar matcher failed ({type(err).__name__}: {err})"


class StepGrammar:
    """One step's matcher jobs: ``start`` them before the forward, ``wait`` for them before sampling."""

    def __init__(self, pool: MatcherPool, step_budget_s: float, tenant_budget_s: float) -> None:
        self.pool = pool
        self.step_budget_s = step_budget_s
        self.tenant_budget_s = tenant_budget_s
        self.jobs: dict[int, Job] = {}  # by the index of the row among the step's sampled rows
        self.wait_s = 0.0
        self._lock = threading.Lock()
        self._left = 0  # jobs it still waits for
        self._all_done = threading.Event()
        self._scope_cpu: dict[str, float] = {}  # CPU of the jobs done, per scope (replay allowances aside)
        self._scope_left: dict[str, int] = {}  # jobs not done, per scope

    def start(self, states: Sequence[GrammarState | None]) -> None:
        """Jobs for the rows that have a live matcher (``states[i]`` None: unconstrained)."""
        budget = self.step_budget_s
        for i, st in enumerate(states):
            if st is None or st.failed or (st.terminated and not st.pending):
                continue
            if st.bitmask is None:
                st.bitmask = torch.empty(1, st.words, dtype=torch.int32)
            tokens, replay = st.pending, st.replay
            st.pending, st.replay = [], 0
            allowance = budget * replay / REPLAY_TOKENS_PER_BUDGET
            self.jobs[i] = Job(i, st, tokens, replay, budget + allowance, allowance)
            self._scope_left[st.key.scope] = self._scope_left.get(st.key.scope, 0) + 1
        self._left = len(self.jobs)
        if self.jobs:
            self.pool.submit(list(self.jobs.values()), self)
        else:
            self._all_done.set()

    def finished(self, job: Job) -> None:
        """``job`` is done, or given up: the step waits for it no more."""
        with self._lock:
            if job.counted:
                return
            job.counted = True
            self._scope_left[job.state.key.scope] -= 1
            if job.done:
                scope = job.state.key.scope
                self._scope_cpu[scope] = self._scope_cpu.get(scope, 0.0) + max(0.0, job.cpu_s - job.allowance_s)
            self._left -= 1
            if not self._left:
                self._all_done.set()

    def wait(self) -> tuple[GrammarMask | None, dict[int, str]]:
        """Waits for every job to end or pass its budget; returns the mask of the rows whose matcher allows only some
        tokens (None: no such row), and the rows whose request the executor ends, with why."""
        started = time.perf_counter()
        failed: dict[int, str] = {}
        while not self._all_done.is_set():
            if self._all_done.wait(max(self._budgets(failed), 2e-4)):
                break
        self.wait_s = time.perf_counter() - started
        rows, masks = [], []
        for i, job in self.jobs.items():
            st = job.state
            st.cpu_s += job.cpu_s
            if i in failed or job.error:
                st.failed = failed.get(i) or job.error
                failed[i] = st.failed
            elif not st.terminated:
                rows.append(i)
                masks.append(st.bitmask)
        return (GrammarMask(rows, torch.cat(masks)) if rows else None), failed

    def _give_up(self, chunk: Chunk, job: Job, failed: dict[int, str], why: str) -> None:
        used = chunk.used()
        if self.pool.give_up(chunk, job):
            job.cpu_s = used  # (what it used so far: charged, though its call goes on)
            failed[job.index] = why
            self.finished(job)

    def _budgets(self, failed: dict[int, str]) -> float:
        """Gives up the running jobs past a budget (their rows into ``failed``); returns the least CPU any job still
        running may use before it passes one (it cannot pass one sooner in wall time)."""
        nearest = self.step_budget_s
        by_scope: dict[str, list[tuple[float, Chunk, Job]]] = {}
        for chunk in list(self.pool.running.values()):
            if chunk.step is not self or chunk.abandoned or chunk.at >= chunk.stop:
                continue
            job = chunk.jobs[chunk.at]
            used = chunk.used()
            if job.done:
                continue
            if used > job.limit_s:
                self._give_up(chunk, job, failed, f"{FIELD}: its grammar's matcher took {used * 1e3:.1f} ms of CPU in "
                              f"one step; the limit is {job.limit_s * 1e3:g} ms (--grammar-step-budget-ms)")
                continue
            nearest = min(nearest, job.limit_s - used)
            by_scope.setdefault(job.state.key.scope, []).append((max(0.0, used - job.allowance_s), chunk, job))
        threads = max(1, self.pool.threads)
        for scope, left in self._scope_left.items():
            if not left:
                continue
            running = by_scope.get(scope, [])
            total = self._scope_cpu.get(scope, 0.0) + sum(u for u, _, _ in running)
            while running and total > self.tenant_budget_s:
                costliest = max(running, key=lambda r: r[0])
                running.remove(costliest)
                self._give_up(costliest[1], costliest[2], failed, f"{FIELD}: its tenant's grammar matchers took "
                              f"{total * 1e3:.1f} ms of CPU in one step; the limit is "
                              f"{self.tenant_budget_s * 1e3:g} ms (--grammar-tenant-step-budget-ms)")
                total -= costliest[0]
            # (its jobs not done spend at most one CPU second a second each, on no more threads than run)
            nearest = min(nearest, max(0.0, self.tenant_budget_s - total) / min(max(1, left), threads))
        return nearest

    def cpu_us(self) -> list[tuple[int, int]]:
        """(row index, CPU in microseconds) of each job this step."""
        return [(i, int(job.cpu_s * 1e6)) for i, job in self.jobs.items()]


class Matchers:
    """The executor's matcher threads and budgets (--grammar-threads, --grammar-step-budget-ms,
    --grammar-tenant-step-budget-ms): a ``StepGrammar`` per step."""

    def __init__(self, threads: int = 2, step_budget_ms: float = DEFAULT_STEP_BUDGET_MS,
                 tenant_budget_ms: float = DEFAULT_TENANT_BUDGET_MS) -> None:
        self.pool = MatcherPool(threads)
        self.step_budget_s = step_budget_ms / 1e3
        self.tenant_budget_s = tenant_budget_ms / 1e3

    def step(self) -> StepGrammar:
        return StepGrammar(self.pool, self.step_budget_s, self.tenant_budget_s)
