"""A stream outlives its executor's restart (issue 46, F9): a scheduler and its one executor on loopback; the executor
is SIGKILLed mid-stream and started again at its address RESTART_AFTER_S later (a supervisor's backoff, then the
start), longer than the client's old outage window (5 attempts, 7.75 s). The scheduler holds a request whose executor
died for --unplaced-timeout (0.5 s here), then ends its stream, and answers every call UNAVAILABLE "no executor is up"
until the executor is back. ``pagedkv.client.Client`` with its default ResumePolicy waits that out: the stream in
flight (resumed with its continuation) and one started during the outage both complete with no error, each exactly
the undisturbed greedy run (token ids, text, usage). ``pagedkv serve``'s own supervisor restarting a killed executor
with a stream in flight: tests/e2e/test_serve_supervision.py."""

from __future__ import annotations

import asyncio
import time

import pytest

from pagedkv.client import Client, Completion, accumulate
from tests.support.procs import executor, scheduler

pytestmark = pytest.mark.e2e

RESTART_AFTER_S = 9.0  # from the kill to the new executor's start (which then takes its own seconds)
STREAM = dict(max_tokens=300, ignore_eos=True, temperature=0.0)
IN_FLIGHT, DURING = "The executor dies under this stream:", "This one starts while no executor is up:"
BOUND_S = 120.0  # a hang fails the test instead of the suite


@pytest.fixture
def pair(model_cache):
    procs = {"executor": executor("--num-pages", "256")}
    procs["scheduler"] = scheduler(procs["executor"].address, args=("--unplaced-timeout", "0.5"))
    yield procs
    for p in reversed(procs.values()):
        p.stop()


async def _stream(client: Client, prompt: str, on_first_token=None) -> tuple[Completion, float]:
    """The completion, and when its first token came."""
    out, first_at = Completion(), 0.0
    async for msg in client.generate(prompt, **STREAM):
        if msg.token_ids and not first_at:
            first_at = time.monotonic()
            if on_first_token is not None:
                on_first_token()
        accumulate(out, msg)
    return out, first_at


def test_a_stream_waits_out_an_executor_restart_with_no_token_lost_or_repeated(pair):
    async def undisturbed() -> list[Completion]:
        async with Client(pair["scheduler"].address) as client:
            return [(await _stream(client, p))[0] for p in (IN_FLIGHT, DURING)]

    reference = asyncio.run(asyncio.wait_for(undisturbed(), BOUND_S))
    assert all(len(r.token_ids) == STREAM["max_tokens"] for r in reference)
    port = pair["executor"].port
    killed_at: list[float] = []

    def kill() -> None:
        pair["executor"].kill()  # (SIGKILL to its process group)
        killed_at.append(time.monotonic())

    async def disturbed() -> tuple[list[tuple[Completion, float]], float]:
        async with Client(pair["scheduler"].address) as client:
            first = asyncio.create_task(_stream(client, IN_FLIGHT, kill))
            while not killed_at:
                await asyncio.sleep(0.01)
            await asyncio.sleep(1.0)  # (the scheduler has seen the executor die: new requests are refused)
            second = asyncio.create_task(_stream(client, DURING))
            await asyncio.sleep(killed_at[0] + RESTART_AFTER_S - time.monotonic())
            pair["executor"] = await asyncio.to_thread(executor, "--num-pages", "256", port=port)
            back_at = time.monotonic()
            return await asyncio.gather(first, second), back_at

    (got, (during, during_first)), back_at = asyncio.run(asyncio.wait_for(disturbed(), BOUND_S))
    outage = back_at - killed_at[0]
    print(f"\nexecutor SIGKILLed mid-stream, serving again after {outage:.1f} s (restarted after "
          f"{RESTART_AFTER_S:g} s); the stream started during the outage got its first token "
          f"{during_first - back_at:.2f} s after that")
    for out, ref in ((got[0], reference[0]), (during, reference[1])):
        assert (out.token_ids, out.text, out.finish_reason) == (ref.token_ids, ref.text, "length")
        assert (out.prompt_tokens, out.completion_tokens) == (ref.prompt_tokens, STREAM["max_tokens"])
    assert outage > 7.75 and during_first > back_at  # (the old window would have given up; it waited)
    resumed = [e for e in pair["scheduler"].events if e.get("event") == "request_admitted" and "resumed" in e]
    assert resumed, "the stream in flight was not resumed by the client (the scheduler held it instead?)"
