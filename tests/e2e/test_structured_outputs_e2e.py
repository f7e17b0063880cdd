"""Structured outputs through real processes on loopback.

With tiny-llama (random weights: its outputs follow a schema only if the constraint is really applied), every
json_schema response parses and validates against its schema (``jsonschema``): nested objects, enums, arrays with
minItems/maxItems, string patterns and lengths, integer ranges; regexes and choices match. Under preemption (few
pages, many streams: recompute and swap resend each request in full and its matcher is rebuilt from its tokens), with
n > 1, with async scheduling (the default: the matcher advances one step ahead) and without, with fp8 KV, and across
an executor's kill -9 mid-stream (its requests migrate and rebuild their matchers elsewhere). With the built-in real
model (smollm2-135m-instruct, a 49k vocabulary): guided_choice and a JSON extraction through the gateway, and the
``openai`` SDK's ``chat.completions.parse`` with a Pydantic model.
"""

from __future__ import annotations

import asyncio
import json
import re

import grpc
import jsonschema
import openai
import pydantic
import pytest

from pagedkv.api.v1 import api_pb2 as api
from pagedkv.client import Client, Completion, accumulate
from pagedkv.local_server import LocalServer
from tests.support import procs

pytestmark = pytest.mark.e2e

STRING = {"type": "string", "maxLength": 6}
SCHEMAS = [
    {"type": "object", "properties": {"name": STRING, "age": {"type": "integer", "minimum": 0, "maximum": 130},
                                      "pet": {"enum": ["cat", "dog", "none"]}},
     "required": ["name", "age", "pet"], "additionalProperties": False},
    {"type": "object", "properties": {
        "owner": {"type": "object", "properties": {"id": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"},
                                                   "ok": {"type": "boolean"}},
                  "required": ["id", "ok"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 2, "maxItems": 3}},
     "required": ["owner", "tags"], "additionalProperties": False},
    {"type": "array", "items": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9},
                                                                 "y": {"type": "null"}},
                                "required": ["x"], "additionalProperties": False},
     "minItems": 1, "maxItems": 3},
]
REGEX = r"[a-z]{3}-[0-9]{2,4}@(home|work)"
CHOICES = ["red", "green", "blue", "déjà vu"]


def _workload(n_each: int = 4) -> list[tuple[str, dict, object]]:
    """(prompt, generate params, checker of one output text) for schemas, a regex and a choice, sampled and seeded."""
    out = []
    for i in range(n_each):
        for j, schema in enumerate(SCHEMAS):
            out.append((f"request {i} {j}: " + "x" * (7 * i + j),
                        dict(max_tokens=160, temperature=1.0, seed=100 * i + j,
                             constraint=api.Constraint(json_schema=json.dumps(schema), strict=True)),
                        lambda text, schema=schema: jsonschema.validate(json.loads(text), schema)))
        out.append((f"regex {i}", dict(max_tokens=60, temperature=1.0, seed=i, constraint=api.Constraint(regex=REGEX)),
                    lambda text: _check(re.fullmatch(REGEX, text), text)))
        out.append((f"choice {i}", dict(max_tokens=20, temperature=1.0, seed=i,
                                        constraint=api.Constraint(choice=api.Choices(choices=CHOICES))),
                    lambda text: _check(text in CHOICES, text)))
    return out


def _check(ok, text: str) -> None:
    assert ok, text


async def _run(address: str, reqs, n: int = 1, during=None) -> list[list[Completion]]:
    streamed = {"tokens": 0}

    async def one(client: Client, prompt, params) -> list[Completion]:
        outs = [Completion() for _ in range(n)]
        async for msg in client.generate(prompt, n=n, **params):
            accumulate(outs[msg.index], msg)
            streamed["tokens"] += len(msg.token_ids)
        return outs

    async with Client(address) as client:
        tasks = [asyncio.create_task(one(client, p, kw)) for p, kw, _ in reqs]
        if during is not None:
            await during(streamed)
        return await asyncio.gather(*tasks)


def _assert_all_follow(reqs, results: list[list[Completion]]) -> None:
    for (prompt, _, check), outs in zip(reqs, results):
        for out in outs:
            assert out.finish_reason == "stop", (prompt, out.text, out.finish_reason)
            check(out.text)


async def _info(address: str) -> api.ModelInfoResponse:
    async with Client(address) as client:
        return await client.model_info()


@pytest.fixture(scope="module")
def small_server(model_cache):
    """Few pages for many streams: preemption (recompute and swap) happens."""
    server = LocalServer("--model", "tiny-llama", "--num-pages", "32", "--block-size", "8", "--threads", "1")
    yield server
    server.stop()


def test_every_output_follows_its_constraint_under_preemption(small_server):
    reqs = _workload()
    before = asyncio.run(_info(small_server.address)).num_preemptions
    results = asyncio.run(_run(small_server.address, reqs))
    _assert_all_follow(reqs, results)
    assert asyncio.run(_info(small_server.address)).num_preemptions > before  # (matchers were rebuilt)


def test_parallel_samples_each_follow_the_constraint(small_server):
    reqs = _workload(2)
    results = asyncio.run(_run(small_server.address, reqs, n=3))
    _assert_all_follow(reqs, results)
    texts = [o.text for outs in results for o in outs]
    assert len(set(texts)) > len(reqs)  # (the forks sample with seed + i: not one output copied)


def test_bad_constraints_are_invalid_argument_naming_the_field(small_server):
    async def refused(constraint: api.Constraint, **params) -> str:
        async with Client(small_server.address) as client:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await client.complete("x", max_tokens=5, constraint=constraint, **params)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        return e.value.details()

    assert "sampling.constraint.regex: not usable" in asyncio.run(refused(api.Constraint(regex="(a|")))
    assert "sampling.constraint.json_schema: not usable" in asyncio.run(refused(api.Constraint(
        json_schema='{"type": "nonsense"}')))
    assert "sampling.constraint.grammar: not usable" in asyncio.run(refused(api.Constraint(grammar="root ::= y")))
    assert "at most 65536" in asyncio.run(refused(api.Constraint(regex="a" * 70000)))
    assert "sampling.ignore_eos" in asyncio.run(refused(api.Constraint(json_object=True), ignore_eos=True))
    info = asyncio.run(_info(small_server.address))
    assert info.num_used_pages == 0  # (refused before placement: no page taken)


def test_fp8_kv_without_async_scheduling(model_cache):
    server = LocalServer("--model", "tiny-llama", "--num-pages", "32", "--block-size", "8", "--threads", "1",
                         "--kv-cache-dtype", "fp8_e4m3", "--no-async-scheduling")
    try:
        reqs = _workload(2)
        _assert_all_follow(reqs, asyncio.run(_run(server.address, reqs)))
    finally:
        server.stop()


def test_kill9_mid_stream_migrates_and_every_output_still_follows(tmp_path, model_cache):
    execs = [procs.executor("--num-pages", "96"), procs.executor("--num-pages", "96")]
    sched = procs.scheduler(*(e.address for e in execs), args=("--drain-timeout", "0.001", "--unplaced-timeout", "60"))
    try:
        reqs = [r for r in _workload(4) if "regex" not in r[0] and "choice" not in r[0]]

        async def kill_midway(streamed):
            while streamed["tokens"] < len(reqs) * 6:
                await asyncio.sleep(0.01)
            execs[1].kill()

        results = asyncio.run(_run(sched.address, reqs, during=kill_midway))
        _assert_all_follow(reqs, results)
        assert sched.saw("requests_migrating", cause="failure")
    finally:
        for p in (sched, *execs):
            p.kill()


# ---- the built-in real model, through the gateway ----------------------------------------------------------------
class Person(pydantic.BaseModel):
    name: str
    age: int


@pytest.fixture(scope="module")
def real_gateway(model_cache):
    server = LocalServer("--model", "smollm2-135m-instruct", "--num-pages", "64")
    gateway = procs.Proc("gateway", "--address", server.address, "--served-model-name", "smollm2")
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{gateway.port}/v1", api_key="k", max_retries=0, timeout=120)
    yield client
    gateway.stop()
    server.stop()


def test_real_model_guided_choice_and_json_extraction(real_gateway):
    answer = real_gateway.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Is the sky blue on a clear day? Answer yes or no."}],
        max_tokens=5, temperature=0, extra_body={"guided_choice": ["yes", "no"]})
    assert answer.choices[0].message.content in ("yes", "no") and answer.choices[0].finish_reason == "stop"
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                               "population_millions": {"type": "number"}},
              "required": ["city", "population_millions"], "additionalProperties": False}
    extracted = real_gateway.completions.create(
        model="smollm2", prompt="Paris has about 2.1 million inhabitants. As JSON: ", max_tokens=60, temperature=0,
        extra_body={"response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": schema,
                                                                                "strict": True}}})
    value = json.loads(extracted.choices[0].text)
    jsonschema.validate(value, schema)
    assert extracted.choices[0].finish_reason == "stop"


def test_openai_sdk_parse_with_a_pydantic_model(real_gateway):
    parse = getattr(real_gateway.chat.completions, "parse", None) or real_gateway.beta.chat.completions.parse
    completion = parse(model="smollm2", messages=[
        {"role": "system", "content": "Extract the person."},
        {"role": "user", "content": "Alice is 31 years old."}], response_format=Person, max_tokens=60, temperature=0)
    person = completion.choices[0].message.parsed
    assert isinstance(person, Person) and completion.choices[0].finish_reason == "stop"


def test_real_model_required_tool_call_parses(real_gateway):
    weather = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                                "unit": {"enum": ["celsius", "fahrenheit"]}},
               "required": ["city", "unit"], "additionalProperties": False}
    answer = real_gateway.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "What is the weather in Paris, in celsius?"}],
        tools=[{"type": "function", "function": {"name": "get_weather", "parameters": weather}}],
        tool_choice="required", max_tokens=80, temperature=0)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    for call in choice.message.tool_calls:
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), weather)
