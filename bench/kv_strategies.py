"""KV strategies compared on one trace by simulation: the seeds' table, measured with our own page manager.

One seeded, mixed-length trace (ShareGPT-like: log-normal prompt and output lengths with the PagedAttention
paper's ShareGPT means, 161 and 338 tokens, sigma 1.0 of the log, capped so prompt + output <= max_model_len
2048; a fraction of the requests starts with one of a few shared system prompts) runs through each strategy
at the same fixed KV budget (``--kv-budget-tokens`` token slots, default 32 x 2048: contiguous holds 32):

* contiguous: every request reserves ``max_model_len`` slots in one piece for its whole life.
* bucketing: every request reserves the smallest bucket (512 / 1024 / 2048) >= prompt + max_tokens. The
  trace's requests ask max_tokens = the tokens they will generate (EOS ignored, as ``pagedkv bench`` does),
  so the bucket fits the final length: bucketing's best case. Free slots are counted as one pool (no
  fragmentation between buckets): also its best case.
* paged, block 8 / 16 / 32: ``scheduler_svc.pages.PagePool`` + ``scheduler_svc.kv_manager.KVManager``,
  prefix caching off: pages allocated as tokens arrive (``grow``), freed when a request ends (``release``).
* paged + Share-Prefix: the same with prefix caching on: full pages are published after they are computed
  and later requests with the same system prompt point their page tables at them (``find_hits`` / ``admit``;
  a request whose prefix another is still computing waits a step, ``waits_for_inflight``).
* paged + sliding window: every request attends to a sink (16 tokens) plus the last ``--window`` tokens
  (512); pages wholly outside are freed (``drop_outside_window``), prefill is chunked so a request never
  holds more than its page limit (``window_chunk_limit``). This changes what the model sees (a different
  attention), unlike the other rows.
* paged 16, fp8/int8 KV: plain paged block 16 at the same KV bytes with 8-bit pages (--kv-cache-dtype
  fp8_e4m3 or int8: 1 byte per element plus scales; int8's, the larger, are used): the budget in token slots
  grows by fp16 bytes / 8-bit bytes per token (1.92x on a Llama-3-8B shape).

The simulation is saturated: all requests wait at t=0 and are admitted first come, first served whenever
the strategy has room (paged rows keep 1% of the pages free at admission, like the scheduler's watermark).
Each step a running request computes its prompt (the first step; chunked only with a window) or the token
it sampled last, then samples one token; it ends after its output length (the last sampled token is never
computed). A paged request that cannot grow preempts the newest running request, which is recomputed later
(prompt + output so far). Page accounting is checked (``PagePool.check_integrity``) with ``--check-integrity``
every step, and always at the end (every page free again).

Measured per strategy:

* KV utilization: token slots holding KV / token slots allocated, summed over all steps (a time average
  weighted by allocation). A page shared by several requests counts once (slots are physical).
* logical tokens per slot: tokens of KV the running requests use / slots allocated (> 1 with sharing).
* concurrency: requests holding KV at the end of a step; mean over the saturated steps (those that ended
  with requests still waiting: the sustained count, used for "x contig" and the target) and max over the run
  (for paged rows a transient peak right after prompts are admitted, before growth forces preemptions).
* slots per running request: KV slots allocated / requests running, over the saturated steps; Share-Prefix's
  saving is its value against plain paged at block 16.

No timing is involved, so the numbers do not depend on the machine or its load.

    python bench/kv_strategies.py                # 1,000 requests -> bench/results/kv_strategies.{json,png}
    python bench/kv_strategies.py --quick        # 200 requests, budget 8 x 2048
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # this tree's scheduler_svc, not whichever one is installed
    sys.path.insert(0, str(ROOT))

import common  # noqa: E402

from pagedkv.wire import DROPPED_PAGE  # noqa: E402
from scheduler_svc.detokenizer import IncrementalDetokenizer  # noqa: E402
from scheduler_svc.kv_manager import KVManager  # noqa: E402
from scheduler_svc.pages import PagePool, held  # noqa: E402
from scheduler_svc.prefix_cache import tenant_root  # noqa: E402
from scheduler_svc.request import Request, Sampling  # noqa: E402

BOS_ID, FIRST_ID = 1, 3
WATERMARK = 0.01  # share of pages kept free at admission (SchedulerConfig.watermark)

# The seeds' table (seeds/000: 70B model on one A100): KV utilization and concurrent requests per strategy.
SEED_CLAIMS: dict[str, dict[str, str]] = {
    "contiguous": {"utilization": "30-40%", "concurrency": "16-32"},
    "bucketing": {"utilization": "45-60%", "concurrency": "32-64"},
    "paged": {"utilization": "85-95%", "concurrency": "128-256 (2-4x contiguous)"},
    "paged+sliding-window": {"utilization": "90-98%", "concurrency": "192-384"},
    "paged+share-prefix": {"utilization": "92-98% (with swap)", "concurrency": "192-320; -15..30% KV"},
    "paged+8bit-kv": {"utilization": "85-95%", "concurrency": "fp8: KV x2, 4x contiguous fp16; int8: +30-50%"},
}
# KV bytes per token for the 8-bit row, scales included (executor_svc.kv_quant: 1 byte per element; V and fp8 K a
# 2-byte scale per token and KV head; int8 K a 1-byte exponent per page, head and channel, head_dim/16 bytes a
# token at 16-token pages: int8 is the larger, and the row uses it), on a Llama-3-8B shape (32 layers, 8 KV heads,
# head_dim 128); the budget is the same bytes as the fp16 rows, so the row gets budget * fp16 / 8-bit token slots.
KV_SHAPE = (32, 8, 128)
FP16_BYTES_PER_TOKEN = KV_SHAPE[0] * 2 * KV_SHAPE[1] * KV_SHAPE[2] * 2
Q8_BYTES_PER_TOKEN = KV_SHAPE[0] * KV_SHAPE[1] * ((KV_SHAPE[2] + KV_SHAPE[2] // 16) + (KV_SHAPE[2] + 2))
TARGETS = {"paged16_utilization": 0.98, "paged16_concurrency_vs_contiguous": 4.0}


# ---- the trace ------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class TraceConfig:
    num_requests: int = 1000
    seed: int = 0
    max_model_len: int = 2048
    prompt_mean: float = 161.0
    output_mean: float = 338.0
    sigma: float = 1.0
    shared_fraction: float = 0.5
    num_prefixes: int = 4
    prefix_len: int = 256
    vocab_size: int = 32000


@dataclass(frozen=True, slots=True)
class TraceRequest:
    index: int
    prompt: list[int]
    output_len: int
    prefix: int  # shared system prompt index, -1: none


def _lognormal(rng: random.Random, mean: float, sigma: float) -> int:
    return max(1, round(rng.lognormvariate(math.log(mean) - sigma * sigma / 2, sigma)))


def make_trace(cfg: TraceConfig) -> list[TraceRequest]:
    """Prompts: BOS + random ids (a shared request: its system prompt, then its own tokens); outputs
    log-normal. Capped: prompt <= max_model_len - 1, then output <= max_model_len - prompt."""
    if cfg.prefix_len >= cfg.max_model_len - 1 or cfg.num_requests < 1 or not 0 <= cfg.shared_fraction <= 1:
        raise ValueError("trace: need 1 <= num_requests, 0 <= shared_fraction <= 1, prefix_len < max_model_len - 1")
    rng = random.Random(cfg.seed)
    ids = (FIRST_ID, cfg.vocab_size)
    prefixes = [[BOS_ID] + [rng.randrange(*ids) for _ in range(cfg.prefix_len - 1)] for _ in range(cfg.num_prefixes)]
    shared = set(rng.sample(range(cfg.num_requests), round(cfg.shared_fraction * cfg.num_requests)))
    out = []
    for i in range(cfg.num_requests):
        prefix = rng.randrange(cfg.num_prefixes) if i in shared else -1
        head = prefixes[prefix] if prefix >= 0 else [BOS_ID]
        own = min(_lognormal(rng, cfg.prompt_mean, cfg.sigma), cfg.max_model_len - 1 - len(head))
        prompt = head + [rng.randrange(*ids) for _ in range(own)]
        output = min(_lognormal(rng, cfg.output_mean, cfg.sigma), cfg.max_model_len - len(prompt))
        out.append(TraceRequest(i, prompt, output, prefix))
    return out


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


# ---- all rows --------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class RunConfig:
    trace: TraceConfig
    kv_budget_tokens: int = 32 * 2048
    buckets: tuple[int, ...] = (512, 1024, 2048)
    block_sizes: tuple[int, ...] = (8, 16, 32)
    window: int = 512
    sink: int = 16
    check_integrity: bool = False


def run_all(cfg: RunConfig, trace: list[TraceRequest]) -> list[RowResult]:
    t, budget = cfg.trace, cfg.kv_budget_tokens
    if cfg.buckets[-1] < t.max_model_len:
        raise ValueError(f"buckets: the largest ({cfg.buckets[-1]}) must hold max_model_len={t.max_model_len}")
    if budget < t.max_model_len:
        raise ValueError(f"kv_budget_tokens: {budget}; must hold one request of max_model_len={t.max_model_len}")
    rows = [run_reserving(trace, f"contiguous (max_model_len {t.max_model_len})", "contiguous",
                          lambda _: t.max_model_len, budget),
            run_reserving(trace, f"bucketing ({'/'.join(map(str, cfg.buckets))})", "bucketing",
                          bucket_of(cfg.buckets), budget)]
    for bs in cfg.block_sizes:
        rows.append(run_paged(trace, f"paged, block {bs}", "paged", PagedConfig(bs), budget, cfg.check_integrity,
                              t.vocab_size))
    rows.append(run_paged(trace, "paged 16 + Share-Prefix", "paged+share-prefix", PagedConfig(16, prefix_caching=True),
                          budget, cfg.check_integrity, t.vocab_size))
    rows.append(run_paged(trace, f"paged 16 + sliding window ({cfg.sink}+{cfg.window})", "paged+sliding-window",
                          PagedConfig(16, window=cfg.window, sink=cfg.sink), budget, cfg.check_integrity,
                          t.vocab_size))
    q8_budget = budget * FP16_BYTES_PER_TOKEN // Q8_BYTES_PER_TOKEN  # the same bytes, 8-bit KV
    # fp8 and int8 pages are within 2% of each other (1 byte + the scales): one row, at int8's size
    rows.append(run_paged(trace, "paged 16, fp8/int8 KV (same bytes)", "paged+8bit-kv", PagedConfig(16),
                          q8_budget, cfg.check_integrity, t.vocab_size))
    return rows


def trace_stats(trace: list[TraceRequest]) -> dict[str, Any]:
    p = [len(r.prompt) for r in trace]
    o = [r.output_len for r in trace]
    held = [sum(len(r.prompt) + k for k in range(r.output_len)) / r.output_len for r in trace]
    life = [r.output_len for r in trace]
    return {"requests": len(trace), "prompt_mean": statistics.fmean(p), "prompt_p50": statistics.median(p),
            "prompt_max": max(p), "output_mean": statistics.fmean(o), "output_p50": statistics.median(o),
            "output_max": max(o), "with_shared_prefix": sum(1 for r in trace if r.prefix >= 0),
            # tokens a running request holds, averaged over its life and weighted by how long it runs: what a
            # paged allocator must hold per concurrent request
            "time_weighted_tokens_held": sum(h * n for h, n in zip(held, life)) / sum(life)}


def p16_row(summaries: list[dict[str, Any]]) -> dict[str, Any] | None:
    return next((s for s in summaries if s["strategy"] == "paged, block 16"), None)


def targets(summaries: list[dict[str, Any]]) -> dict[str, Any]:
    """The docs/design.md targets for paged block 16 ({} when the trace never filled the budget)."""
    contiguous = next(s for s in summaries if s["kind"] == "contiguous")
    p16 = p16_row(summaries)
    if p16 is None or not p16["mean_saturated_concurrency"] or not contiguous["mean_saturated_concurrency"]:
        return {}
    util = p16["utilization"]
    ratio = p16["mean_saturated_concurrency"] / contiguous["mean_saturated_concurrency"]
    return {name: {"measured": value, "target": TARGETS[name], "met": value >= TARGETS[name]}
            for name, value in (("paged16_utilization", util), ("paged16_concurrency_vs_contiguous", ratio))}


# ---- report ----------------------------------------------------------------------------------------------
def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or not b else f"{a / b:.2f}x"


def format_table(summaries: list[dict[str, Any]]) -> str:
    contiguous = next(s for s in summaries if s["kind"] == "contiguous")
    head = ("strategy", "KV util", "seeds' util", "tokens/slot", "mean conc", "max conc", "x contig",
            "seeds' concurrency", "preempt")
    body = []
    for s in summaries:
        claim = SEED_CLAIMS[s["kind"]]
        body.append((s["strategy"], _pct(s["utilization"]), claim["utilization"],
                     f"{s['logical_tokens_per_slot']:.3f}",
                     "-" if s["mean_saturated_concurrency"] is None else f"{s['mean_saturated_concurrency']:.1f}",
                     str(s["max_concurrency"]),
                     _ratio(s["mean_saturated_concurrency"], contiguous["mean_saturated_concurrency"]),
                     claim["concurrency"],
                     str(s["preemptions"])))
    return common.format_table(head, body)


def write_png(path: Path, rows: list[RowResult], summaries: list[dict[str, Any]]) -> str:
    """Bars (utilization, concurrency) and utilization over time; returns a note when it cannot."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no PNG: matplotlib is not installed (pip install matplotlib)"
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(17, 5.5))
    names = [s["strategy"] for s in summaries]
    ys = range(len(names))
    ax1.barh(ys, [100 * (s["utilization"] or 0) for s in summaries], color="tab:blue")
    for y, s in zip(ys, summaries, strict=True):
        lo, hi = (float(x) for x in SEED_CLAIMS[s["kind"]]["utilization"].split("%")[0].split("-"))
        ax1.plot([lo, hi], [y, y], color="tab:orange", lw=6, alpha=0.6, label="seeds' claim" if y == 0 else None)
    ax1.set_yticks(list(ys), names)
    ax1.invert_yaxis()
    ax1.set_xlabel("KV utilization (%)")
    ax1.set_xlim(0, 100)
    ax1.legend(loc="upper center", bbox_to_anchor=(0.5, -0.1))
    ax2.barh(ys, [s["max_concurrency"] for s in summaries], color="tab:green", label="max")
    ax2.barh(ys, [s["mean_saturated_concurrency"] or 0 for s in summaries], color="tab:olive", height=0.4,
             label="mean (saturated)")
    ax2.set_yticks(list(ys), [])
    ax2.invert_yaxis()
    ax2.set_xlabel("concurrent requests at the KV budget")
    ax2.legend(loc="lower right")
    for row in rows:
        ax3.plot([t[0] for t in row.timeline], [100 * t[1] for t in row.timeline], label=row.strategy, lw=1)
    ax3.set_xlabel("step")
    ax3.set_ylabel("KV utilization (%)")
    ax3.set_ylim(0, 102)
    ax3.legend(fontsize=7, loc="lower left")
    fig.suptitle("KV strategies on one trace (simulation with scheduler_svc's page manager)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return ""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-requests", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--kv-budget-tokens", type=int, default=32 * 2048, help="KV token slots of every strategy")
    p.add_argument("--shared-fraction", type=float, default=0.5, help="share of requests with a system prompt")
    p.add_argument("--num-prefixes", type=int, default=4, help="distinct shared system prompts")
    p.add_argument("--prefix-len", type=int, default=256, help="tokens per system prompt (BOS included)")
    p.add_argument("--sigma", type=float, default=1.0, help="sigma of the log of prompt and output lengths")
    p.add_argument("--window", type=int, default=512, help="sliding-window row: attention window in tokens")
    p.add_argument("--sink", type=int, default=16, help="sliding-window row: sink tokens")
    p.add_argument("--check-integrity", action="store_true", help="check page accounting after every step")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "kv_strategies.json")
    p.add_argument("--quick", action="store_true", help="200 requests, a KV budget of 8 x 2048 slots")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    tcfg = TraceConfig(num_requests=200 if args.quick else args.num_requests, seed=args.seed,
                       max_model_len=args.max_model_len, sigma=args.sigma, shared_fraction=args.shared_fraction,
                       num_prefixes=args.num_prefixes, prefix_len=args.prefix_len)
    cfg = RunConfig(tcfg, 8 * 2048 if args.quick else args.kv_budget_tokens, window=args.window, sink=args.sink,
                    check_integrity=args.check_integrity)
    trace = make_trace(tcfg)
    stats = trace_stats(trace)
    print(f"trace: {stats['requests']} requests (seed {tcfg.seed}), prompt mean {stats['prompt_mean']:.0f} / p50 "
          f"{stats['prompt_p50']:.0f} / max {stats['prompt_max']}, output mean {stats['output_mean']:.0f} / p50 "
          f"{stats['output_p50']:.0f} / max {stats['output_max']}, {stats['with_shared_prefix']} with one of "
          f"{tcfg.num_prefixes} shared {tcfg.prefix_len}-token system prompts; KV budget {cfg.kv_budget_tokens} "
          f"token slots", flush=True)
    t0 = time.perf_counter()
    rows = run_all(cfg, trace)
    summaries = [r.summary() for r in rows]
    print(f"simulated in {time.perf_counter() - t0:.1f}s\n")
    print(format_table(summaries))
    tg = targets(summaries)
    print()
    for name, t in tg.items():
        unit = "x" if "vs" in name else ""
        measured = f"{t['measured']:.2f}x" if unit else _pct(t["measured"])
        target = f"{t['target']:.0f}x" if unit else _pct(t["target"])
        print(f"target {name}: measured {measured}, target >= {target}: {'met' if t['met'] else 'NOT met'}")
    share = next((x for x in summaries if x["kind"] == "paged+share-prefix"), None)
    saving = None
    p16 = p16_row(summaries)
    if share and p16 and share["slots_per_running_request"] and p16["slots_per_running_request"]:
        per_req = [p16["slots_per_running_request"], share["slots_per_running_request"]]
        saving = 1 - per_req[1] / per_req[0]
        print(f"Share-Prefix: {per_req[1]:.0f} KV slots per running request vs {per_req[0]:.0f} for paged 16 "
              f"({100 * saving:.0f}% less; seeds: 15-30%, 20-50% in RAG/agent traffic)")
    q8 = next((x for x in summaries if x["kind"] == "paged+8bit-kv"), None)
    if q8 and p16 and q8["mean_saturated_concurrency"] and p16["mean_saturated_concurrency"]:
        ratio = q8["mean_saturated_concurrency"] / p16["mean_saturated_concurrency"]
        print(f"8-bit KV: {Q8_BYTES_PER_TOKEN} bytes per token vs {FP16_BYTES_PER_TOKEN} fp16 "
              f"({Q8_BYTES_PER_TOKEN / FP16_BYTES_PER_TOKEN:.3f}x, target <= 0.53x); concurrency at the same bytes "
              f"{ratio:.2f}x paged 16 fp16 (target >= 1.9x): {'met' if ratio >= 1.9 else 'NOT met'}")
    held = stats["time_weighted_tokens_held"]
    estimate = tcfg.max_model_len * (p16["utilization"] if p16 else 1.0) / held
    print(f"note: a request holds {held:.0f} tokens on average over its life (weighted by how long it runs); at "
          f"the paged utilization that gives about {tcfg.max_model_len} x util / {held:.0f} = {estimate:.2f}x "
          f"the concurrency of max-length contiguous allocation on this trace without sharing or a window: the "
          f"ratio is set by the trace's lengths against max_model_len, not by the allocator")
    png = args.out.with_suffix(".png")
    note = write_png(png, rows, summaries)
    print(note or f"wrote {png}")
    report = {"config": {**asdict(cfg), "trace": asdict(tcfg)}, "trace": stats, "rows": summaries,
              "seed_claims": SEED_CLAIMS, "targets": tg, "concurrency_ratio_estimate_without_sharing": estimate,
              "share_prefix_kv_saving_per_request": saving,
              "png": None if note else str(png),
              "timelines": {r.strategy: r.timeline[:: max(1, len(r.timeline) // 500)] for r in rows}}
    common.write_report(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
