"""A client stream that falls behind catches up in fewer messages: its Outbox (scheduler_svc/request.py) gives the
tokens of one fork that waited for the reader, and the fork's final message right behind them, as one message, and
the Generate handler sends that. Nothing is lost, reordered or duplicated: per fork the text, tokens, logprobs and
the finish are what one message per token would carry."""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.api.v1 import api_pb2 as api
from pagedkv.client import Client
from scheduler_svc import cluster as cluster_mod
from scheduler_svc import engine as engine_mod
from scheduler_svc import metrics
from scheduler_svc.api import GenerationService
from scheduler_svc.request import Finish, Outbox, Output
from scheduler_svc.validation import Limits
from tests.support.fake_cluster import Box, FakeClient, new_cluster
from tests.support.fake_executor import NullTokenizer
from tests.support.fake_grpc import Context

pytestmark = pytest.mark.unit


def _stream(forks: int, lengths: list[int], order: list[int], error_fork: int | None) -> list[Output]:
    """Each fork's token messages then its final (an error final for error_fork), interleaved by ``order``."""
    per_fork = []
    for f in range(forks):
        msgs = [Output(f"t{f}.{i} ", [100 * f + i], [-0.5 * i], index=f) for i in range(lengths[f])]
        if f == error_fork:
            msgs.append(Output("", [], [], Finish.ABORT, error="executor failed", index=f))
        else:
            msgs.append(Output(f"end{f}", [], [], Finish.LENGTH, "", index=f, prompt_tokens=3,
                               completion_tokens=lengths[f]))
        per_fork.append(deque(msgs))
    out = []
    for pick in order:
        live = [q for q in per_fork if q]
        if not live:
            break
        out.append(live[pick % len(live)].popleft())
    for q in per_fork:
        out.extend(q)
    return out


def _put(box: Outbox, m: Output) -> None:
    """As the scheduler puts it: a token of a request that goes on by itself, anything else as a message."""
    if m.finish is None and not m.error and len(m.token_ids) == 1:
        box.token(m.index, m.text, m.token_ids[0], m.logprobs[0] if m.logprobs else None)
    else:
        box.put_nowait(m)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(forks=st.integers(1, 3), lengths=st.lists(st.integers(0, 6), min_size=3, max_size=3),
       order=st.lists(st.integers(0, 5), max_size=30), bursts=st.lists(st.integers(0, 5), min_size=1, max_size=8),
       error=st.booleans(), logprobs=st.booleans())
def test_coalescing_keeps_each_fork_whole_and_in_order(forks, lengths, order, bursts, error, logprobs):
    messages = _stream(forks, lengths, order, 0 if error else None)
    if not logprobs:
        messages = [replace(m, logprobs=[]) for m in messages]

    async def consume():
        box = Outbox()
        pending = deque(messages)
        got: list[Output] = []
        finished, i = 0, 0
        while finished < forks:
            for _ in range(bursts[i % len(bursts)]):  # the engine delivers a few before the handler runs again
                if pending:
                    _put(box, pending.popleft())
            i += 1
            if box.empty():
                _put(box, pending.popleft())
            out = await box.get()
            got.append(out)
            if out.error:  # the handler aborts the call here
                return got
            if out.finish is not None:
                finished += 1
        assert box.empty() and not pending
        return got
    got = asyncio.run(consume())
    for f in range(forks):
        want = [m for m in messages if m.index == f]
        mine = [m for m in got if m.index == f]
        if error and any(m.error for m in got):
            cut = next(k for k, m in enumerate(messages) if m.error)
            want = [m for m in messages[:cut + 1] if m.index == f]
        assert "".join(m.text for m in mine) == "".join(m.text for m in want)
        assert sum((list(m.token_ids) for m in mine), []) == sum((list(m.token_ids) for m in want), [])
        assert sum((list(m.logprobs) for m in mine), []) == sum((list(m.logprobs) for m in want), [])
        assert [m.finish for m in mine if m.finish] == [m.finish for m in want if m.finish]
        assert all(m.finish is None for m in mine[:-1])  # the finish comes last, once
        if mine and mine[-1].finish is Finish.LENGTH:
            assert (mine[-1].prompt_tokens, mine[-1].completion_tokens) == (3, lengths[f])
    assert len(got) <= len(messages)


async def _reader_wakes_for_a_token() -> list[int]:
    box = Outbox()
    reader = asyncio.ensure_future(box.get())
    await asyncio.sleep(0)  # (the reader waits)
    box.token(0, "a", 5, None)
    out = await asyncio.wait_for(reader, 1)
    return list(out.token_ids)


def test_a_waiting_reader_wakes_for_a_token():
    assert asyncio.run(_reader_wakes_for_a_token()) == [5]


def test_a_stream_that_falls_behind_catches_up_in_one_message(monkeypatch):
    """Generate through the real handler: a client that reads the first message and then stalls while the engine
    runs on gets the tokens it missed in one message (all of them, in order), and the counter says so."""
    monkeypatch.setattr(cluster_mod, "ExecutorClient", FakeClient)
    monkeypatch.setattr(engine_mod, "RECONNECT_POLL", 0.05)
    FakeClient.boxes = {"a:1": Box(64)}
    before = metrics.COALESCED_MESSAGES._value.get()

    async def main():
        c = new_cluster()
        c.start()
        c.set_addresses({"a:1"})
        await asyncio.wait_for(c.any_up.wait(), 5)
        import structlog
        limits = Limits(max_model_len=512, vocab_size=300, max_prompt_bytes=1000)
        service = GenerationService(c, NullTokenizer(), limits, {}, structlog.get_logger())
        request = Client.build_request([1, 5, 6, 7], max_tokens=40, ignore_eos=True)
        try:
            stream = service.Generate(request, Context())
            first = await stream.__anext__()
            engine = next(iter(c.engines.values()))
            steps = engine.info().steps
            while engine.info().steps < steps + 10:  # the client stalls while the engine runs ten steps
                await asyncio.sleep(0.001)
            return [first, *[m async for m in stream]]
        finally:
            await c.stop()
    msgs = asyncio.run(main())
    tokens = [t for m in msgs for t in m.token_ids]
    assert tokens == [7] * 40 and msgs[-1].finish_reason == api.FINISH_REASON_LENGTH
    assert "".join(m.text for m in msgs) == "h" * 40  # (NullTokenizer: token 7 is 'h')
    assert len(msgs[1].token_ids) >= 10  # the ten (or more) tokens of the stall, at once
    assert len(msgs) < 40 - 8
    assert metrics.COALESCED_MESSAGES._value.get() - before >= 9


@pytest.mark.parametrize("finish_first", [True, False])
def test_a_final_message_alone_is_sent_as_is(finish_first):
    box = Outbox()
    final = Output("x", [], [], Finish.STOP, "2", index=0)
    if finish_first:
        box.put_nowait(final)
        box.token(0, "a", 1, None)
    else:
        box.token(0, "a", 1, None)
        box.put_nowait(final)
    out = box.get_nowait()
    if finish_first:  # a final is never merged with what follows
        assert out is final and box.qsize() == 1
    else:
        assert out.text == "ax" and list(out.token_ids) == [1] and out.finish is Finish.STOP and out.stop_reason == "2"
        assert box.empty()
