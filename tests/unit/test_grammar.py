"""Structured outputs on the executor, in one process: the grammar mask applied to a step's logits (constrained rows
only; their argmax and draws among the tokens the grammar allows; the grammar wins where other controls leave
nothing), the matcher rebuilt exactly from a request's outputs when it is sent in full, errors that name the field,
and the scheduler's checks before it asks an executor."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest
import torch

from executor_svc.grammar import CompileLimit, ConstraintError, GrammarEngine, constraint_key
from executor_svc.grammar_jobs import GrammarState, Matchers
from executor_svc.grammar_mask import GrammarMask, allowed, constrain
from executor_svc.plan_check import PlanError, RequestMirror
from executor_svc.sampler import SamplingParams, sample
from pagedkv.api.v1 import api_pb2 as api
from pagedkv.bounds import InvalidRequest
from pagedkv.executor.v1 import executor_pb2 as pb
from scheduler_svc.constraints import MAX_CONSTRAINT_BYTES, check_constraint
from scheduler_svc.request import Sampling

pytestmark = pytest.mark.unit

VOCAB = 320  # tiny-llama's logits (its tokenizer has 259 tokens)
EOS = 2
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 4},
                                           "kind": {"enum": ["cat", "dog"]},
                                           "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}},
          "required": ["name", "kind", "tags"]}


def random_bitmask(rows: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-2 ** 31, 2 ** 31 - 1, (rows, (vocab + 31) // 32), dtype=torch.int32, generator=g)


def bit(bitmask: torch.Tensor, row: int, token: int) -> bool:
    return bool((int(bitmask[row, token // 32]) >> (token % 32)) & 1)


def test_unpacked_bits_are_xgrammars_layout():
    bm = random_bitmask(3, 100, 1)
    ok = allowed(bm, 100, torch.device("cpu"))
    assert ok.shape == (3, 100)
    assert all(bool(ok[r, t]) == bit(bm, r, t) for r in range(3) for t in range(100))


def test_mask_touches_constrained_rows_only_and_their_tokens_are_allowed():
    logits = torch.randn(5, VOCAB, generator=torch.Generator().manual_seed(2))
    raw = logits.clone()
    rows = [1, 3]
    bm = random_bitmask(len(rows), VOCAB, 3)
    bm[1] = 0
    bm[1, 0] = 1 << 7  # row 3: token 7 alone
    params = [SamplingParams(), SamplingParams(), SamplingParams(temperature=1.0, seed=4), SamplingParams(),
              SamplingParams(temperature=0.8, seed=5)]
    given = logits.clone()
    tokens = sample(given, params, [0] * 5, grammar=GrammarMask(rows, bm)).tokens
    # the constrained rows are masked in place where none of them wants log-probabilities; the others stay
    assert torch.equal(given[[0, 2, 4]], raw[[0, 2, 4]]) and not torch.equal(given[rows], raw[rows])
    wanting = [dataclasses.replace(p, logprobs=True) if i in rows else p for i, p in enumerate(params)]
    again = sample(logits, wanting, [0] * 5, grammar=GrammarMask(rows, bm)).tokens
    assert again == tokens and torch.equal(logits, raw)  # (theirs are the model's logits: kept)
    plain = sample(logits, params, [0] * 5).tokens
    assert [tokens[i] for i in (0, 2, 4)] == [plain[i] for i in (0, 2, 4)]
    assert bit(bm, 0, tokens[1]) and tokens[3] == 7
    masked = constrain(logits, logits, GrammarMask(rows, bm))
    for j, r in enumerate(rows):
        best = max((t for t in range(VOCAB) if bit(bm, j, t)), key=lambda t: float(raw[r, t]))
        assert int(masked[r].argmax()) == best
    assert torch.equal(masked[[0, 2, 4]], raw[[0, 2, 4]])


def test_the_grammar_wins_where_the_other_controls_leave_nothing():
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(6))
    bm = torch.zeros(2, (VOCAB + 31) // 32, dtype=torch.int32)
    bm[:, 0] = (1 << 5) | (1 << 9)  # the grammar allows 5 and 9
    params = [SamplingParams(allowed_token_ids=(11, 12)), SamplingParams(allowed_token_ids=(9, 12))]
    tokens = sample(logits, params, [0, 0], grammar=GrammarMask([0, 1], bm)).tokens
    assert tokens[0] in (5, 9)  # nothing allowed by both: the grammar alone
    assert tokens[1] == 9  # the intersection


@pytest.fixture(scope="module")
def engine(tiny_llama_dir) -> GrammarEngine:
    e = GrammarEngine(tiny_llama_dir, VOCAB, compile_timeout=30.0, compile_workers=0)  # (threads: the unit tier)
    yield e
    e.close()


@pytest.fixture(scope="module")
def matchers() -> Matchers:
    return Matchers(threads=2, step_budget_ms=5000.0, tenant_budget_ms=10000.0)


def _constraint(**kind) -> pb.Constraint:
    return pb.Constraint(**kind, end_token_ids=[EOS])


def _new(rid: str, tokens: list[int], num_output: int, constraint: pb.Constraint, **sampling) -> pb.NewRequest:
    first = 0 if rid == "a" else 32
    return pb.NewRequest(request_id=rid, token_ids=tokens, num_computed_tokens=len(tokens) - 1,
                         num_scheduled_tokens=1, page_ids=list(range(first, first + 32)),
                         sampling=pb.SamplingParams(**sampling), num_output_tokens=num_output, constraint=constraint)


def compiled(engine: GrammarEngine, c: pb.Constraint):
    return engine.submit(c).result(timeout=60).grammar


def _mirror(engine: GrammarEngine) -> RequestMirror:
    mirror = RequestMirror(num_pages=64, num_host_pages=0, block_size=4, vocab_size=VOCAB, max_positions=None)
    mirror.grammars = engine
    return mirror


def _state(engine: GrammarEngine, c: pb.Constraint, outputs: list[int] = ()) -> GrammarState:
    compiled(engine, c)
    mirror = _mirror(engine)
    mirror.apply(pb.StepPlan(step_id=1, new_requests=[_new("a", [5, *outputs], len(outputs), c)]))
    return mirror.requests["a"].grammar


def _step(matchers: Matchers, *states: GrammarState):
    """One step's matcher work for ``states``: (mask, failed rows)."""
    step = matchers.step()
    step.start(list(states))
    return step.wait()


def _bits(matchers: Matchers, state: GrammarState) -> torch.Tensor | None:
    mask, failed = _step(matchers, state)
    assert not failed, failed
    return mask.bitmask.clone() if mask is not None else None


def test_the_matcher_rebuilt_from_the_outputs_equals_the_advanced_one(engine, matchers):
    """The runner's path (the step's job accepts the last token and fills the mask; sample), then the request resent
    in full (recompute, swap-in, migration, resume all send a NewRequest): the rebuilt matcher, replaying the outputs,
    allows exactly what the advanced one does, step after step."""
    c = _constraint(json_schema=json.dumps(SCHEMA), strict=True)
    prompt = [5, 6, 7]
    compiled(engine, c)
    mirror = _mirror(engine)
    mirror.apply(pb.StepPlan(step_id=1, new_requests=[_new("a", prompt, 0, c, temperature=1.0, seed=9)]))
    a = mirror.requests["a"]
    g = torch.Generator().manual_seed(10)
    for step in range(150):
        resent = _mirror(engine)
        resent.apply(pb.StepPlan(step_id=2, new_requests=[_new("a", a.token_ids, a.num_output, c)]))
        rebuilt = resent.requests["a"].grammar
        mask = _bits(matchers, a.grammar)
        again = _bits(matchers, rebuilt)
        assert rebuilt.terminated == a.grammar.terminated
        if mask is None:
            break
        assert torch.equal(again, mask), f"step {step}"
        tokens = sample(torch.randn(1, VOCAB, generator=g), [a.sampling], [a.num_output],
                        grammar=GrammarMask([0], mask)).tokens
        a.grammar.pending.append(tokens[0])
        a.token_ids.append(tokens[0])
        a.num_output += 1
    assert a.grammar.terminated and a.token_ids[-1] == EOS
    text = bytes(t - 3 for t in a.token_ids[len(prompt):-1]).decode()  # (tiny-llama: byte b is token b + 3)
    value = json.loads(text)
    assert set(value) == {"name", "kind", "tags"} and value["kind"] in ("cat", "dog") and len(value["tags"]) <= 2


def test_outputs_that_break_the_constraint_end_that_request_alone(engine, matchers):
    """A resent request whose outputs do not follow its constraint (a resumed client's tokens) ends alone when its
    matcher replays them; the plan stands."""
    c = _constraint(choice=pb.Choices(choices=["yes", "no"]))
    bad = _state(engine, c, [ord("x") + 3])
    good = _state(engine, c, [ord("y") + 3, ord("e") + 3])
    mask, failed = _step(matchers, bad, good)
    assert list(failed) == [0] and "output token 0 (123) does not follow its sampling.constraint" in failed[0]
    assert bad.failed == failed[0] and not good.failed
    assert mask.rows == [1] and bit(mask.bitmask, 0, ord("s") + 3) and not bit(mask.bitmask, 0, ord("o") + 3)


def test_an_executor_without_a_grammar_engine_refuses_constrained_requests():
    mirror = RequestMirror(num_pages=64, num_host_pages=0, block_size=4, vocab_size=VOCAB, max_positions=None)
    with pytest.raises(PlanError, match="no grammar engine"):
        mirror.apply(pb.StepPlan(step_id=1, new_requests=[_new("a", [5], 0, _constraint(regex="a+"))]))


def test_a_grammar_not_compiled_here_ends_the_request_never_the_plan(engine):
    """Nothing compiles on the step loop: a plan whose constraint is not cached (an executor that restarted, a
    grammar let go of) is applied, and that request carries why it ends."""
    mirror = _mirror(engine)
    c = _constraint(regex="never-checked-[0-9]+")
    mirror.apply(pb.StepPlan(step_id=1, new_requests=[_new("a", [5], 0, c), _new("b", [5], 0, pb.Constraint())]))
    assert not engine.cached(c)
    assert "its grammar is not compiled on this executor" in mirror.requests["a"].grammar.failed
    assert "no kind set" in mirror.requests["b"].grammar.failed


@pytest.mark.parametrize("kind, value, message", [
    ("json_schema", '{"type": "objectx"}', "sampling.constraint.json_schema: not usable: Unsupported type"),
    ("regex", "[a-", "sampling.constraint.regex: not usable: Regex parsing error"),
    ("grammar", "root ::= missing", "sampling.constraint.grammar: not usable: .*missing"),
    ("json_schema", "[" * 2000 + "]" * 2000, "sampling.constraint.json_schema: "),
])
def test_invalid_constraints_name_their_field(engine, kind, value, message):
    with pytest.raises(ConstraintError, match=message):
        compiled(engine, _constraint(**{kind: value}))


def test_compiled_grammars_are_cached_per_constraint_and_scope(engine):
    c = _constraint(regex="[0-9]{3}-[a-z]{2}")
    assert not engine.cached(c)
    first = compiled(engine, c)
    assert engine.cached(c) and compiled(engine, c) is first
    assert compiled(engine, pb.Constraint(regex="[0-9]{3}-[a-z]{2}", end_token_ids=[7])) is first  # (not the ends)
    other = pb.Constraint(regex="[0-9]{3}-[a-z]{2}", scope="another tenant")
    assert not engine.cached(other)  # (a tenant cannot tell what another compiled)
    assert compiled(engine, other) is not first and engine.cached(other)
    assert constraint_key(pb.Constraint(json_schema="{}", strict=True)) != constraint_key(pb.Constraint(
        json_schema="{}"))


def test_a_compile_past_its_cpu_limit_is_refused_and_remembered_in_its_scope(tiny_llama_dir):
    e = GrammarEngine(tiny_llama_dir, VOCAB, compile_timeout=1e-6, compile_workers=0)
    try:
        c = _constraint(regex="[a-z]{2,40}@[a-z]{3,30}\\.(com|org)", scope="t1")
        with pytest.raises(CompileLimit, match=r"limit of 1e-06 s of CPU \(--grammar-compile-timeout\)"):
            compiled(e, c)
        e.pool().timeout_s = 30.0
        with pytest.raises(CompileLimit, match="more than"):  # (refused at once from then on, in its scope)
            compiled(e, c)
        other = pb.Constraint()
        other.CopyFrom(c)
        other.scope = "t2"
        assert compiled(e, other) is not None  # (another tenant's is compiled: no tenant makes another's refused)
        assert e.compile_cpu_s > 0
    finally:
        e.close()


# ---- the scheduler's checks --------------------------------------------------------------------------------
def _check(constraint: api.Constraint, **sampling):
    p = api.SamplingParams(constraint=constraint)
    return check_constraint(p, Sampling(max_tokens=10, **sampling), [EOS])


def test_the_scheduler_sends_the_constraint_with_its_end_tokens():
    assert check_constraint(api.SamplingParams(), Sampling(max_tokens=1), [EOS]) is None
    out = _check(api.Constraint(json_schema=json.dumps(SCHEMA), strict=True), stop_token_ids=[9])
    assert out.json_schema == json.dumps(SCHEMA) and out.strict and list(out.end_token_ids) == [EOS, 9]
    choice = _check(api.Constraint(choice=api.Choices(choices=["a", "b"])))
    assert list(choice.choice.choices) == ["a", "b"]


@pytest.mark.parametrize("constraint, sampling, message", [
    (api.Constraint(), {}, "sampling.constraint: set one of json_schema"),
    (api.Constraint(regex="a" * (MAX_CONSTRAINT_BYTES + 1)), {}, f"regex: {MAX_CONSTRAINT_BYTES + 1} bytes; at most"),
    (api.Constraint(choice=api.Choices(choices=["x" * 40000, "y" * 40000])), {}, "choice: 80000 bytes"),
    (api.Constraint(choice=api.Choices(choices=["a", ""])), {}, "choice: 2 choices; give 1 to 1024, none empty"),
    (api.Constraint(json_schema="{not json"), {}, "json_schema: not JSON"),
    (api.Constraint(json_schema="[1, 2]"), {}, "json_schema: a JSON Schema is an object"),
    (api.Constraint(json_schema='{"a":' * 990 + "1" + "}" * 990), {},  # (F8: was a RecursionError, UNKNOWN)
     "sampling.constraint.json_schema: JSON nested more than 64 levels deep"),
    (api.Constraint(regex="a+", strict=True), {}, "sampling.constraint.strict: only with"),
    (api.Constraint(grammar=""), {}, "grammar: must not be empty"),
    (api.Constraint(json_object=True), {"ignore_eos": True}, "sampling.ignore_eos: refused with sampling.constraint"),
])
def test_the_scheduler_refuses_what_it_can_see_is_wrong(constraint, sampling, message):
    with pytest.raises(InvalidRequest, match=message):
        _check(constraint, **sampling)


def test_random_outputs_of_every_kind_follow_their_constraint(engine, matchers):
    """Seeded random logits through the mask until the grammar ends: each output is what its kind promises."""
    import re

    cases = [(_constraint(regex="[a-c]{2}-[0-9]{1,3}"), lambda s: re.fullmatch("[a-c]{2}-[0-9]{1,3}", s)),
             (_constraint(choice=pb.Choices(choices=["alpha", "beta", "gamma"])), lambda s: s in {"alpha", "beta",
                                                                                                   "gamma"}),
             (_constraint(grammar='root ::= "(" [0-9] ("+" [0-9])* ")"'), lambda s: re.fullmatch(r"\(\d(\+\d)*\)", s))]
    rng = random.Random(11)
    for c, check in cases:
        for trial in range(3):
            state = _state(engine, c)
            out = []
            for draw in range(60):
                mask, _ = _step(matchers, state)
                if mask is None:
                    break
                logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(rng.randrange(1 << 30)))
                tokens = sample(logits, [SamplingParams(temperature=1.0, seed=trial)], [draw], grammar=mask).tokens
                state.pending.append(tokens[0])
                out.append(tokens[0])
            assert out[-1] == EOS, (c, out)
            assert check(bytes(t - 3 for t in out[:-1]).decode()), (c, out)


@pytest.mark.parametrize("vocab", [49152, 1000, 50])
@pytest.mark.parametrize("adjusted", [False, True])
def test_the_cpu_op_masks_as_the_torch_path(vocab, adjusted, monkeypatch):
    """grammar_mask (cpu_ops.cpp) against the torch path, on random bitmasks (a row with every token, one with a
    single token, the rest random), some rows unconstrained, a vocabulary that is not a multiple of 32; adjusted:
    a row the other controls left at -inf takes the grammar alone over the raw logits."""
    import executor_svc.grammar_mask as gm
    from executor_svc.attention import cpu_kernel

    if cpu_kernel.load() is None:
        pytest.skip(f"the CPU kernel library is not built here: {cpu_kernel.reason()}")
    g = torch.Generator().manual_seed(vocab)
    raw = torch.randn(6, vocab, generator=g)
    rows = [0, 2, 3, 5]
    bm = torch.randint(-2**31, 2**31 - 1, (len(rows), (vocab + 31) // 32), generator=g, dtype=torch.int32)
    bm[0] = -1
    bm[1] = 0
    bm[1, 0] = 1 << 3
    masks = GrammarMask(rows, bm)
    out = {}
    for name in ("torch", "cpu"):
        if name == "torch":
            monkeypatch.setitem(gm._CPU, "op", None)
        else:
            monkeypatch.delitem(gm._CPU, "op", raising=False)
        logits = raw.clone()
        if adjusted:
            logits[2] = float("-inf")
            out[name] = gm.constrain(logits, raw, masks)  # (in place on the adjusted copy)
        else:
            out[name] = gm.constrain(logits, logits, masks)  # (logits kept: a new tensor)
            assert torch.equal(logits, raw)
    assert gm._CPU.get("op") is not None  # (the op ran)
    assert torch.equal(out["torch"], out["cpu"])


def test_without_xgrammar_a_constraint_is_refused_naming_what_is_missing(monkeypatch):
    import sys

    from executor_svc.grammar import build_grammar

    monkeypatch.setitem(sys.modules, "xgrammar", None)  # (import xgrammar raises ImportError)
    with pytest.raises(ConstraintError, match="structured outputs need xgrammar.*pip install --no-deps xgrammar"):
        build_grammar("regex", "a+", False)
