"""Grammar work bounded per request and per tenant (issue #46, F1): a matcher whose per-step cost grows without
bound (an ambiguous grammar) ends its request at the first step past its CPU budget, naming the flag, and sampling
goes on without waiting for it; a tenant's matchers together are bounded too; the other rows are untouched."""

from __future__ import annotations

import time

import pytest
import xgrammar

from executor_svc.grammar import GrammarEngine, Key, new_matcher
from executor_svc.grammar_jobs import GrammarState, Matchers
from pagedkv.executor.v1 import executor_pb2 as pb

pytestmark = pytest.mark.unit

VOCAB = 320
EOS = 2
X = ord("x") + 3  # tiny-llama: byte b is token b + 3
# The finding's 51-byte EBNF: each accepted "x" makes the matcher's state larger, so each step costs more.
AMBIGUOUS = 'root ::= a{500,}\na ::= "x" | "x" "x" | "xx" | "x" a'


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    e = GrammarEngine(tiny_llama_dir, VOCAB, compile_timeout=60.0, compile_workers=0)
    yield e
    e.close()


def _compiled(engine, **kind):
    return engine.submit(pb.Constraint(**kind, end_token_ids=[EOS])).result(timeout=60).grammar


def _state(compiled, scope: str = "t", advanced: int = 0, matcher=None, pending: list[int] = ()) -> GrammarState:
    st = GrammarState(Key(scope, "grammar", "", False), compiled, (EOS,), (VOCAB + 31) // 32, pending=list(pending))
    if matcher is not None:
        st.matcher = matcher
    elif advanced:
        st.matcher = new_matcher(compiled, (EOS,))
        for _ in range(advanced):
            assert st.matcher.accept_token(X)
    return st


def _run(matchers: Matchers, states):
    step = matchers.step()
    step.start(states)
    mask, failed = step.wait()
    return step, mask, failed


def test_a_matcher_past_its_step_budget_ends_its_request_and_nobody_waits_for_it(engine):
    slow = _state(_compiled(engine, grammar=AMBIGUOUS), advanced=140)
    fast = _state(_compiled(engine, regex="[a-c]+"), scope="bystander")
    for st in (slow, fast):
        st.pending.append(X if st is slow else ord("a") + 3)
    matchers = Matchers(threads=2, step_budget_ms=1.0, tenant_budget_ms=1000.0)
    step, mask, failed = _run(matchers, [slow, None, fast])
    assert list(failed) == [0]
    assert "its grammar's matcher took" in failed[0] and "the limit is 1 ms (--grammar-step-budget-ms)" in failed[0]
    assert slow.failed == failed[0]
    assert not step.jobs[0].done  # (abandoned: still in its call, and sampling did not wait for it)
    assert mask.rows == [2] and not fast.failed
    deadline = time.monotonic() + 60
    while not step.jobs[0].done and time.monotonic() < deadline:
        time.sleep(0.01)
    assert step.jobs[0].done and matchers.pool.abandoned == 1 and not matchers.pool.running
    # the pool still has its threads: the next step runs
    fast.pending.append(ord("b") + 3)
    _, mask, failed = _run(matchers, [fast])
    assert not failed and mask.rows == [0]


def test_a_tenants_matchers_together_are_bounded_and_other_tenants_go_on(engine):
    ambiguous = _compiled(engine, grammar=AMBIGUOUS)
    base = _state(ambiguous, advanced=110)
    probing = Matchers(threads=1, step_budget_ms=5000.0, tenant_budget_ms=5000.0)
    one_ms = max(sorted(_run(probing, [_state(ambiguous, matcher=base.matcher.fork(), pending=[X])])[0].jobs[0].cpu_s
                        for _ in range(3))[1] * 1e3, 1.0)  # (the median of three)
    mine = [_state(ambiguous, matcher=base.matcher.fork(), pending=[X]) for _ in range(8)]
    other = _state(ambiguous, scope="u", matcher=base.matcher.fork(), pending=[X])
    # each row's work is about one_ms alone: eight of one tenant are past four of them; the other tenant's one is
    # not, with room for the CPU time a row takes beside the others on a loaded machine (CI saw 2x its time alone)
    matchers = Matchers(threads=4, step_budget_ms=5000.0, tenant_budget_ms=4.0 * one_ms)
    _, _, failed = _run(matchers, [*mine, other])
    assert failed and 8 not in failed  # (the other tenant's row is within its own budget)
    assert all("its tenant's grammar matchers took" in e and "--grammar-tenant-step-budget-ms" in e
               for e in failed.values())
    assert not other.failed


def test_a_replay_gets_an_allowance_per_token_and_well_behaved_work_stays_within(engine):
    """A resent request replays its outputs within one step budget per 16 tokens more; a JSON grammar's work is far
    below its budget."""
    compiled = _compiled(engine, json_schema='{"type": "object", "properties": {"a": {"type": "string"}}}')
    st = _state(compiled)
    text = b'{"a": "' + b"y" * 200
    st.pending, st.replay = [b + 3 for b in text], len(text)
    matchers = Matchers(threads=1, step_budget_ms=20.0, tenant_budget_ms=50.0)
    step, mask, failed = _run(matchers, [st])
    assert not failed and mask.rows == [0]
    job = step.jobs[0]
    assert job.limit_s == pytest.approx(0.020 * (1 + len(text) / 16)) and job.allowance_s > 0
    assert job.cpu_s < job.limit_s
    assert xgrammar  # (the tier imports it: structured outputs are installed)


def test_compile_jobs_are_taken_in_turn_across_scopes_and_bounded_per_scope():
    """One tenant's queued compiles do not hold the workers: with one at a time per scope, another scope's job is
    taken before the first scope's second one."""
    from executor_svc.grammar_compile import CompileJob, FairQueue

    q = FairQueue(per_scope=1)
    jobs = [CompileJob(Key(scope, "regex", str(i), False)) for i, scope in enumerate("aaab")]
    for job in jobs:
        q.put(job)
    first = q.take()
    second = q.take()  # (a's second must wait: a has one running)
    assert (first.key.scope, second.key.scope) == ("a", "b")
    q.done(first)
    assert q.take().key.text == "1"
    assert [j.future.cancelled() for j in q.close()] == [False]  # (a's third, handed back on close)
