"""The Responses API through real processes on loopback: ``pagedkv serve --http-port`` serving the built-in real
model (SmolLM2, whose template marks tool calls as Hermes does) with a tenants file and the default flags, driven by
the ``openai`` SDK (create, stream, retrieve, delete, previous_response_id, text.format, a function tool round trip)
and by openai-agents' default loop (``Agent`` + ``Runner.run`` and ``run_streamed`` on its default
OpenAIResponsesModel, with and without a function tool). A follow-up by previous_response_id gets the previous turn's
prompt pages from the cache; another tenant's response is 404; a ``pagedkv gateway`` restarted on the same
--responses-dir still has what it stored (and one with --responses-dir memory does not)."""

from __future__ import annotations

import asyncio
import json

import httpx
import jsonschema
import openai
import pytest

from pagedkv.cli import free_port
from pagedkv.local_server import LocalServer
from pagedkv.tenancy import hash_key
from tests.support import procs

pytestmark = pytest.mark.e2e

MODEL, BLOCK = "smollm2-135m-instruct", 16
ALICE, BOB = "key-responses-alice", "key-responses-bob"
TENANTS = f"""
[tenants.alice]
keys = ["{hash_key(ALICE)}"]

[tenants.bob]
keys = ["{hash_key(BOB)}"]
"""
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city now.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                          "required": ["city"], "additionalProperties": False}, "strict": True}
GREEDY = {"temperature": 0.0, "max_output_tokens": 24}


class Http(LocalServer):
    def __init__(self, *args: str) -> None:
        self.http_port = free_port()
        super().__init__(*args, "--http-port", str(self.http_port))
        self.base = f"http://127.0.0.1:{self.http_port}/v1"


@pytest.fixture(scope="module")
def server(smollm2_dir, tmp_path_factory):
    tenants = tmp_path_factory.mktemp("responses") / "tenants.toml"
    tenants.write_text(TENANTS)
    # (no host tier: pages other traffic takes are gone, not spilled, so what outlives it was retained)
    s = Http("--model", MODEL, "--max-model-len", "1024", "--num-pages", "128", "--swap-space", "0",
             "--block-size", str(BLOCK),
             "--tenants-file", str(tenants))  # (the defaults: --tool-call-parser auto finds SmolLM2's hermes)
    yield s
    s.stop()


def client(server, key: str = ALICE, base: str = "") -> openai.OpenAI:
    return openai.OpenAI(base_url=base or server.base, api_key=key, max_retries=0)


def test_create_retrieve_delete_per_tenant(server):
    alice, bob = client(server), client(server, BOB)
    r = alice.responses.create(model=MODEL, input="What is the capital of France?",
                               instructions="Answer in one word.", metadata={"case": "crud"}, **GREEDY)
    assert r.object == "response" and r.status in ("completed", "incomplete") and r.output_text.strip()
    assert r.usage.input_tokens > 0 and r.usage.output_tokens > 0 and r.store and r.metadata == {"case": "crud"}
    got = alice.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text
    with pytest.raises(openai.NotFoundError):
        bob.responses.retrieve(r.id)  # (another tenant's id)
    with pytest.raises(openai.NotFoundError):
        bob.responses.delete(r.id)
    alice.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        alice.responses.retrieve(r.id)
    with pytest.raises(openai.AuthenticationError):
        client(server, "key-nobody").responses.create(model=MODEL, input="hi", **GREEDY)
    with pytest.raises(openai.BadRequestError) as e:
        alice.responses.create(model=MODEL, input="hi", background=True)
    assert e.value.body["param"] == "background"
    unstored = alice.responses.create(model=MODEL, input="Say hi.", store=False, **GREEDY)
    with pytest.raises(openai.NotFoundError):
        alice.responses.retrieve(unstored.id)


def test_stream_sends_typed_events_that_add_up_to_the_answer(server):
    alice = client(server)
    whole = alice.responses.create(model=MODEL, input="Name three colours.", **GREEDY)
    events = list(alice.responses.create(model=MODEL, input="Name three colours.", stream=True, **GREEDY))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert text == final.output_text == whole.output_text and final.usage.output_tokens == whole.usage.output_tokens
    assert alice.responses.retrieve(final.id).output_text == text  # (stored as streamed)


def test_previous_response_id_continues_and_reuses_the_previous_turns_pages(server):
    alice = client(server)
    first = alice.responses.create(model=MODEL, instructions="You are a terse geography tutor. Nonce 41.",
                                   input="What is the capital of France? Then name its river.", **GREEDY)
    follow = alice.responses.create(model=MODEL, instructions="You are a terse geography tutor. Nonce 41.",
                                    previous_response_id=first.id, input="And the capital of Italy?", **GREEDY)
    assert follow.previous_response_id == first.id and follow.output_text.strip()
    # its prompt is the first turn's prompt, the first answer and the new question: the first prompt's full pages
    # come from the cache (retained or not), not recomputed
    assert follow.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    full_pages = first.usage.input_tokens // BLOCK * BLOCK
    assert follow.usage.input_tokens_details.cached_tokens >= full_pages > 0, (first.usage, follow.usage)
    with pytest.raises(openai.NotFoundError) as e:
        client(server, BOB).responses.create(model=MODEL, previous_response_id=first.id, input="x", **GREEDY)
    assert e.value.body["param"] == "previous_response_id"


def _pressure(server, prompts: int = 10, tokens: int = 480) -> None:
    """Unrelated prompts, more tokens than the pool (128 pages of 16) holds: every free cached page is reused."""
    import random

    rng = random.Random(5)
    with httpx.Client(timeout=300, headers={"authorization": f"Bearer {ALICE}"}) as http:
        for _ in range(prompts):
            prompt = [rng.randrange(100, 49000) for _ in range(tokens)]
            http.post(f"{server.base}/completions", json={"model": MODEL, "prompt": prompt,
                                                          "max_tokens": 1}).raise_for_status()


def test_a_stored_turns_kv_outlives_other_traffic_and_an_unstored_ones_does_not(server):
    alice = client(server)
    asked = "Name one long river and the sea it flows into."
    kept = alice.responses.create(model=MODEL, instructions="Nonce 77.", input=asked, **GREEDY)
    lost = alice.responses.create(model=MODEL, instructions="Nonce 78.", input=asked, store=False, **GREEDY)
    _pressure(server)
    follow = alice.responses.create(model=MODEL, instructions="Nonce 77.", previous_response_id=kept.id,
                                    input="And another?", **GREEDY)
    assert follow.usage.input_tokens_details.cached_tokens >= kept.usage.input_tokens // BLOCK * BLOCK
    again = alice.responses.create(model=MODEL, instructions="Nonce 78.", store=False, **GREEDY, input=[
        {"role": "user", "content": asked}, {"role": "assistant", "content": lost.output_text},
        {"role": "user", "content": "And another?"}])  # (the same conversation, sent whole: nothing kept it)
    assert again.usage.input_tokens_details.cached_tokens < lost.usage.input_tokens // BLOCK * BLOCK


def test_text_format_json_schema_is_followed(server):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16}},
              "required": ["city"], "additionalProperties": False}
    r = client(server).responses.create(
        model=MODEL, input="Which city is the capital of France? Answer in JSON.", temperature=0.0,
        max_output_tokens=40, text={"format": {"type": "json_schema", "name": "capital", "schema": schema,
                                               "strict": True}})
    assert r.status == "completed" and r.text.format.type == "json_schema"
    jsonschema.validate(json.loads(r.output_text), schema)
    r = client(server).responses.create(model=MODEL, input="Give a JSON object with a key 'a'.", temperature=0.0,
                                        max_output_tokens=40, text={"format": {"type": "json_object"}})
    assert isinstance(json.loads(r.output_text), dict)


def test_a_function_tool_round_trip(server):
    alice = client(server)
    first = alice.responses.create(model=MODEL, input="What is the weather in Paris?", tools=[WEATHER],
                                   tool_choice="required", temperature=0.0, max_output_tokens=40)
    calls = [o for o in first.output if o.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and calls[0].call_id
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER["parameters"])
    answer = alice.responses.create(model=MODEL, previous_response_id=first.id, tools=[WEATHER], **GREEDY,
                                    input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                                            "output": "sunny, 21 C"}])
    assert answer.output_text.strip() and answer.usage.input_tokens_details.cached_tokens > 0
    events = list(alice.responses.create(model=MODEL, input="Weather in Oslo?", tools=[WEATHER],
                                         tool_choice={"type": "function", "name": "get_weather"}, stream=True,
                                         temperature=0.0, max_output_tokens=40))
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and done[0].name == "get_weather"
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert deltas == done[0].arguments and json.loads(deltas)["city"]
    assert events[-1].type == "response.completed"


def _agents(server):
    from agents import set_default_openai_client, set_tracing_disabled

    set_tracing_disabled(True)  # (no trace export: nothing leaves the machine)
    set_default_openai_client(openai.AsyncOpenAI(base_url=server.base, api_key=ALICE, max_retries=0),
                              use_for_tracing=False)


def test_openai_agents_default_loop_completes(server):
    from agents import Agent, ModelSettings, Runner, function_tool

    _agents(server)
    asked: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city now."""
        asked.append(city)
        return f"sunny and 21 C in {city}"

    settings = ModelSettings(temperature=0.0)
    plain = Agent(name="tutor", instructions="Answer in one short sentence.", model=MODEL, model_settings=settings)
    with_tool = Agent(name="weather", instructions="Answer in one short sentence.", model=MODEL,
                      tools=[get_weather], model_settings=settings)
    forced = Agent(name="weather", instructions="Answer in one short sentence.", model=MODEL, tools=[get_weather],
                   model_settings=ModelSettings(temperature=0.0, tool_choice="required"))

    async def run() -> list:  # (one event loop: the SDK's client keeps its connections on it)
        streamed = Runner.run_streamed(plain, "What is the capital of France?", max_turns=2)
        deltas = [e.data.delta async for e in streamed.stream_events()
                  if e.type == "raw_response_event" and e.data.type == "response.output_text.delta"]
        assert "".join(deltas) == streamed.final_output
        return [await Runner.run(plain, "What is the capital of France?", max_turns=2), streamed,
                await Runner.run(with_tool, "Say hello.", max_turns=4),
                await Runner.run(forced, "What is the weather in Paris?", max_turns=4)]

    results = asyncio.run(run())
    assert all(isinstance(r.final_output, str) and r.final_output.strip() for r in results)
    assert results[0].final_output == results[1].final_output  # (greedy: streamed or not, one answer)
    assert asked  # (the forced agent's tool ran, and its answer came after the tool's output)
    kinds = [item.type for item in results[3].new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"] and kinds[-1] == "message_output_item"


def _gateway(server, responses_dir: str) -> procs.Proc:
    return procs.Proc("gateway", "--address", server.address, "--responses-dir", responses_dir)


def test_stored_responses_survive_a_gateway_restart_on_their_dir(server, tmp_path):
    gw = _gateway(server, str(tmp_path))
    try:
        base = f"http://127.0.0.1:{gw.port}/v1"
        first = client(server, base=base).responses.create(model=MODEL, input="What is 2 + 2?", **GREEDY)
    finally:
        assert gw.stop() == 0
    gw = _gateway(server, str(tmp_path))
    try:
        base = f"http://127.0.0.1:{gw.port}/v1"
        alice = client(server, base=base)
        assert alice.responses.retrieve(first.id).output_text == first.output_text
        with pytest.raises(openai.NotFoundError):
            client(server, BOB, base).responses.retrieve(first.id)
        follow = alice.responses.create(model=MODEL, previous_response_id=first.id, input="And 3 + 3?", **GREEDY)
        assert follow.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens // BLOCK * BLOCK
    finally:
        gw.stop()
    gw = _gateway(server, "memory")
    try:
        base = f"http://127.0.0.1:{gw.port}/v1"
        kept = client(server, base=base).responses.create(model=MODEL, input="Hi.", **GREEDY)
    finally:
        gw.stop()
    gw = _gateway(server, "memory")
    try:
        with pytest.raises(openai.NotFoundError):
            client(server, base=f"http://127.0.0.1:{gw.port}/v1").responses.retrieve(kept.id)
    finally:
        gw.stop()
