"""The KV event stream against the pools it describes (#47): a hypothesis state machine drives real Schedulers (one or
two executors, each with a device and a host tier, all reporting to one KvEventLog) through admissions with shared
prefixes and cache hits, confirmed steps (prompt and decode-filled pages published), evictions, spills to the host
tier, swaps out and in, plans rejected, cancels, a lost Run stream (the pages of unconfirmed page operations
unpublished), executor restarts and a new pool geometry.

After every step a consumer applies every batch to a set of (hash, medium), starting from the first batch of the
process, and that set must equal the union of every pool's findable pages. Every Stored must announce something not
announced yet, every Removed something announced; every Stored's tokens, chain and salt are checked against the
SHA-256 chain itself: each page's hash is recomputed from its parent's (an earlier Stored's, or the root of the tenant
its salt names) and its tokens.
"""

from __future__ import annotations

from collections import Counter, deque

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagedkv.executor.v1 import executor_pb2 as pb
from pagedkv.fleet_salt import hash_id
from pagedkv.tenancy import Tenant, Tenants
from scheduler_svc.detokenizer import IncrementalDetokenizer
from scheduler_svc.kv_events import Cleared, KvEventLog, Removed, Stored
from scheduler_svc.pages import PagePool, tier_pools
from scheduler_svc.policy import Mode, PreemptionConfig, PreemptionCosts
from scheduler_svc.prefix_cache import page_hash, tenant_root
from scheduler_svc.request import Request, Sampling
from scheduler_svc.scheduler import Scheduler, SchedulerConfig
from tests.support.adversarial_profiles import profile
from tests.support.driven import Driven
from tests.support.fake_executor import FakeExecutor, NullTokenizer

pytestmark = pytest.mark.unit

BS = 4
MAX_MODEL_LEN = 48
SECRET = b"kv-events-test-fleet-secret-0123"
CHEAP_SWAP = PreemptionCosts(page_bytes=65536, swap_bytes_per_second=4e9, prefill_seconds_per_token=70e-6)
PREFIXES = [[(7 * k + j) % 90 + 3 for j in range(9)] for k in range(3)]  # shared prompt starts (2+ pages)
TENANTS = ["default", "a", "b"]
WINDOWS = [(0, 0), (0, 0), (4, 8)]  # (sink, window) tokens: most requests unwindowed


def findable(pool: PagePool | None) -> set[tuple[int, str]]:
    if pool is None:
        return set()
    return {(hash_id(h), pool.medium) for p in range(pool.num_pages) if (h := pool.hash_of(p)) is not None}


class KvEventStream(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.executors: list[Driven] = []

    @initialize(executors=st.sampled_from([1, 2]), pages=st.integers(6, 14), host_pages=st.sampled_from([0, 5, 12]),
                token_budget=st.sampled_from([4, 8, 32]), seqs=st.sampled_from([2, 4]),
                mode=st.sampled_from(list(Mode)), multi=st.booleans(), overlap=st.booleans())
    def setup(self, executors, pages, host_pages, token_budget, seqs, mode, multi, overlap):
        self.cfg = SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=token_budget, max_model_len=MAX_MODEL_LEN,
                                   preemption=PreemptionConfig(mode=mode, hot_steps=0, cold_steps=4))
        self.secret = SECRET if multi else b""
        self.log = KvEventLog(BS, buffer_batches=1 << 20, salt_secret=self.secret)
        self.multi = multi
        self.host_pages = host_pages
        for _ in range(executors):
            pool, host = tier_pools(pages, BS, host_pages, self.log)
            tenants = Tenants([Tenant(t) for t in TENANTS]) if multi else Tenants()
            self.executors.append(Driven(Scheduler(pool, self.cfg, [2], host, CHEAP_SWAP, tenants)))
        self.fakes = [FakeExecutor(BS) for _ in range(executors)]
        self.pending: list[deque[pb.StepPlan]] = [deque() for _ in range(executors)]
        self.depth = 2 if overlap else 1
        self.next_id = 0
        self.roots: dict[bytes, str] = {}  # chain root -> the salt its pages must carry
        # the consumer: what the stream says is findable, and every page hash it announced (id -> SHA-256)
        self.seen_seq = -1
        self.announced: set[tuple[int, str]] = set()
        self.full_hash: dict[int, bytes] = {}
        self.counts: Counter[str] = Counter()

    # ---- rules ---------------------------------------------------------------------------------
    @rule(where=st.integers(0, 1), tenant=st.sampled_from(TENANTS), prefix=st.sampled_from([None, 0, 1, 2]),
          own=st.lists(st.integers(3, 90), max_size=14), max_tokens=st.integers(1, 12), window=st.sampled_from(WINDOWS))
    def admit(self, where, tenant, prefix, own, max_tokens, window):
        i = where % len(self.executors)
        tenant = tenant if self.multi else "default"
        prompt = (PREFIXES[prefix] if prefix is not None else []) + own or [5]
        if len(prompt) + max_tokens > MAX_MODEL_LEN:
            return
        sink, win = window
        root = tenant_root(tenant) if not win else tenant_root(f"{tenant}\x00window:{sink}:{win}")
        self.roots[root] = self.log.salt(tenant, window if win else None)
        rid = f"q{self.next_id}"
        self.next_id += 1
        self.executors[i].add(Request(
            request_id=rid, prompt_ids=prompt, sampling=Sampling(max_tokens=max_tokens, ignore_eos=True),
            arrival=self.next_id, detokenizer=IncrementalDetokenizer(NullTokenizer(), prompt, [], False),
            tenant=tenant, hash_root=root, sink_tokens=sink, window_tokens=win))

    def _complete(self, i: int) -> None:
        self.executors[i].process(self.fakes[i].step(self.pending[i].popleft()))

    @rule(where=st.integers(0, 1), steps=st.integers(1, 10))
    def run_steps(self, where: int, steps: int) -> None:
        """Steps as the engine runs them: plan (with async scheduling, while the last one is in flight), then
        complete the oldest once ``depth`` are in flight or nothing more could be planned."""
        i = where % len(self.executors)
        s, pending = self.executors[i], self.pending[i]
        for _ in range(steps):
            before = len(pending)
            if before < self.depth:
                plan, _ = s.schedule()
                if plan is not None:
                    pending.append(plan)
            if not pending:
                return
            if len(pending) >= self.depth or len(pending) == before:
                self._complete(i)

    @precondition(lambda self: any(len(p) == 1 for p in self.pending))
    @rule()
    def reject(self) -> None:
        """The executor ran nothing of its plan (a desync): what the plan's page operations would have written
        stays unpublished, and the operations go again."""
        i = next(j for j, p in enumerate(self.pending) if len(p) == 1)
        if self.executors[i].stream.resending:
            return
        plan = self.pending[i].popleft()
        self.executors[i].process(pb.StepResult(step_id=plan.step_id, error="injected desync"))
        self.counts["rejected"] += 1

    @rule(where=st.integers(0, 1), data=st.data())
    def preempt(self, where: int, data) -> None:
        """A running request gives its pages back (swapped to the host tier or recomputed, as the policy picks)."""
        s = self.executors[where % len(self.executors)]
        if not s.running or len(self.pending[where % len(self.executors)]) >= self.depth:
            return
        victim = data.draw(st.sampled_from(sorted(s.running, key=lambda r: r.request_id)))
        s._preempt(victim, s.step_id + 1)
        self.counts["preempted"] += 1

    @rule(where=st.integers(0, 1), data=st.data())
    def cancel(self, where: int, data) -> None:
        s = self.executors[where % len(self.executors)]
        if s.requests:
            s.abort(data.draw(st.sampled_from(sorted({r.group for r in s.requests.values()}))))

    @rule(where=st.integers(0, 1), how=st.sampled_from(["restart", "stream_lost", "stream_lost_then_other_process",
                                                        "new_geometry"]))
    def executor_fails(self, where: int, how: str) -> None:
        """An executor dies and another process takes its place (everything it held is forgotten), or only its Run
        stream was lost (pages of page operations that may not have run are unpublished, the rest stays findable;
        then the same process is back, or another), or it comes back with another pool size (new pools). Its
        requests move to the other executor, if any, else come back to it."""
        i = where % len(self.executors)
        s = self.executors[i]
        moved, _ = s.evacuate(keep_cache=how.startswith("stream_lost"))
        self.pending[i].clear()
        if how == "stream_lost_then_other_process":
            s.reconnected(kept=False)
        elif how == "new_geometry":
            s.reconnected(num_pages=s.pool.num_pages + 1, kept=False)
        if how != "stream_lost":
            self.fakes[i] = FakeExecutor(BS)
        else:
            self.fakes[i].tables.clear()  # (the executor forgets the requests of a lost stream, not its pages)
        to = self.executors[(i + 1) % len(self.executors)]
        for req in reversed(moved):
            to.add(req, front=True)
        self.counts[how] += 1

    # ---- the consumer ----------------------------------------------------------------------------
    def _check_stored(self, ev: Stored) -> None:
        assert ev.block_size == BS and len(ev.token_ids) == len(ev.hashes) * BS, ev
        if ev.parent is None:
            candidates = [r for r, salt in self.roots.items() if salt == ev.salt]
        else:
            assert ev.parent in self.full_hash, f"parent {ev.parent} was never announced"
            candidates = [self.full_hash[ev.parent]]
        for k, hid in enumerate(ev.hashes):
            tokens = ev.token_ids[k * BS:(k + 1) * BS]
            matches = [h for c in candidates if hash_id(h := page_hash(c, tokens)) == hid]
            assert len(matches) == 1, f"page {hid}: its tokens {tokens} and parent do not hash to it (salt {ev.salt!r})"
            self.full_hash[hid] = matches[0]
            candidates = matches
            key = (hid, ev.medium)
            assert key not in self.announced, f"{key} stored twice without a removal between"
            self.announced.add(key)

    def _consume(self) -> None:
        self.log.flush()
        batches = self.log.replay(self.seen_seq + 1)
        assert batches is not None, "a batch left a buffer that holds them all"
        for batch in batches:
            assert batch.seq == self.seen_seq + 1, "batches numbered with a gap"
            if batch.seq == 0:
                assert batch.events == (Cleared(),), "the first batch of a process clears what an earlier one said"
            self.seen_seq = batch.seq
            for ev in batch.events:
                if isinstance(ev, Stored):
                    self._check_stored(ev)
                    self.counts[f"stored {ev.medium}"] += len(ev.hashes)
                elif isinstance(ev, Removed):
                    for hid in ev.hashes:
                        assert (hid, ev.medium) in self.announced, f"{(hid, ev.medium)} removed, never stored"
                        self.announced.discard((hid, ev.medium))
                    self.counts[f"removed {ev.medium}"] += len(ev.hashes)
                else:
                    self.announced.clear()
                    self.counts["cleared"] += 1

    @invariant()
    def stream_equals_pools(self) -> None:
        if not self.executors:
            return
        self._consume()
        union = set()
        for s in self.executors:
            s.check_integrity()
            union |= findable(s.pool) | findable(s.host)
        assert self.announced == union, (f"announced but not findable: {sorted(self.announced - union)[:5]}; "
                                         f"findable but not announced: {sorted(union - self.announced)[:5]}")
        assert self.log.findable() == union

    def teardown(self) -> None:
        if not self.executors:
            return
        for i in range(len(self.executors)):  # drain: everything ends, pages stay findable in the free LRU
            for _ in range(400):
                self.run_steps(i, 1)
                if not self.pending[i] and not self.executors[i].has_work:
                    break
        self.stream_equals_pools()
        seq, stored = self.log.snapshot()
        assert seq == self.seen_seq
        assert {(h, ev.medium) for ev in stored for h in ev.hashes} == self.announced


TestKvEventStream = KvEventStream.TestCase
TestKvEventStream.settings = profile(ci_examples=60, long_examples=2000, stateful_step_count=40)


def test_the_machine_reaches_every_kind_of_change():
    """The rules above do produce what the invariant is about (a run that never evicted, spilled or cleared would
    prove nothing): one fixed run with a small pool and a host tier."""
    m = KvEventStream()
    m.setup(executors=2, pages=6, host_pages=5, token_budget=8, seqs=2, mode=Mode.SWAP, multi=True, overlap=False)
    for k in range(12):
        m.admit(k % 2, TENANTS[k % 3], k % 3, [10 + k, 20 + k, 30 + k, 40 + k, 50 + k], 6, WINDOWS[k % 3])
        m.run_steps(k % 2, 3)
        m.stream_equals_pools()
    m.executor_fails(0, "restart")
    m.stream_equals_pools()
    m.teardown()
    for kind in ("stored GPU", "stored CPU", "removed GPU", "cleared"):
        assert m.counts[kind], f"no {kind} in {dict(m.counts)}"
