"""The simulation behind kv_strategies.py: one row's result, the reserving strategies (contiguous, bucketing) by
simple arithmetic, and the paged rows through scheduler_svc's real page pool and KV manager."""

from __future__ import annotations

import statistics
import sys
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # this tree's scheduler_svc, not whichever one is installed
    sys.path.insert(0, str(ROOT))

from kv_strategies_trace import FIRST_ID, TraceRequest  # noqa: E402

from pagedkv.wire import DROPPED_PAGE  # noqa: E402
from scheduler_svc.detokenizer import IncrementalDetokenizer  # noqa: E402
from scheduler_svc.kv_manager import KVManager  # noqa: E402
from scheduler_svc.pages import PagePool, held  # noqa: E402
from scheduler_svc.prefix_cache import tenant_root  # noqa: E402
from scheduler_svc.request import Request, Sampling  # noqa: E402

WATERMARK = 0.01  # share of pages kept free at admission (SchedulerConfig.watermark)


# ---- results --------------------------------------------------------------------------------------------
@dataclass(slots=True)
class RowResult:
    strategy: str
    kind: str  # key of SEED_CLAIMS
    block_size: int = 0
    steps: int = 0
    filled_slot_steps: int = 0
    allocated_slot_steps: int = 0
    logical_token_steps: int = 0
    max_concurrency: int = 0
    saturated_concurrency: list[int] = field(default_factory=list)
    saturated_allocated_slots: int = 0
    peak_allocated_slots: int = 0
    preemptions: int = 0
    prefix_tokens_reused: int = 0
    timeline: list[tuple[int, float, int]] = field(default_factory=list)  # (step, utilization, running)

    def sample(self, filled: int, allocated: int, logical: int, running: int, saturated: bool) -> None:
        self.steps += 1
        self.filled_slot_steps += filled
        self.allocated_slot_steps += allocated
        self.logical_token_steps += logical
        self.max_concurrency = max(self.max_concurrency, running)
        self.peak_allocated_slots = max(self.peak_allocated_slots, allocated)
        if saturated:
            self.saturated_concurrency.append(running)
            self.saturated_allocated_slots += allocated
        self.timeline.append((self.steps, filled / allocated if allocated else float("nan"), running))

    def summary(self) -> dict[str, Any]:
        alloc = self.allocated_slot_steps
        sat = self.saturated_concurrency
        return {"strategy": self.strategy, "kind": self.kind, "block_size": self.block_size, "steps": self.steps,
                "utilization": self.filled_slot_steps / alloc if alloc else None,
                "logical_tokens_per_slot": self.logical_token_steps / alloc if alloc else None,
                "max_concurrency": self.max_concurrency,
                "mean_saturated_concurrency": statistics.fmean(sat) if sat else None,
                "saturated_steps": len(sat), "peak_allocated_slots": self.peak_allocated_slots,
                "mean_allocated_slots": alloc / self.steps if self.steps else None,
                "slots_per_running_request": self.saturated_allocated_slots / sum(sat) if sat and sum(sat) else None,
                "preemptions": self.preemptions, "prefix_tokens_reused": self.prefix_tokens_reused}


# ---- contiguous and bucketing: reservations, simple arithmetic ------------------------------------------
def run_reserving(trace: list[TraceRequest], name: str, kind: str, slots_of: Callable[[TraceRequest], int],
                  budget: int) -> RowResult:
    """Each request reserves slots_of(req) slots from admission to its end; it holds its computed tokens."""
    res = RowResult(name, kind)
    waiting = deque(trace)
    running: list[list[int]] = []  # [reserved, computed, sampled, output_len, prompt_len]
    free = budget
    while waiting or running:
        while waiting and slots_of(waiting[0]) <= free:
            r = waiting.popleft()
            free -= slots_of(r)
            running.append([slots_of(r), 0, 0, r.output_len, len(r.prompt)])
        for st in running:  # the first step computes the prompt, each later one the token sampled last
            st[1] = st[4] if st[2] == 0 else st[1] + 1
            st[2] += 1
        for st in [s for s in running if s[2] == s[3]]:
            running.remove(st)
            free += st[0]
        res.sample(sum(s[1] for s in running), sum(s[0] for s in running), sum(s[1] for s in running),
                   len(running), bool(waiting))
    return res


def bucket_of(buckets: tuple[int, ...]) -> Callable[[TraceRequest], int]:
    def slots(r: TraceRequest) -> int:
        need = len(r.prompt) + r.output_len
        return next(b for b in buckets if b >= need)

    return slots


# ---- paged rows: the real page pool and KV manager -----------------------------------------------------
class _NoTokenizer:
    def decode(self, ids: list[int], **_: Any) -> str:
        return ""


def _request(r: TraceRequest, window: int, sink: int, page_limit: int) -> Request:
    return Request(request_id=f"r{r.index}", prompt_ids=list(r.prompt), sampling=Sampling(max_tokens=r.output_len),
                   arrival=r.index, detokenizer=IncrementalDetokenizer(_NoTokenizer(), [], [], False),
                   hash_root=tenant_root("default"), window_tokens=window, sink_tokens=sink, page_limit=page_limit)


def _sampled_token(req: Request, vocab_size: int) -> int:
    """A stand-in for the model: a fixed id per (request, position), so outputs never look shared."""
    return FIRST_ID + (req.arrival * 7919 + len(req.output_ids) * 104729) % (vocab_size - FIRST_ID)


@dataclass(frozen=True, slots=True)
class PagedConfig:
    block_size: int
    prefix_caching: bool = False
    window: int = 0  # attention window in tokens (0: full attention)
    sink: int = 0
    prefill_chunk: int = 512  # with a window: the page limit leaves room for a chunk this long


def run_paged(trace: list[TraceRequest], name: str, kind: str, cfg: PagedConfig, budget: int,
              check_integrity: bool = False, vocab_size: int = 32000) -> RowResult:
    bs = cfg.block_size
    pool = PagePool(budget // bs, bs)
    kv = KVManager(pool, enable_prefix_caching=cfg.prefix_caching)
    limit = (-(-cfg.sink // bs) + -(-cfg.window // bs) + 2 + -(-cfg.prefill_chunk // bs)) if cfg.window else 0
    reqs = {r.index: _request(r, cfg.window, cfg.sink, limit) for r in trace}
    out_len = {r.index: r.output_len for r in trace}
    waiting: deque[Request] = deque(reqs.values())
    running: list[Request] = []
    res = RowResult(name, kind, bs)
    watermark = max(1, int(WATERMARK * pool.num_pages))

    preempted: set[str] = set()  # this step's victims

    def preempt(victim: Request) -> None:
        running.pop() if running[-1] is victim else running.remove(victim)
        kv.release(victim)  # recomputed later: prompt + output so far
        waiting.appendleft(victim)
        preempted.add(victim.request_id)
        res.preemptions += 1

    while waiting or running:
        scheduled: list[tuple[Request, int]] = []
        preempted.clear()
        for req in list(running):  # oldest first; victims are the newest
            if req.request_id in preempted:
                continue
            kv.drop_outside_window(req)
            n = kv.window_chunk_limit(req, req.num_uncomputed)
            while kv.pages_to_grow(req, n) > pool.num_free and running[-1] is not req:
                preempt(running[-1])
            if kv.pages_to_grow(req, n) > pool.num_free:
                preempt(req)
                continue
            kv.grow(req, n)
            scheduled.append((req, n))
        held_back: list[Request] = []  # their prefix is being computed by another request: they wait a step
        out_of_room = False
        while waiting:
            req = waiting[0]
            hits = kv.find_hits(req)
            if kv.waits_for_inflight(req, len(hits)):
                held_back.append(waiting.popleft())
                continue
            n = kv.window_chunk_limit(req, req.compute_target - len(hits) * bs)
            if kv.pages_to_admit(hits, n) > pool.num_free - watermark:
                out_of_room = True
                break
            waiting.popleft()
            kv.admit(req, hits, n)
            res.prefix_tokens_reused += len(hits) * bs
            running.append(req)
            scheduled.append((req, n))
        waiting.extendleft(reversed(held_back))
        if not scheduled:
            raise RuntimeError(f"{name}: no progress with {len(waiting)} waiting (a request does not fit the budget)")
        finished = set()
        for req, n in scheduled:  # the "forward": tokens computed, then one sampled when caught up
            req.num_computed += n
            kv.publish(req)
            if req.num_computed == req.compute_target:
                req.output_ids.append(_sampled_token(req, vocab_size))
                if len(req.output_ids) == out_len[req.arrival]:
                    finished.add(req.request_id)
                    kv.release(req)
        if finished:
            running[:] = [r for r in running if r.request_id not in finished]
        if check_integrity:
            pool.check_integrity([list(held(r.page_table)) for r in running])
        _sample_paged(res, running, pool, bs, cfg.window > 0, out_of_room)
    pool.check_integrity([])
    if pool.num_used or any(len(r.output_ids) != out_len[r.arrival] for r in reqs.values()):
        raise RuntimeError(f"{name}: pages left in use or outputs of the wrong length at the end")
    return res


def _sample_paged(res: RowResult, running: list[Request], pool: PagePool, bs: int, windowed: bool,
                  saturated: bool) -> None:
    """Filled physical slots: each request's tokens in the pages it holds, less the extra references to
    shared pages (only full pages are ever shared: hits are whole published pages)."""
    tokens = held_pages = 0
    for r in running:
        dropped = sum(1 for p in r.page_table if p == DROPPED_PAGE) if windowed else 0
        tokens += r.num_computed - dropped * bs
        held_pages += len(r.page_table) - dropped
    filled = tokens - bs * (held_pages - pool.num_used)
    res.sample(filled, pool.num_used * bs, tokens, len(running), saturated)
