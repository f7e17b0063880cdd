"""The scheduler's side of constraint compiles (issue #46, F2/F3), in one process with stand-in executor stubs:
GrammarGate asks once per constraint however many requests bring it, at most ``per_tenant`` compiles of a tenant
at a time, counts the requests in that phase (queued, for the queue bounds), trusts an executor's answer only for
that executor process, charges the compile CPU to the tenant; ConstraintHold keeps a request away from a planner
until its executor holds the grammar; a request the executor ended (StepResult.failed_rows) ends with
INVALID_ARGUMENT and the executor's error, and the matchers' CPU is charged to the rows' tenants."""

from __future__ import annotations

import asyncio
import types

import pytest
import structlog

from pagedkv.bounds import InvalidRequest
from pagedkv.executor.v1 import executor_pb2 as pb
from scheduler_svc.constraint_hold import ConstraintHold
from scheduler_svc.grammar_gate import GrammarGate, grammar_key, grammar_scope
from scheduler_svc.outputs import OutputProcessor, TokenOutcome
from scheduler_svc.request import Finish, Output, Request, Sampling, Status
from tests.support.fake_executor import NullTokenizer

pytestmark = pytest.mark.unit


class Stub:
    """An executor's CheckConstraint: answers when ``release`` is set, with ``error`` for constraints it refuses."""

    def __init__(self, error: dict[str, str] | None = None, cpu_ms: float = 40.0) -> None:
        self.calls: list[pb.Constraint] = []
        self.running = self.most = 0
        self.release = asyncio.Event()
        self.error = error or {}
        self.cpu_ms = cpu_ms

    async def CheckConstraint(self, c, timeout, metadata):  # noqa: N802
        self.calls.append(c)
        self.running += 1
        self.most = max(self.most, self.running)
        await self.release.wait()
        self.running -= 1
        return pb.CheckConstraintResponse(error=self.error.get(c.regex, ""), compile_cpu_ms=self.cpu_ms)


def client(address: str, stub: Stub):
    return types.SimpleNamespace(address=address, stub=stub, metadata=())


def regex(text: str, tenant: str = "t") -> pb.Constraint:
    return pb.Constraint(regex=text, end_token_ids=[2], scope=grammar_scope(tenant))


def test_one_call_per_constraint_and_per_tenant_compiles_bounded():
    async def run():
        charged = []
        gate = GrammarGate(per_tenant=2, charge=lambda t, s: charged.append((t, s)))
        stub = Stub()
        targets = [(client("e1", stub), "id1")]
        same = [asyncio.create_task(gate.compile("t", regex("a+"), targets)) for _ in range(3)]
        others = [asyncio.create_task(gate.compile("t", regex(f"b{i}+"), targets)) for i in range(3)]
        await asyncio.sleep(0.01)
        assert gate.compiling("t") == 6 and gate.compiling_total == 6  # (counted as queued meanwhile)
        assert stub.running == 2  # (two of the tenant's compiles at a time)
        stub.release.set()
        await asyncio.gather(*same, *others)
        return gate, stub, charged

    gate, stub, charged = asyncio.run(run())
    assert [c.regex for c in stub.calls].count("a+") == 1 and len(stub.calls) == 4 and stub.most == 2
    assert gate.compiling("t") == 0
    assert gate.ready("e1", "id1", regex("a+")) and not gate.ready("e1", "id2", regex("a+"))  # (a restarted one)
    assert not gate.ready("e1", "id1", regex("a+", tenant="u"))  # (another tenant's scope)
    assert charged == [("t", 0.04)] * 4


def test_a_refusal_names_the_field_and_is_not_trusted_as_ready():
    async def run():
        gate = GrammarGate()
        stub = Stub(error={"bad": "sampling.constraint.regex: compiling it takes more than ..."})
        stub.release.set()
        with pytest.raises(InvalidRequest, match=r"^prompt.chat.tools: sampling.constraint.regex: compiling"):
            await gate.compile("t", regex("bad"), [(client("e1", stub), "id1")], "prompt.chat.tools")
        return gate

    gate = asyncio.run(run())
    assert not gate.ready("e1", "id1", regex("bad")) and gate.compiling("t") == 0


def test_the_key_ignores_end_tokens_but_not_scope():
    assert grammar_key(regex("a")) == grammar_key(pb.Constraint(regex="a", scope=grammar_scope("t")))
    assert grammar_key(regex("a")) != grammar_key(regex("a", tenant="u"))
    assert grammar_scope("t") != "t" and len(grammar_scope("t")) == 32  # (no tenant name on the wire)


def _request(rid: str = "q1", constraint: pb.Constraint | None = None) -> Request:
    from scheduler_svc.detokenizer import IncrementalDetokenizer

    s = Sampling(max_tokens=4)
    s.constraint = constraint
    return Request(request_id=rid, prompt_ids=[1, 2], sampling=s, arrival=1, tenant="t",
                   detokenizer=IncrementalDetokenizer(NullTokenizer(), [1, 2], [], False))


class FakeEngine:
    def __init__(self, stub: Stub) -> None:
        self.address, self.executor_id, self.accepts = "e1", "id1", True
        self.client = client("e1", stub)
        self.log = structlog.get_logger()
        self.added: list[Request] = []
        self.relocated: list[Request] = []
        self.hooks = types.SimpleNamespace(relocate=lambda reqs, engine: self.relocated.extend(reqs))
        self.hold: ConstraintHold | None = None

    def add_request(self, req, front=False) -> None:
        if not self.hold.holds(req, front):
            self.added.append(req)


def test_a_request_waits_for_its_executors_grammar_then_goes_to_the_planner_or_ends():
    async def run():
        gate = GrammarGate()
        stub = Stub(error={"bad": "sampling.constraint.regex: not usable: ..."})
        engine = FakeEngine(stub)
        engine.hold = ConstraintHold(engine, gate)
        plain, good, bad = _request("q0"), _request("q1", regex("a+")), _request("q2", regex("bad"))
        for r in (plain, good, bad):
            engine.add_request(r)
        assert engine.added == [plain] and len(engine.hold) == 2  # (held: the executor is asked first)
        stub.release.set()
        ended = await asyncio.wait_for(bad.outbox.get(), 5)
        while len(engine.hold):
            await asyncio.sleep(0.001)
        again = _request("q3", regex("a+"))
        engine.add_request(again)  # (confirmed now: straight to the planner)
        return engine, ended, good, again

    engine, ended, good, again = asyncio.run(run())
    assert engine.added[1:] == [good, again] and not engine.relocated
    assert ended.finish is Finish.ABORT and ended.error_code == "INVALID_ARGUMENT" and "not usable" in ended.error


def test_a_request_the_executor_ended_ends_with_its_error_and_grammar_cpu_is_charged():
    req = _request("q1", regex("a+"))
    req.status = Status.RUNNING
    result = pb.StepResult(step_id=1, failed_rows=[0], failed_errors=["sampling.constraint: its grammar's matcher "
                                                                         "took 30.0 ms ..."],
                           grammar_rows=[0], grammar_cpu_us=[30000])
    charged = []

    def end(r: Request, outcome: TokenOutcome) -> Output:
        r.status = Status.FINISHED
        return Output("", [], [], outcome.finish, error=outcome.error)

    outputs = OutputProcessor({2}, 16).take_samples([req], result, lambda t, **kw: charged.append((t, kw)), end)
    assert charged == [("t", {"grammar_cpu_s": 0.03})]
    [(r, out)] = outputs
    assert r is req and out.finish is Finish.ABORT and out.error_code == "INVALID_ARGUMENT"
    assert out.error.startswith("sampling.constraint: its grammar's matcher took")
