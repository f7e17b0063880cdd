"""Malformed step plans sent to a ``pagedkv executor`` with valid credentials (issue 13, the adversarial suite).

Each case opens a Run stream, starts a good request ("good": 8 prompt tokens on page 7), sends one bad plan, and
expects it refused as a whole (StepResult.error naming what is wrong, nothing sampled, nothing computed); then
"good" decodes its next token exactly as an undisturbed stream does (nothing of the bad plan was committed).
Hypothesis then sends random plans (ids, counts and page ids around every limit): each gets a StepResult,
and afterwards a fresh stream computes the reference tokens. The executor process must outlive all of it.
"""

from __future__ import annotations

import asyncio
import math

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pagedkv.executor.v1 import executor_pb2 as pb
from pagedkv.executor.v1 import executor_pb2_grpc as pb_grpc
from pagedkv.local_server import TEST_EXECUTOR_SECRET
from tests.support.adversarial_profiles import profile
from tests.support.procs import Proc

pytestmark = pytest.mark.e2e

VOCAB, MAX_POSITIONS, BLOCK = 259, 2048, 16  # tiny-llama
NUM_PAGES, NUM_HOST_PAGES = 160, 16
I32_MAX, I32_MIN = 2**31 - 1, -(2**31)
AUTH = (("authorization", f"Bearer {TEST_EXECUTOR_SECRET}"),)
PROMPT = [(7 * i + 3) % 250 + 1 for i in range(8)]
NAN, INF = math.nan, math.inf


@pytest.fixture(scope="module")
def executor(model_cache):
    proc = Proc("executor", "--threads", "1", "--num-pages", str(NUM_PAGES), "--num-host-pages", str(NUM_HOST_PAGES),
                env={"PAGEDKV_EXECUTOR_SECRET": TEST_EXECUTOR_SECRET, "PYTHONFAULTHANDLER": "1"})
    yield proc
    proc.stop()


def new(rid: str = "bad", tokens=None, pages=None, computed: int = 0, scheduled: int | None = None,
        **fields) -> pb.NewRequest:
    tokens = PROMPT if tokens is None else tokens
    sampling = {k: fields.pop(k) for k in ("temperature", "top_p", "top_k", "seed") if k in fields}
    return pb.NewRequest(request_id=rid, token_ids=tokens, num_computed_tokens=computed,
                         num_scheduled_tokens=len(tokens) - computed if scheduled is None else scheduled,
                         page_ids=[9] if pages is None else pages, sampling=pb.SamplingParams(**sampling), **fields)


def plan(*news: pb.NewRequest, **fields) -> pb.StepPlan:
    return pb.StepPlan(step_id=5, new_requests=list(news), **fields)


def cont(rid: str = "good", n: int = 1, pages=(), dropped=()) -> pb.ContinuingRequest:
    return pb.ContinuingRequest(request_id=rid, num_scheduled_tokens=n, new_page_ids=list(pages),
                                dropped_page_indices=list(dropped))


def ops(swap_out=(), swap_in=(), copy=()) -> pb.PageOps:
    def copies(pairs):
        return [pb.PageCopy(src=s, dst=d) for s, d in pairs]
    return pb.PageOps(swap_out=copies(swap_out), swap_in=copies(swap_in), copy=copies(copy))


LONG = [1] * (MAX_POSITIONS + 1)
# (name, plan, text the error must contain)
CASES = [
    # page ids
    ("page id = num_pages", plan(new(pages=[NUM_PAGES])), "page id"),
    ("page id -1 (no window)", plan(new(pages=[-1])), "page id"),
    ("page id int32 max", plan(new(pages=[I32_MAX])), "page id"),
    ("page id int32 min", plan(new(pages=[I32_MIN])), "page id"),
    ("too few pages", plan(new(tokens=PROMPT * 3, pages=[9])), "does not fit"),
    ("window request writes a dropped page", plan(new(pages=[-1], window_tokens=4, sink_tokens=0)), "dropped"),
    # token ids and positions
    ("token id = vocab", plan(new(tokens=[1, VOCAB])), "vocabulary"),
    ("token id -1", plan(new(tokens=[-1, 2])), "vocabulary"),
    ("token id int32 max", plan(new(tokens=[1, I32_MAX])), "vocabulary"),
    ("token id int32 min", plan(new(tokens=[I32_MIN])), "vocabulary"),
    ("position past max_position_embeddings", plan(new(tokens=LONG, pages=list(range(10, 140)),
                                                       computed=MAX_POSITIONS)), "max_position_embeddings"),
    # counts
    ("num_computed_tokens -1", plan(new(computed=-1, scheduled=1)), "num_computed_tokens"),
    ("num_computed_tokens past the tokens", plan(new(computed=9, scheduled=1)), "does not fit"),
    ("num_computed_tokens int32 max", plan(new(computed=I32_MAX, scheduled=1)), "does not fit"),
    ("num_scheduled_tokens 0", plan(new(scheduled=0)), "num_scheduled_tokens"),
    ("num_scheduled_tokens -1", plan(new(scheduled=-1)), "num_scheduled_tokens"),
    ("num_scheduled_tokens past the tokens", plan(new(scheduled=9)), "num_scheduled_tokens"),
    ("num_scheduled_tokens int32 max", plan(new(scheduled=I32_MAX)), "num_scheduled_tokens"),
    ("num_scheduled_tokens int32 min", plan(new(scheduled=I32_MIN)), "num_scheduled_tokens"),
    ("num_output_tokens -1", plan(new(num_output_tokens=-1)), "num_output_tokens"),
    ("sink_tokens -1", plan(new(sink_tokens=-1)), "sink_tokens"),
    ("window_tokens -1", plan(new(window_tokens=-1)), "window_tokens"),
    ("no tokens", plan(new(tokens=[], scheduled=1)), "does not fit"),
    # sampling values
    ("temperature NaN", plan(new(temperature=NAN)), "sampling.temperature"),
    ("temperature +inf", plan(new(temperature=INF)), "sampling.temperature"),
    ("temperature -inf", plan(new(temperature=-INF)), "sampling.temperature"),
    ("temperature -1", plan(new(temperature=-1.0)), "sampling.temperature"),
    ("top_p NaN", plan(new(temperature=1.0, top_p=NAN)), "sampling.top_p"),
    ("top_p +inf", plan(new(temperature=1.0, top_p=INF)), "sampling.top_p"),
    ("top_p -1", plan(new(temperature=1.0, top_p=-1.0)), "sampling.top_p"),
    ("top_p 1e38", plan(new(temperature=1.0, top_p=1e38)), "sampling.top_p"),
    ("top_k -1", plan(new(temperature=1.0, top_k=-1)), "sampling.top_k"),
    ("top_k int32 min", plan(new(temperature=1.0, top_k=I32_MIN)), "sampling.top_k"),
    # requests the executor does not know, or twice
    ("unknown continuing request", plan(continuing=[cont("ghost")]), "unknown"),
    ("unknown decode", plan(decodes=["ghost"]), "unknown"),
    ("decode twice", plan(decodes=["good", "good"]), "twice"),
    ("continuing and decode", plan(continuing=[cont()], decodes=["good"]), "twice"),
    ("new request twice", plan(new(), new()), "twice"),
    ("new request over a decode of it", plan(new("good", pages=[7]), decodes=["good"]), "twice"),
    # a known request, inconsistent deltas
    ("continuing: new page out of range", plan(continuing=[cont(pages=[NUM_PAGES])]), "page id"),
    ("continuing: new page -1", plan(continuing=[cont(pages=[-1])]), "page id"),
    ("continuing: 0 tokens", plan(continuing=[cont(n=0)]), "num_scheduled_tokens"),
    ("continuing: more tokens than known", plan(continuing=[cont(n=2)]), "num_scheduled_tokens"),
    ("continuing: -1 tokens", plan(continuing=[cont(n=-1)]), "num_scheduled_tokens"),
    ("continuing: pages dropped without a window", plan(continuing=[cont(dropped=[0])]), "window"),
    ("continuing: dropped index outside the table", plan(continuing=[cont(dropped=[I32_MAX])]), "dropped"),
    # page operations
    ("swap_out from a device page out of range", plan(page_ops=ops(swap_out=[(NUM_PAGES, 0)])), "page_ops"),
    ("swap_out to a host page out of range", plan(page_ops=ops(swap_out=[(0, NUM_HOST_PAGES)])), "page_ops"),
    ("swap_in from host page -1", plan(page_ops=ops(swap_in=[(-1, 0)])), "page_ops"),
    ("swap_in to device page int32 max", plan(page_ops=ops(swap_in=[(0, I32_MAX)])), "page_ops"),
    ("copy from page -1", plan(page_ops=ops(copy=[(-1, 3)])), "page_ops"),
    ("copy to num_pages", plan(page_ops=ops(copy=[(3, NUM_PAGES)])), "page_ops"),
    ("bad page op with a good request", plan(new(), page_ops=ops(copy=[(3, I32_MIN)])), "page_ops"),
]


async def good_stream(stub, metadata, steps: int) -> list[int]:
    call = stub.Run(metadata=metadata)
    await call.write(pb.StepPlan(step_id=1, new_requests=[new("good", pages=[7])]))
    tokens = [(await call.read()).sampled_token_ids[0]]
    for step in range(steps):
        await call.write(pb.StepPlan(step_id=2 + step, decodes=["good"]))
        tokens.append((await call.read()).sampled_token_ids[0])
    await call.done_writing()
    assert await call.read() is grpc.aio.EOF
    return tokens


@pytest.fixture(scope="module")
def reference(executor) -> list[int]:
    async def main():
        async with grpc.aio.insecure_channel(executor.address) as ch:
            return await good_stream(pb_grpc.ExecutorStub(ch), (*AUTH, ("x-pagedkv-session", "ref")), 1)
    return asyncio.run(main())


def assert_alive(executor) -> None:
    assert executor.proc.poll() is None, "the executor died:\n" + executor.log()[-3000:]


@pytest.mark.parametrize("name,bad,why", CASES, ids=[c[0] for c in CASES])
def test_bad_plan_is_refused_and_changes_nothing(executor, reference, name, bad, why):
    async def main():
        async with grpc.aio.insecure_channel(executor.address) as ch:
            call = pb_grpc.ExecutorStub(ch).Run(metadata=(*AUTH, ("x-pagedkv-session", "cases")))
            await call.write(pb.StepPlan(step_id=1, new_requests=[new("good", pages=[7])]))
            first = (await call.read()).sampled_token_ids[0]
            await call.write(bad)
            refused = await call.read()
            await call.write(pb.StepPlan(step_id=6, decodes=["good"]))
            second = (await call.read()).sampled_token_ids[0]
            await call.done_writing()
            return refused, [first, second]

    refused, tokens = asyncio.run(main())
    assert refused.error, f"{name}: accepted"
    assert why in refused.error, f"{name}: {refused.error!r} does not name {why!r}"
    assert not refused.sampled_token_ids and refused.num_computed_tokens == 0
    assert tokens == reference, f"{name}: the good request changed after the refused plan"
    assert_alive(executor)


def test_without_credentials_nothing_but_health_answers(executor):
    async def main():
        async with grpc.aio.insecure_channel(executor.address) as ch:
            stub = pb_grpc.ExecutorStub(ch)
            codes = []
            for md in ((), (("authorization", "Bearer wrong"),), (("authorization", TEST_EXECUTOR_SECRET),)):
                try:
                    await stub.Describe(pb.DescribeRequest(), metadata=md)
                    codes.append(grpc.StatusCode.OK)
                except grpc.aio.AioRpcError as err:
                    codes.append(err.code())
            return codes

    assert asyncio.run(main()) == [grpc.StatusCode.UNAUTHENTICATED] * 3
    assert_alive(executor)


SMALL = st.one_of(st.integers(-2, 20), st.sampled_from([NUM_PAGES - 1, NUM_PAGES, I32_MAX, I32_MIN, VOCAB - 1, VOCAB]))
FLOAT = st.one_of(st.floats(width=32), st.sampled_from([0.0, 1e-45, 1.0]))
RIDS = st.sampled_from(["a", "b", "good", ""])
NEW = st.builds(pb.NewRequest, request_id=RIDS, token_ids=st.lists(SMALL, max_size=24), num_computed_tokens=SMALL,
                num_scheduled_tokens=SMALL, page_ids=st.lists(SMALL, max_size=4),
                sampling=st.builds(pb.SamplingParams, temperature=FLOAT, top_p=FLOAT, top_k=SMALL),
                num_output_tokens=SMALL, sink_tokens=SMALL, window_tokens=SMALL)
CONT = st.builds(pb.ContinuingRequest, request_id=RIDS, num_scheduled_tokens=SMALL,
                 new_page_ids=st.lists(SMALL, max_size=3), dropped_page_indices=st.lists(SMALL, max_size=2))
COPIES = st.lists(st.builds(pb.PageCopy, src=SMALL, dst=SMALL), max_size=2)
PLANS = st.lists(st.builds(pb.StepPlan, step_id=st.integers(0, 2**64 - 1), new_requests=st.lists(NEW, max_size=2),
                           continuing=st.lists(CONT, max_size=2), forget=st.lists(RIDS, max_size=2),
                           page_ops=st.builds(pb.PageOps, swap_out=COPIES, swap_in=COPIES, copy=COPIES),
                           decodes=st.lists(RIDS, max_size=2)), min_size=1, max_size=4)


@given(plans=PLANS)
@profile(ci_examples=40, long_examples=600)
def test_random_plans_get_an_answer_and_the_executor_stays_correct(executor, reference, plans):
    async def main():
        async with grpc.aio.insecure_channel(executor.address) as ch:
            stub = pb_grpc.ExecutorStub(ch)
            call = stub.Run(metadata=(*AUTH, ("x-pagedkv-session", "fuzz")))
            results = []
            try:
                for p in plans:
                    await call.write(p)
                    results.append(await call.read())
                await call.done_writing()
                assert await call.read() is grpc.aio.EOF
            except grpc.aio.AioRpcError as err:  # refusing the stream itself is documented too
                assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err
            # any other session starts from zeroed pages: the reference tokens again, whatever was written
            return results, await good_stream(stub, (*AUTH, ("x-pagedkv-session", "check")), 1)

    results, tokens = asyncio.run(main())
    for p, r in zip(plans, results):
        assert r.step_id == p.step_id
        assert all(0 <= t < VOCAB for t in r.sampled_token_ids)
        assert len(r.sampled_rows) == len(r.sampled_token_ids) == len(r.sampled_logprobs)
        assert list(r.sampled_rows) == sorted(set(r.sampled_rows))
        assert all(row < len(p.new_requests) + len(p.continuing) + len(p.decodes) for row in r.sampled_rows)
    assert tokens == reference
    assert_alive(executor)
