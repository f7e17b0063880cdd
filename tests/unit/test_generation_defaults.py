"""A request that leaves temperature, top_p, top_k, repetition_penalty or min_p unset gets the model's default as
vLLM takes it (and OpenAI defines it): each that the checkpoint's generation_config.json sets (do_sample is not
read), else temperature 1 (sampled), top_p 1, top_k off, repetition_penalty 1, min_p 0. A value the request sets
wins, 0 included. The executor resolves them (Describe), the scheduler applies them (check_sampling)."""

from __future__ import annotations

import asyncio

import pytest

from executor_svc.generation_config import RequestDefaults, sampling_defaults
from pagedkv.bounds import InvalidRequest
from pagedkv.client import Client
from pagedkv.executor.v1 import executor_pb2 as pb
from scheduler_svc import cluster as cluster_mod
from scheduler_svc import engine as engine_mod
from scheduler_svc.api import GenerationService
from scheduler_svc.validation import Limits, SamplingDefaults, check_sampling
from tests.support.fake_cluster import Box, FakeClient, new_cluster
from tests.support.fake_executor import NullTokenizer
from tests.support.fake_grpc import Context

pytestmark = pytest.mark.unit

LLAMA3_INSTRUCT = {"bos_token_id": 128000, "do_sample": True, "eos_token_id": [128001, 128009],
                   "temperature": 0.6, "top_p": 0.9}
QWEN25_INSTRUCT = {"do_sample": True, "repetition_penalty": 1.05, "temperature": 0.7, "top_p": 0.8, "top_k": 20}
VLLM_OWN = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "repetition_penalty": 1.0, "min_p": 0.0}


def vllm_defaults(gen: dict) -> dict:
    """What vLLM's ModelConfig.get_diff_sampling_param gives for ``gen`` (transformers' GenerationConfig.to_diff_dict:
    the values the file sets), over vLLM's own defaults for a request that sets none (its top_k -1 is our 0)."""
    from transformers import GenerationConfig

    diff = GenerationConfig.from_dict(dict(gen)).to_diff_dict()
    return {**VLLM_OWN, **{k: diff[k] for k in VLLM_OWN if diff.get(k) is not None}}


@pytest.mark.parametrize("gen", [{}, {"eos_token_id": 2}, {"do_sample": False, "temperature": 0.6, "top_k": 5},
                                 {"temperature": 0.6, "top_p": 0.9}, LLAMA3_INSTRUCT, QWEN25_INSTRUCT,
                                 {"do_sample": True}, {"do_sample": True, "top_k": None},
                                 {"min_p": 0.05, "repetition_penalty": 1.1}, {"temperature": 0.0}])
def test_defaults_are_what_vllm_takes_from_generation_config(gen):
    got = sampling_defaults(gen)
    assert {k: getattr(got, k) for k in VLLM_OWN} == pytest.approx(vllm_defaults(gen))
    assert sampling_defaults({}) == RequestDefaults(1.0, 1.0, 0, 1.0, 0.0)  # no file: OpenAI's temperature 1
    assert sampling_defaults(LLAMA3_INSTRUCT) == RequestDefaults(0.6, 0.9, 0, 1.0, 0.0)
    assert sampling_defaults(QWEN25_INSTRUCT) == RequestDefaults(0.7, 0.8, 20, 1.05, 0.0)
    # do_sample false is not read (vLLM does not read it): its temperature samples
    assert sampling_defaults({"do_sample": False, "temperature": 0.6}).temperature == 0.6


@pytest.mark.parametrize(("gen", "message"), [
    ({"temperature": "hot"}, "temperature = 'hot' must be a finite number"),
    ({"temperature": -1}, "temperature = -1 must be >= 0 (0: greedy)"),
    ({"top_p": 1.5}, "top_p = 1.5 must be in (0, 1]"),
    ({"top_k": 2.5}, "top_k = 2.5 must be an integer >= 0"),
    ({"top_k": True}, "top_k = True must be a finite number"),
    ({"repetition_penalty": 0}, "repetition_penalty = 0 must be > 0 (1: no penalty)"),
    ({"min_p": 2}, "min_p = 2 must be in [0, 1]"),
    ({"temperature": float("inf")}, "temperature = inf must be a finite number"),
])
def test_bad_defaults_stop_start_up(gen, message):
    with pytest.raises(ValueError, match=r"^model m: generation_config.json: " + message.replace("(", r"\(")
                       .replace(")", r"\)").replace("[", r"\[").replace("]", r"\]")):
        sampling_defaults(gen, "model m: generation_config.json")
    assert sampling_defaults({"top_k": -1}).top_k == 0  # (vLLM's "no top-k filter")


LLAMA3 = SamplingDefaults(temperature=0.6, top_p=0.9, top_k=0)
QWEN25 = SamplingDefaults(temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05, min_p=0.05)


def sampled(defaults: SamplingDefaults, **params) -> tuple[float, float, int, float, float]:
    limits = Limits(max_model_len=64, vocab_size=300, sampling_defaults=defaults)
    s = check_sampling(Client.build_request([5], **params).sampling, 1, limits)
    return s.temperature, s.top_p, s.top_k, s.repetition_penalty, s.min_p


def test_unset_fields_take_the_defaults_and_set_ones_win():
    assert sampled(SamplingDefaults()) == (1.0, 1.0, 0, 1.0, 0.0)  # no generation_config: OpenAI's, sampled
    assert sampled(LLAMA3) == pytest.approx((0.6, 0.9, 0, 1.0, 0.0))
    assert sampled(QWEN25) == pytest.approx((0.7, 0.8, 20, 1.05, 0.05))
    assert sampled(QWEN25, temperature=0) == pytest.approx((0.0, 0.8, 20, 1.05, 0.05))  # an explicit 0: greedy
    assert sampled(QWEN25, temperature=1.2, top_k=0) == pytest.approx((1.2, 0.8, 0, 1.05, 0.05))  # 0: no top-k
    assert sampled(QWEN25, repetition_penalty=1.0, min_p=0.0) == pytest.approx((0.7, 0.8, 20, 1.0, 0.0))  # set: win
    assert sampled(QWEN25, repetition_penalty=1.3, min_p=0.2) == pytest.approx((0.7, 0.8, 20, 1.3, 0.2))
    assert sampled(LLAMA3, top_p=0) == pytest.approx((0.6, 1.0, 0, 1.0, 0.0))  # top_p 0 means 1, as before
    with pytest.raises(InvalidRequest, match=r"sampling.temperature: -1.0; must be a finite number >= 0"):
        sampled(LLAMA3, temperature=-1)
    with pytest.raises(InvalidRequest, match=r"sampling.top_k: -1; must be >= 0"):
        sampled(LLAMA3, top_k=-1)


def test_describe_defaults_reach_the_executors_plan(monkeypatch):
    """From Describe's default_* fields to the SamplingParams the executor is sent, through Generate."""
    monkeypatch.setattr(cluster_mod, "ExecutorClient", FakeClient)
    monkeypatch.setattr(engine_mod, "RECONNECT_POLL", 0.05)
    FakeClient.boxes = {"a:1": Box(64)}
    plans: list[pb.StepPlan] = []
    step = FakeClient.step

    async def recording_step(self, plan):
        plans.append(plan)
        return await step(self, plan)
    monkeypatch.setattr(FakeClient, "step", recording_step)
    describe = pb.DescribeResponse(default_temperature=0.7, default_top_p=0.8, default_top_k=20,
                                   default_repetition_penalty=1.05, default_min_p=0.05)
    assert SamplingDefaults.of(describe) == SamplingDefaults(pytest.approx(0.7), pytest.approx(0.8), 20,
                                                             pytest.approx(1.05), pytest.approx(0.05))

    async def main():
        import structlog
        c = new_cluster()
        c.start()
        c.set_addresses({"a:1"})
        await asyncio.wait_for(c.any_up.wait(), 5)
        limits = Limits(max_model_len=512, vocab_size=300, sampling_defaults=SamplingDefaults.of(describe))
        service = GenerationService(c, NullTokenizer(), limits, {}, structlog.get_logger())
        try:
            for params in ({}, {"temperature": 0.0, "repetition_penalty": 1.0}):
                req = Client.build_request([5, 6, 7], max_tokens=2, request_id=str(params), **params)
                assert [m async for m in service.Generate(req, Context())][-1].finish_reason
        finally:
            await c.stop()
    asyncio.run(main())
    sent = [(r.sampling.temperature, r.sampling.top_p, r.sampling.top_k, r.sampling.repetition_penalty,
             r.sampling.min_p) for p in plans for r in p.new_requests]
    assert sent == [pytest.approx((0.7, 0.8, 20, 1.05, 0.05)), pytest.approx((0.0, 0.8, 20, 1.0, 0.05))]

