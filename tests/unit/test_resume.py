"""Resuming a stream whose scheduler went away (GenerateRequest.continuation), in one process: the scheduler side
(validation of a continuation, the forks it resumes, what their plans tell the executor, the stream that follows)
against a fake cluster. The client side: test_resume_client.py. The real thing, scheduler kills and all, is
test_resume_e2e.py."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import structlog

from pagedkv.api.v1 import api_pb2 as api
from pagedkv.bounds import max_message_bytes, max_request_bytes
from pagedkv.client import Client
from scheduler_svc import metrics
from scheduler_svc.api import GenerationService
from scheduler_svc.validation import Limits
from tests.support.fake_cluster import Box, up_cluster
from tests.support.fake_executor import NullTokenizer
from tests.support.fake_grpc import Aborted, Context

pytestmark = pytest.mark.unit

PROMPT = [1, 5, 6, 7, 8]
EOS = 2


def resumed(prompt=PROMPT, forks=((),), finished=(), draw_offsets=None, **params) -> api.GenerateRequest:
    """A GenerateRequest with a continuation: ``forks`` the token ids each fork received."""
    params.setdefault("max_tokens", 12)
    params.setdefault("seed", 41)
    req = Client.build_request(list(prompt), **params)
    for i, ids in enumerate(forks):
        offset = len(ids) if draw_offsets is None else draw_offsets[i]
        req.continuation.forks.add(token_ids=list(ids), draw_offset=offset, finished=i in finished)
    return req


# ---- the scheduler side --------------------------------------------------------------------------------------------
async def _service(boxes, max_model_len: int = 64):
    boxes["a:1"] = Box(64)
    c = await up_cluster({"a:1"})
    c.reference.eos_token_ids.append(EOS)  # (the first executor's Describe, as the server keeps it)
    return c, GenerationService(c, NullTokenizer(), Limits(max_model_len=max_model_len, vocab_size=300), {},
                                structlog.get_logger())


def _plans(box: Box) -> list:
    """Every plan the box's executor runs from now on."""
    plans, step = [], box.executor.step

    def recording(plan):
        plans.append(plan)
        return step(plan)
    box.executor.step = recording
    return plans


REFUSALS = [
    (dict(forks=([3], [4])), "continuation.forks: 2 entries; must be one per fork: 1 (sampling.n)"),
    (dict(forks=([3, 4],), draw_offsets=[1]), "continuation.forks[0].draw_offset: 1; must equal the number of "
     "token_ids received (2)"),
    (dict(forks=([3, 300],)), "continuation.forks[0].token_ids: id 300 outside the vocabulary [0, 300)"),
    (dict(forks=([3, -1],)), "continuation.forks[0].token_ids: id -1 outside the vocabulary"),
    (dict(forks=([3] * 12,)), "continuation.forks[0].token_ids: 12 tokens; an unfinished fork has fewer than "
     "sampling.max_tokens=12"),
    (dict(forks=([3] * 59,), max_tokens=0), "continuation.forks[0].token_ids: 59 tokens; an unfinished fork has "
     "fewer than sampling.max_tokens=59"),  # (0: up to max_model_len=64)
    (dict(forks=([3, EOS, 4],)), f"continuation.forks[0].token_ids: id {EOS} at position 1 is a stop token"),
    (dict(forks=([3, 9, 4],), stop_token_ids=[9]), "continuation.forks[0].token_ids: id 9 at position 1 is a stop"),
    (dict(forks=([3, 7, 7],), stop=["hh"]), "continuation.forks[0].token_ids: their text holds the stop string 'hh'"),
    (dict(forks=([3], [4]), n=2, finished=(0, 1)), "continuation.forks: every fork finished; nothing is left"),
    (dict(forks=([3], [4]), n=2), None),  # (the same, unfinished: fine)
    (dict(forks=([3, EOS],), ignore_eos=True), None),
]


@pytest.mark.parametrize("params, refusal", REFUSALS)
def test_a_continuation_is_checked_like_any_input(boxes, params, refusal):
    """Every refusal is INVALID_ARGUMENT naming the field and the limit; nothing is admitted, no page held."""
    async def scenario():
        c, service = await _service(boxes)
        try:
            stream = service.Generate(resumed(**params), Context())
            try:
                msgs = [m async for m in stream]
            except Aborted as err:
                return err, service.live, c.engines["a:1"].scheduler.kv.pool.num_used
            return msgs, service.live, 0
        finally:
            await c.stop()
    got, live, used = asyncio.run(scenario())
    if refusal is None:
        assert sum(1 for m in got if m.finish_reason) == len(params["forks"]) - len(params.get("finished", ()))
        return
    assert isinstance(got, Aborted) and got.code == grpc.StatusCode.INVALID_ARGUMENT, got
    assert got.details.startswith(refusal), got.details
    assert not live and used == 0


def test_a_resumed_request_draws_on_where_the_stream_broke(boxes):
    """The executor gets prompt + received tokens to compute, the draw to continue from (num_output_tokens) and the
    seed the client resent; the stream carries the seed first, then only what comes after the cut; the usage is the
    whole request's (the original prompt; every token generated)."""
    async def scenario():
        c, service = await _service(boxes)
        plans = _plans(boxes["a:1"])
        before = metrics.RESUMED_REQUESTS._value.get()
        try:
            msgs = [m async for m in service.Generate(resumed(forks=([3, 4, 5],), temperature=0.8), Context())]
        finally:
            await c.stop()
        return msgs, plans, metrics.RESUMED_REQUESTS._value.get() - before
    msgs, plans, counted = asyncio.run(scenario())
    new = [r for p in plans for r in p.new_requests]
    assert len(new) == 1 and list(new[0].token_ids) == PROMPT + [3, 4, 5]
    assert new[0].num_output_tokens == 3 and new[0].sampling.seed == 41
    assert new[0].sampling.temperature == pytest.approx(0.8)
    assert msgs[0].HasField("seed") and msgs[0].seed == 41 and not any(m.HasField("seed") for m in msgs[1:])
    assert sum(len(m.token_ids) for m in msgs) == 12 - 3
    assert msgs[-1].finish_reason == api.FINISH_REASON_LENGTH
    assert (msgs[-1].usage.prompt_tokens, msgs[-1].usage.completion_tokens) == (len(PROMPT), 12)
    assert counted == 1


def test_forks_resume_each_from_its_own_draw_and_finished_ones_stay_finished(boxes):
    """n = 3, fork 1 finished before the break: forks 0 and 2 are continued, each with seed + its index from its own
    draw; only their last messages follow."""
    async def scenario():
        c, service = await _service(boxes)
        plans = _plans(boxes["a:1"])
        try:
            request = resumed(forks=([3], [4, 4], [5, 5, 5, 5]), finished=(1,), n=3, temperature=1.0)
            msgs = [m async for m in service.Generate(request, Context())]
        finally:
            await c.stop()
        return msgs, plans
    msgs, plans = asyncio.run(scenario())
    new = {r.request_id.rsplit("/", 1)[1]: r for p in plans for r in p.new_requests}
    assert sorted(new) == ["0", "2"]
    assert (new["0"].num_output_tokens, new["0"].sampling.seed, list(new["0"].token_ids)) == (1, 41, PROMPT + [3])
    assert (new["2"].num_output_tokens, new["2"].sampling.seed) == (4, 43)
    finals = {m.index: m for m in msgs if m.finish_reason}
    assert sorted(finals) == [0, 2]
    assert [finals[i].usage.completion_tokens for i in (0, 2)] == [12, 12]
    assert sum(len(m.token_ids) for m in msgs if m.index == 0) == 11
    assert sum(len(m.token_ids) for m in msgs if m.index == 2) == 8


def test_an_unseeded_request_is_told_its_seed(boxes):
    """The first message carries the seed the server chose (a request that asked for one gets it back)."""
    async def scenario():
        c, service = await _service(boxes)
        try:
            unseeded = Client.build_request(PROMPT, max_tokens=3, temperature=1.0)
            first = [m async for m in service.Generate(unseeded, Context())]
            again = [m async for m in service.Generate(Client.build_request(PROMPT, max_tokens=3, seed=7), Context())]
        finally:
            await c.stop()
        return first, again
    first, again = asyncio.run(scenario())
    assert first[0].HasField("seed") and 0 <= first[0].seed < 2**63
    assert again[0].seed == 7 and not any(m.HasField("seed") for m in first[1:] + again[1:])


def test_the_request_limit_has_room_for_a_continuation():
    """gRPC refuses a message over max_request_bytes before it is read: a continuation of a full context for each
    of 16 forks (5 bytes an id at most) fits, with the longest prompt."""
    req = Client.build_request("a" * 65536, max_tokens=1, n=16)
    for _ in range(16):
        req.continuation.forks.add(token_ids=[2**31 - 1] * 2047, draw_offset=2047)
    assert len(req.SerializeToString()) <= max_request_bytes(65536, 2048)
    assert max_request_bytes(65536, 2048) - max_message_bytes(65536, 2048) == 16 * 2048 * 5
