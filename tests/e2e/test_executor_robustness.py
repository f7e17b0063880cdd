"""The executor's Run stream under abuse: cancelled in every phase, bad plans, unparseable messages, another
session's pages, a scheduler whose step timeout cuts a long prefill. One executor process serves the module
and must survive all of it (tests run in file order; the drain test at the end consumes it)."""

from __future__ import annotations

import asyncio
import random
import signal

import grpc
import pytest

from pagedkv.executor.v1 import executor_pb2 as pb
from pagedkv.executor.v1 import executor_pb2_grpc as pb_grpc
from tests.support.executor_requests import BLOCK, MAX_POSITIONS, VOCAB, new_request
from tests.support.procs import Proc, scheduler, wait_for

pytestmark = pytest.mark.e2e

try:
    from pagedkv.local_server import TEST_EXECUTOR_SECRET as SECRET
except ImportError:  # before executor authentication landed
    SECRET = "pagedkv-test-executor-secret-0123456789abcdef"

AUTH = (("authorization", f"Bearer {SECRET}"),)
RUN = "/pagedkv.executor.v1.Executor/Run"
PROMPT = [(7 * i + 3) % 250 + 1 for i in range(40)]  # 3 pages
LONG = 1200  # tokens in a prefill that takes a while on the CPU


def session(name: str) -> tuple[tuple[str, str], ...]:
    return (*AUTH, ("x-pagedkv-session", name))


def long_plan(step: int = 1) -> pb.StepPlan:
    tokens = [(5 * i + 1) % 250 + 1 for i in range(LONG)]
    pages = list(range(100, 100 + LONG // BLOCK + 1))
    return pb.StepPlan(step_id=step, new_requests=[new_request("long", tokens, pages)])


@pytest.fixture(scope="module")
def executor():
    proc = Proc("executor", "--threads", "1", "--num-pages", "256", "--num-host-pages", "32",
                env={"PAGEDKV_EXECUTOR_SECRET": SECRET, "PYTHONFAULTHANDLER": "1"})
    yield proc
    proc.stop()


def run(coro):
    return asyncio.run(coro)


async def decode(stub, metadata, first: pb.NewRequest, steps: int) -> tuple[list[int], str]:
    """One stream: the request's first step, then ``steps`` decodes; (sampled tokens, x-pagedkv-pages)."""
    call = stub.Run(metadata=metadata)
    tokens = []
    await call.write(pb.StepPlan(step_id=1, new_requests=[first]))
    for step in range(steps + 1):
        if step:
            await call.write(pb.StepPlan(step_id=step + 1, decodes=[first.request_id]))
        result = await call.read()
        assert not result.error, result.error
        tokens.append(result.sampled_token_ids[0])
    pages = dict(await call.initial_metadata()).get("x-pagedkv-pages", "")
    await call.done_writing()
    assert await call.read() is grpc.aio.EOF
    return tokens, pages


def assert_healthy(executor: Proc, alive: bool = True) -> None:
    assert not alive or executor.proc.poll() is None, executor.log()[-3000:]
    log = executor.log()
    for bad in ("never retrieved", "Segmentation fault", "Traceback", "Unexpected"):
        assert bad not in log, f"{bad!r} in the executor's log:\n{log[-3000:]}"


# ---- a plain disconnect ------------------------------------------------------------------------------
def test_a_dropped_stream_leaves_no_unretrieved_task_in_the_log(executor):
    """The scheduler drops its stream (cancels it, as ExecutorClient.drop does) after a step, or closes it: the
    executor used to log "Task exception was never retrieved ... StopAsyncIteration" on every drop."""
    async def main():
        async with grpc.aio.insecure_channel(executor.address) as ch:
            stub = pb_grpc.ExecutorStub(ch)
            for _ in range(3):
                call = stub.Run(metadata=session("eof"))
                await call.write(pb.StepPlan(step_id=1, new_requests=[new_request("a", PROMPT, [3, 4, 5])]))
                assert (await call.read()).sampled_token_ids
                call.cancel()
            tokens, _ = await decode(stub, session("eof"), new_request("a", PROMPT, [3, 4, 5]), 1)
            assert len(tokens) == 2

    run(main())
    assert wait_for(lambda: sum(e.get("event") == "scheduler_detached" for e in list(executor.events)) >= 4, 10)
    assert_healthy(executor)


# ---- sessions and page contents -------------------------------------------------------------------
def test_pages_stay_for_the_same_session_and_read_as_zeros_for_another(executor):
    """X writes a prompt's KV and decodes; X again, claiming the cached pages, decodes the same tokens; Y (or no
    session) claiming them must not (its pages were zeroed before its first plan); after Y, X's are gone too."""
    pages = [3, 4, 5]

    async def main():
        async with grpc.aio.insecure_channel(executor.address) as ch:
            stub = pb_grpc.ExecutorStub(ch)
            written, how_written = await decode(stub, session("x"), new_request("a", PROMPT, pages), 8)
            claim = new_request("b", PROMPT, pages, computed=len(PROMPT) - 1)  # only the last token computed
            again, how_again = await decode(stub, session("x"), claim, 8)
            assert again == written  # X's own pages: X's continuation
            other, how_other = await decode(stub, session("y"), claim, 8)
            assert other != written  # Y read zeros, not X's KV
            back, how_back = await decode(stub, session("x"), claim, 8)
            assert back == other  # Y attached in between: X's pages were zeroed as well
            anonymous, how_anonymous = await decode(stub, AUTH, claim, 8)
            assert anonymous == other
            recomputed, _ = await decode(stub, AUTH, new_request("c", PROMPT, pages), 8)
            assert recomputed == written  # the prompt computed afresh gives X's tokens: the claims read zeros
            assert (how_written, how_again, how_other, how_back, how_anonymous) == (
                "fresh", "kept", "fresh", "fresh", "fresh")

    run(main())
    assert executor.saw("pages_wiped")
    assert_healthy(executor)


# ---- bad plans -----------------------------------------------------------------------------------
def bad_plans() -> list[tuple[str, pb.StepPlan]]:
    """(text the error must contain, plan). Each would run a forward (or corrupt state) if let through."""
    ok = dict(tokens=PROMPT[:8], pages=[7])

    def one(field: str, tokens=None, pages=None, computed=0, scheduled=None, **sampling):
        req = new_request("bad", tokens or ok["tokens"], pages or ok["pages"], computed, **sampling)
        if scheduled is not None:
            req.num_scheduled_tokens = scheduled
        return field, pb.StepPlan(step_id=9, new_requests=[req])

    nan, inf = float("nan"), float("inf")
    cases = [
        one("token_ids[3]", tokens=[1, 2, 3, VOCAB, 5]),
        one("token_ids[0]", tokens=[-1, 2, 3]),
        one("max_position_embeddings", tokens=[1] * (MAX_POSITIONS + 1), pages=list(range(130)),
            computed=MAX_POSITIONS - 4),
        one("sampling.temperature", temperature=nan),
        one("sampling.temperature", temperature=inf),
        one("sampling.temperature", temperature=-0.5),
        one("sampling.top_p", temperature=1.0, top_p=nan),
        one("sampling.top_p", temperature=1.0, top_p=1.5),
        one("sampling.top_p", temperature=1.0, top_p=-0.1),
        one("sampling.top_k", temperature=1.0, top_k=-3),
        one("page id 256", pages=[256]),
        one("page id -2", pages=[-2]),
        one("num_computed_tokens", computed=-4),
        one("num_scheduled_tokens 0", scheduled=0),
        one("num_scheduled_tokens 9", scheduled=9),  # 9 of 8 known tokens
        one("does not fit", tokens=PROMPT, pages=[7]),  # 40 tokens in one 16-token page
    ]
    cases.append(("scheduled twice", pb.StepPlan(step_id=9, decodes=["good", "good"])))
    cases.append(("unknown to this executor", pb.StepPlan(step_id=9, decodes=["nobody"])))
    ops = pb.StepPlan(step_id=9)
    ops.page_ops.copy.add(src=1, dst=999)
    cases.append(("page_ops.copy", ops))
    return cases


def test_bad_plans_are_refused_naming_the_field_and_change_nothing(executor):
    async def main():
        async with grpc.aio.insecure_channel(executor.address) as ch:
            stub = pb_grpc.ExecutorStub(ch)
            call = stub.Run(metadata=session("v"))
            await call.write(pb.StepPlan(step_id=1, new_requests=[new_request("good", PROMPT[:8], [7])]))
            first = (await call.read()).sampled_token_ids[0]
            for field, plan in bad_plans():
                await call.write(plan)
                result = await call.read()
                assert field in result.error, (field, result.error)
                assert not result.sampled_token_ids and result.num_computed_tokens == 0
            # Nothing of those plans was committed: "good" decodes as if none had come, and a temperature
            # of 1e-38 is greedy (it sampled token 0 every time).
            await call.write(pb.StepPlan(step_id=2, decodes=["good"]))
            second = (await call.read()).sampled_token_ids[0]
            await call.write(pb.StepPlan(step_id=3, new_requests=[
                new_request("tiny", PROMPT[:8], [8], temperature=1e-38, seed=5)]))
            tiny = (await call.read()).sampled_token_ids[0]
            call.cancel()
            again, _ = await decode(stub, session("v"), new_request("good", PROMPT[:8], [7]), 1)
            assert again == [first, second] and tiny == first != 0

    run(main())
    assert_healthy(executor)


def test_unparseable_messages_get_invalid_argument(executor):
    async def main():
        async with grpc.aio.insecure_channel(executor.address) as ch:
            raw = ch.stream_stream(RUN, request_serializer=lambda b: b, response_deserializer=pb.StepResult.FromString)
            # corrupt wire format; forget = [one byte of invalid UTF-8]
            for body in (b"\xff\xff\xff\xff", b"\x22\x01\xc3"):
                call = raw(metadata=session("raw"))
                await call.write(pb.StepPlan(step_id=1).SerializeToString())
                assert (await call.read()).step_id == 1
                await call.write(body)
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await call.read()
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value
                assert "StepPlan" in err.value.details()

    run(main())
    assert_healthy(executor)


# ---- cancellation ---------------------------------------------------------------------------------
async def cancel_in_phase(stub, phase: int, rng: random.Random) -> None:
    call = stub.Run(metadata=session("c"))
    try:
        if phase == 0:  # before the first plan
            await asyncio.sleep(rng.random() * 0.01)
        elif phase == 1:  # mid-step: a long prefill is running
            await call.write(long_plan())
            await asyncio.sleep(rng.random() * 0.05)
        elif phase == 2:  # between steps
            await call.write(pb.StepPlan(step_id=1, new_requests=[new_request("s", PROMPT, [0, 1, 2])]))
            await call.read()
        elif phase == 3:  # after a decode, with the next plan written
            await call.write(pb.StepPlan(step_id=1, new_requests=[new_request("s", PROMPT, [0, 1, 2])]))
            await call.read()
            await call.write(pb.StepPlan(step_id=2, decodes=["s"]))
            await call.read()
            await call.write(pb.StepPlan(step_id=3, decodes=["s"]))
        else:  # the scheduler closes the stream itself (the plain disconnect)
            await call.write(long_plan())
            await call.done_writing()
            assert (await call.read()).sampled_token_ids
            assert await call.read() is grpc.aio.EOF
    except grpc.aio.AioRpcError as err:
        raise AssertionError(f"phase {phase}: {err.code()} {err.details()}") from err
    call.cancel()


def test_run_streams_cancelled_in_every_phase_100_times(executor):
    rng = random.Random(13)

    async def main():
        async with grpc.aio.insecure_channel(executor.address) as ch:
            stub = pb_grpc.ExecutorStub(ch)
            reference, _ = await decode(stub, session("c"), new_request("r", PROMPT, [0, 1, 2]), 4)
            for i in range(100):
                await cancel_in_phase(stub, i % 5, rng)
                if i % 10 == 9:
                    assert executor.proc.poll() is None, f"the executor died after {i + 1} cancellations"
            final, _ = await decode(stub, session("c"), new_request("r", PROMPT, [0, 1, 2]), 4)
            assert final == reference

    run(main())
    assert_healthy(executor)


def test_scheduler_step_timeout_cancelling_a_long_prefill(executor):
    """The scheduler cancels the Run stream when a step outlasts --step-timeout (a long prompt's prefill
    here), then reconnects: the executor must survive every such cancel."""
    from pagedkv.client import Client

    def count(event: str) -> int:
        return sum(e.get("event") == event for e in list(executor.events))

    attached, detached = count("scheduler_attached"), count("scheduler_detached")
    # (1 ms: a 1,500-token prefill outlasts it on any machine; ~0.1-0.5 s on the CPU)
    sched = scheduler(executor.address, args=("--step-timeout", "0.001", "--unplaced-timeout", "4",
                                              "--max-num-batched-tokens", "2048"))
    try:
        async def main():
            async with Client(sched.address) as client:
                # How the request ends is the scheduler's business (it retries the step on a new stream); the
                # executor must live through the cancels: wait for three, then give up on the request.
                request = asyncio.ensure_future(client.complete([(3 * i) % 250 + 1 for i in range(1500)],
                                                                max_tokens=4))
                for _ in range(600):
                    if request.done() or count("scheduler_detached") >= detached + 3:
                        break
                    await asyncio.sleep(0.05)
                request.cancel()
                await asyncio.gather(request, return_exceptions=True)

        run(main())
        assert count("scheduler_detached") >= detached + 3 and count("scheduler_attached") >= attached + 3
    finally:
        sched.stop()
    assert wait_for(lambda: count("scheduler_detached") == count("scheduler_attached"), 10)

    async def main():
        async with grpc.aio.insecure_channel(executor.address) as ch:
            stub = pb_grpc.ExecutorStub(ch)
            tokens, _ = await decode(stub, session("after"), new_request("r", PROMPT, [0, 1, 2]), 2)
            assert len(tokens) == 3

    run(main())
    assert_healthy(executor)


def test_drain_while_idle_ends_the_stream_cleanly(executor):
    """SIGTERM with an idle scheduler attached: the executor ends the stream itself (its read of the next plan
    is still in flight) and exits 0, with nothing in its log about an unretrieved task."""
    async def main():
        async with grpc.aio.insecure_channel(executor.address) as ch:
            stub = pb_grpc.ExecutorStub(ch)
            call = stub.Run(metadata=session("d"))
            await call.write(pb.StepPlan(step_id=1, new_requests=[new_request("r", PROMPT, [0, 1, 2])]))
            result = await call.read()
            await call.write(pb.StepPlan(step_id=2, forget=["r"]))
            await call.read()
            executor.signal(signal.SIGTERM)
            assert await asyncio.wait_for(call.read(), 30) is grpc.aio.EOF
            assert await call.code() == grpc.StatusCode.OK
            return result

    assert run(main()).sampled_token_ids
    assert executor.wait(30) == 0
    assert_healthy(executor, alive=False)
