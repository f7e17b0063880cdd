"""A Generate request's way in (scheduler_svc/intake.py), through the real Generate handler, Cluster and Engine against
a FakeExecutor in one process: the walk from Generate to the planner enters each intake stage's module once, in the
pipeline's order (bounds, adapter, prompts, fit, sampling, constraint, continuation), and a request refused by its
bounds costs no tokenizing."""

from __future__ import annotations

import asyncio
import sys
import threading
from pathlib import Path

import grpc
import pytest
import structlog

from pagedkv.api.v1 import api_pb2 as api
from pagedkv.client import Client
from scheduler_svc.api import GenerationService
from scheduler_svc.validation import Limits
from tests.support.fake_cluster import Box, up_cluster
from tests.support.fake_executor import NullTokenizer
from tests.support.fake_grpc import Aborted, Context

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
SPINE = {"scheduler_svc/api.py", "scheduler_svc/intake.py"}  # the handler and the pipeline
# every module a stage lives in, in the pipeline's order (chat.py: inside the prompts stage, never on the spine)
STAGES = ["pagedkv/bounds.py", "scheduler_svc/adapters.py", "scheduler_svc/prompts.py", "scheduler_svc/fit.py",
          "scheduler_svc/validation.py", "scheduler_svc/constraints.py", "scheduler_svc/continuation.py"]
INSIDE = ["scheduler_svc/chat.py"]


def _rel(filename: str) -> str:
    try:
        return Path(filename).resolve().relative_to(ROOT).as_posix()
    except ValueError:
        return filename


class Walk:
    """Each call from the spine into another module, once per frame (a coroutine's resumptions are not entries)."""

    def __init__(self) -> None:
        self.entries: list[str] = []
        self._frames: list = []  # (kept alive, so that no frame's id is reused while the walk is recorded)
        self._seen: set[int] = set()

    def __call__(self, frame, event, arg) -> None:
        if event != "call" or id(frame) in self._seen or frame.f_back is None:
            return
        self._seen.add(id(frame))
        self._frames.append(frame)
        callee, caller = _rel(frame.f_code.co_filename), _rel(frame.f_back.f_code.co_filename)
        if caller in SPINE and callee != caller and callee in STAGES + INSIDE:
            self.entries.append(callee)


def _service(boxes, tokenizer=None):
    async def make():
        boxes["a:1"] = Box(64)
        c = await up_cluster({"a:1"})
        return c, GenerationService(c, tokenizer or NullTokenizer(), Limits(max_model_len=64, vocab_size=300), {},
                                    structlog.get_logger())
    return make


def test_one_request_enters_each_stage_once_in_order(boxes):
    """A resumed request with echo and prompt logprobs (every stage has work): the spine enters each stage module
    exactly once, in order; chat.py only from inside the prompts stage."""
    request = Client.build_request([1, 5, 6, 7, 8], max_tokens=8, seed=3, echo=True, prompt_logprobs=1)
    request.continuation.forks.add(token_ids=[3, 4], draw_offset=2)

    async def scenario():
        c, service = await _service(boxes)()
        walk = Walk()
        sys.setprofile(walk)
        threading.setprofile(walk)
        try:
            msgs = [m async for m in service.Generate(request, Context())]
        finally:
            sys.setprofile(None)
            threading.setprofile(None)
            await c.stop()
        return msgs, walk.entries
    msgs, entries = asyncio.run(scenario())
    assert msgs[-1].finish_reason == api.FINISH_REASON_LENGTH  # (it ran to the end)
    assert entries == STAGES, entries


class CountingTokenizer(NullTokenizer):
    calls = 0

    def __call__(self, text, **_):
        CountingTokenizer.calls += 1
        return {"input_ids": [5] * len(text)}


@pytest.mark.parametrize("field, bad", [
    ("request_id", dict(request_id="r" * 257)),
    ("priority", dict(priority=1001)),
    ("sampling.n", dict(n=17)),
    ("sampling.bad_words", dict(bad_words=["w"] * 101)),
    ("adapter", dict(adapter="a" * 257)),
])
def test_a_request_refused_by_its_bounds_costs_no_tokenizing(boxes, field, bad):
    params = dict(bad)
    own = ("request_id", "adapter")  # (fields of the request itself, not of build_request)
    request = Client.build_request([1], max_tokens=4, **{k: v for k, v in params.items() if k not in own})
    request.text = "some text to tokenize"  # (the prompt: text, not the ids)
    request.request_id = params.get("request_id", "")
    request.adapter = params.get("adapter", "")

    async def scenario():
        c, service = await _service(boxes, CountingTokenizer())()
        try:
            return [m async for m in service.Generate(request, Context())]
        except Aborted as err:
            return err
        finally:
            await c.stop()
    CountingTokenizer.calls = 0
    got = asyncio.run(scenario())
    assert isinstance(got, Aborted) and got.code == grpc.StatusCode.INVALID_ARGUMENT, got
    assert got.details.startswith(f"{field}: "), got.details
    assert CountingTokenizer.calls == 0
