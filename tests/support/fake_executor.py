"""A stand-in executor for scheduler tests: no model, exact bookkeeping, deterministic tokens."""

from __future__ import annotations

import os
import weakref
from collections import deque

from pagedkv.executor.v1 import executor_pb2 as pb
from scheduler_svc.detokenizer import IncrementalDetokenizer
from scheduler_svc.prefix_cache import tenant_root
from scheduler_svc.request import Request, Sampling


class NullTokenizer:
    def decode(self, ids, **_):
        return "".join(chr(97 + i % 26) for i in ids)


def make_request(i: int, prompt_len: int, max_tokens: int, prompt: list[int] | None = None,
                 tenant: str = "default", **kw) -> Request:
    prompt = prompt if prompt is not None else [5] * prompt_len
    return Request(request_id=f"r{i}", prompt_ids=prompt, sampling=Sampling(max_tokens=max_tokens),
                   arrival=i, detokenizer=IncrementalDetokenizer(NullTokenizer(), [], [], False),
                   tenant=tenant, **{"hash_root": tenant_root(tenant), **kw})


def scheduled(plan: pb.StepPlan) -> list[tuple[str, int]]:
    """(request id, tokens scheduled) of every request in a plan: new, continuing, then the packed decodes."""
    return ([(r.request_id, r.num_scheduled_tokens) for r in plan.new_requests]
            + [(c.request_id, c.num_scheduled_tokens) for c in plan.continuing] + [(rid, 1) for rid in plan.decodes])


def sample_seven(request_id: str, position: int) -> int:
    return 7


SAMPLE = sample_seven  # the token 'sampled' at a position (tests may put a deterministic function of both here)


def fake_result(plan: pb.StepPlan, known: dict[str, list]) -> pb.StepResult:
    """A stand-in executor: tracks computed counts and 'samples' SAMPLE(request, position) (token 7 unless a test
    says otherwise) when a request is caught up."""
    result = pb.StepResult(step_id=plan.step_id)
    for rid in plan.forget:
        known.pop(rid, None)
    for new in plan.new_requests:
        known[new.request_id] = [len(new.token_ids), new.num_computed_tokens]
    for row, (rid, n) in enumerate(scheduled(plan)):
        result.num_computed_tokens += n
        total, done = known[rid]
        done += n
        assert done <= total
        if done == total:
            total += 1
            add_sample(result, row, SAMPLE(rid, total))
        known[rid] = [total, done]
    return result


def add_sample(result: pb.StepResult, row: int, token: int, logprob: float = 0.0) -> None:
    """One sampled token for the plan's row ``row`` (rows: new_requests, continuing, then decodes)."""
    result.sampled_rows.append(row)
    result.sampled_token_ids.append(token)
    result.sampled_logprobs.append(logprob)


def samples(plan: pb.StepPlan, result: pb.StepResult) -> list[tuple[str, int, float]]:
    """(request id, token, logprob) of every token a result sampled, in plan order."""
    ids = [rid for rid, _ in scheduled(plan)]
    return [(ids[row], token, lp) for row, token, lp in
            zip(result.sampled_rows, result.sampled_token_ids, result.sampled_logprobs)]


class FakeExecutor:
    """fake_result plus a model of page contents: every KV slot holds a fingerprint of the tokens up to
    its position. Page operations run in the executor's order (swap-out, zero, swap-in, copy); each scheduled
    request must find its earlier positions in its pages, exactly as a real forward would read them.
    A page moved before its contents were written, or overwritten too early, fails here."""

    def __init__(self, block_size: int, known: dict[str, list] | None = None, check_contents: bool = True) -> None:
        self.bs = block_size
        self.known = {} if known is None else known
        self.check_contents = check_contents
        self.device: dict[int, list] = {}
        self.host: dict[int, list] = {}
        self.tables: dict[str, list[int]] = {}
        self.tokens: dict[str, list[int]] = {}
        self.windows: dict[str, tuple[int, int]] = {}  # (sink, window) tokens
        self.pages_moved = 0
        self.pages_zeroed = 0

    @staticmethod
    def _fingerprints(tokens: list[int]) -> list[int]:
        """fp[p] identifies tokens[:p+1] (what the KV at position p depends on)."""
        out, h = [], 0
        for t in tokens:
            h = hash((h, t))
            out.append(h)
        return out

    def _slot(self, rid: str, pos: int) -> tuple[list, int]:
        page = self.device.setdefault(self.tables[rid][pos // self.bs], [None] * self.bs)
        return page, pos % self.bs

    def step(self, plan: pb.StepPlan) -> pb.StepResult:
        if not self.check_contents:
            return fake_result(plan, self.known)
        for rid in plan.forget:
            self.tables.pop(rid, None)
            self.tokens.pop(rid, None)
        ops = plan.page_ops
        for c in ops.swap_out:
            self.host[c.dst] = list(self.device.get(c.src, [None] * self.bs))
        dropping = {c.request_id: set(c.dropped_page_indices) for c in plan.continuing if c.dropped_page_indices}
        for p in ops.zero:  # (a retention's page: no table this plan's forward uses may hold it; this plan's drops
            # have left a window, so nothing reads them)
            assert not any(p == q and i not in dropping.get(rid, ()) for rid, t in self.tables.items()
                           for i, q in enumerate(t)), f"step {plan.step_id}: page {p} zeroed while held"
            self.device[p] = [None] * self.bs
        self.pages_zeroed += len(ops.zero)
        for c in ops.swap_in:
            self.device[c.dst] = list(self.host.get(c.src, [None] * self.bs))
        for c in ops.copy:
            self.device[c.dst] = list(self.device.get(c.src, [None] * self.bs))
        self.pages_moved += len(ops.swap_out) + len(ops.swap_in)
        for new in plan.new_requests:
            self.tables[new.request_id] = list(new.page_ids)
            self.tokens[new.request_id] = list(new.token_ids)
            self.windows[new.request_id] = (new.sink_tokens, new.window_tokens)
        for c in plan.continuing:
            self.tables[c.request_id].extend(c.new_page_ids)
            for i in c.dropped_page_indices:
                self.tables[c.request_id][i] = -1
        starts = {rid: self.known[rid][1] for rid in self.tables if rid in self.known}
        result = fake_result(plan, self.known)
        new_starts = {r.request_id: r.num_computed_tokens for r in plan.new_requests}
        rows = [(rid, n, new_starts[rid] if rid in new_starts else starts[rid], self._fingerprints(self.tokens[rid]))
                for rid, n in scheduled(plan)]
        for rid, n, start, fps in rows:  # as the model does in each layer: every row's K/V written, then attended
            for pos in range(start, start + n):
                page, off = self._slot(rid, pos)
                page[off] = fps[pos]
        for rid, _n, start, fps in rows:
            sink, window = self.windows[rid]
            for pos in range(start):
                if window and sink <= pos <= start - window:
                    continue  # outside the attention window of every query of this step
                assert self.tables[rid][pos // self.bs] != -1, f"{rid}: position {pos} visible but its page dropped"
                page, off = self._slot(rid, pos)
                assert page[off] == fps[pos], f"step {plan.step_id}: {rid} reads wrong KV at position {pos}"
        for rid, token, _ in samples(plan, result):
            self.tokens[rid].append(token)
        return result


_EXECUTORS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


# Async scheduling, as the engine runs it by default: the next plan is built (and run) before the last result is
# processed. PAGEDKV_TEST_OVERLAP=0 drives one plan at a time.
OVERLAP = os.environ.get("PAGEDKV_TEST_OVERLAP", "1") != "0"


def drive(s, max_steps: int = 10_000, known: dict[str, list] | None = None,
          executor: FakeExecutor | None = None, on_step=None, feed_ticks: int = 0,
          overlap: bool | None = None) -> list:
    """Runs the scheduler against a FakeExecutor (page contents checked unless ``known`` comes from
    earlier steps the executor did not see) until nothing is left; returns the finished requests. With
    ``overlap`` (default: OVERLAP) each plan is built while the one before it is still unanswered, as the
    engine's async scheduling does; the executor runs plans in order, as a real one would."""
    overlap = OVERLAP if overlap is None else overlap
    if executor is None and known is None:
        executor = _EXECUTORS.setdefault(s, FakeExecutor(s.pool.block_size))  # one per scheduler: pages persist
    elif executor is None:
        executor = FakeExecutor(s.pool.block_size, known, check_contents=False)
    finished = []
    unanswered: deque = deque()  # results the executor gave that the scheduler has not processed yet
    ticks = 0  # loop turns; on_step(s) adds work for feed_ticks of them
    for _ in range(max_steps):
        if on_step is not None:
            on_step(s)
        plan, outs = s.schedule()
        finished += [req for req, o in outs if o.finish is not None]
        if plan is None and unanswered:
            outs = s.process(unanswered.popleft())
            s.check_integrity()
            finished += [req for req, o in outs if o.finish is not None]
            continue
        if plan is None and not s.has_work:
            if on_step is not None and ticks < feed_ticks:
                ticks += 1
                continue  # idle, but more work is coming
            break
        ticks += 1
        assert plan is not None
        assert sum(n for _, n in scheduled(plan)) <= s.config.max_num_batched_tokens
        assert len(s.running) <= s.config.max_num_seqs
        unanswered.append(executor.step(plan))
        if len(unanswered) > (1 if overlap else 0):
            outs = s.process(unanswered.popleft())
            finished += [req for req, o in outs if o.finish is not None]
        s.check_integrity()
    while unanswered:  # (max_steps ran out with a plan in flight: its result still counts)
        outs = s.process(unanswered.popleft())
        s.check_integrity()
        finished += [req for req, o in outs if o.finish is not None]
    return finished


