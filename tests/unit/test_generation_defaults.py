"""generation_config.json's sampling values are the defaults of a request that leaves temperature, top_p or
top_k unset, as transformers' generate() applies them (do_sample false or absent: greedy); a value the request
sets wins, 0 included. The executor resolves them (Describe), the scheduler applies them (check_sampling)."""

from __future__ import annotations

import asyncio

import pytest

from executor_svc.generation_config import sampling_defaults
from pagedkv.client import Client
from pagedkv.executor.v1 import executor_pb2 as pb
from scheduler_svc import cluster as cluster_mod
from scheduler_svc import engine as engine_mod
from scheduler_svc.api import GenerationService
from scheduler_svc.validation import InvalidRequest, Limits, SamplingDefaults, check_sampling
from tests.support.fake_cluster import Box, FakeClient, new_cluster
from tests.support.fake_executor import NullTokenizer
from tests.support.fake_grpc import Context

pytestmark = pytest.mark.unit

LLAMA3_INSTRUCT = {"bos_token_id": 128000, "do_sample": True, "eos_token_id": [128001, 128009],
                   "temperature": 0.6, "top_p": 0.9}
QWEN25_INSTRUCT = {"do_sample": True, "repetition_penalty": 1.05, "temperature": 0.7, "top_p": 0.8, "top_k": 20}


@pytest.mark.parametrize("gen", [{}, {"eos_token_id": 2}, {"do_sample": False, "temperature": 0.6, "top_k": 5},
                                 {"temperature": 0.6, "top_p": 0.9}, LLAMA3_INSTRUCT, QWEN25_INSTRUCT,
                                 {"do_sample": True}, {"do_sample": True, "top_k": None}])
def test_defaults_are_what_transformers_generate_uses(gen):
    """Greedy unless do_sample; then transformers' GenerationConfig values (its own defaults for those absent)."""
    from transformers import GenerationConfig

    hf = GenerationConfig(**gen)
    # generate() fills what the file leaves None with these (transformers 5; older versions set them at init)
    fill = getattr(GenerationConfig, "_get_default_generation_params", dict)()

    def used(name: str):
        value = getattr(hf, name)
        return fill[name] if value is None else value

    temperature, top_p, top_k = sampling_defaults(gen)
    if not used("do_sample"):
        assert (temperature, top_p, top_k) == (0.0, 1.0, 0)
    else:
        assert (temperature, top_p, top_k) == (pytest.approx(used("temperature")), pytest.approx(used("top_p")),
                                               used("top_k"))
    assert sampling_defaults(LLAMA3_INSTRUCT) == (0.6, 0.9, 50)
    assert sampling_defaults(QWEN25_INSTRUCT) == (0.7, 0.8, 20)


@pytest.mark.parametrize(("gen", "message"), [
    ({"do_sample": True, "temperature": "hot"}, "temperature = 'hot' must be a number"),
    ({"do_sample": True, "temperature": -1}, "temperature = -1.0 must be a finite number >= 0"),
    ({"do_sample": True, "top_p": 1.5}, "top_p = 1.5 must be in (0, 1]"),
    ({"do_sample": True, "top_k": 2.5}, "top_k = 2.5 must be an integer >= 0"),
    ({"do_sample": True, "top_k": True}, "top_k = True must be a number"),
])
def test_bad_defaults_stop_start_up(gen, message):
    with pytest.raises(ValueError, match=r"^model m: generation_config.json: " + message.replace("(", r"\(")
                       .replace(")", r"\)").replace("[", r"\[").replace("]", r"\]")):
        sampling_defaults(gen, "model m: generation_config.json")


LLAMA3 = SamplingDefaults(temperature=0.6, top_p=0.9, top_k=50)


def sampled(defaults: SamplingDefaults, **params) -> tuple[float, float, int]:
    limits = Limits(max_model_len=64, vocab_size=300, sampling_defaults=defaults)
    s = check_sampling(Client.build_request([5], **params).sampling, 1, limits)
    return s.temperature, s.top_p, s.top_k


def test_unset_fields_take_the_defaults_and_set_ones_win():
    assert sampled(LLAMA3) == pytest.approx((0.6, 0.9, 50))
    assert sampled(LLAMA3, temperature=0) == pytest.approx((0.0, 0.9, 50))  # an explicit 0: greedy
    assert sampled(LLAMA3, temperature=1.2, top_k=0) == pytest.approx((1.2, 0.9, 0))  # 0: no top-k filter
    assert sampled(LLAMA3, top_p=0) == pytest.approx((0.6, 1.0, 50))  # top_p 0 means 1, as before
    assert sampled(SamplingDefaults()) == (0.0, 1.0, 0)  # no generation_config: greedy, as before
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
    describe = pb.DescribeResponse(default_temperature=0.7, default_top_p=0.8, default_top_k=20)
    assert SamplingDefaults.of(describe) == SamplingDefaults(pytest.approx(0.7), pytest.approx(0.8), 20)
    assert SamplingDefaults.of(pb.DescribeResponse()) == SamplingDefaults()  # an older executor: greedy

    async def main():
        import structlog
        c = new_cluster()
        c.start()
        c.set_addresses({"a:1"})
        await asyncio.wait_for(c.any_up.wait(), 5)
        limits = Limits(max_model_len=512, vocab_size=300, sampling_defaults=SamplingDefaults.of(describe))
        service = GenerationService(c, NullTokenizer(), limits, {}, structlog.get_logger())
        try:
            for params in ({}, {"temperature": 0.0}):
                req = Client.build_request([5, 6, 7], max_tokens=2, request_id=str(params), **params)
                assert [m async for m in service.Generate(req, Context())][-1].finish_reason
        finally:
            await c.stop()
    asyncio.run(main())
    sent = [(r.sampling.temperature, r.sampling.top_p, r.sampling.top_k)
            for p in plans for r in p.new_requests]
    assert sent == [pytest.approx((0.7, 0.8, 20)), pytest.approx((0.0, 0.8, 20))]

