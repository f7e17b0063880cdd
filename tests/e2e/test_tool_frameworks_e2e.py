"""Agent frameworks with their defaults against ``pagedkv serve --http-port`` started with no tool flag, serving the
built-in SmolLM2 (#48 item 4): LangChain ``ChatOpenAI.bind_tools``, openai-agents with ``OpenAIChatCompletionsModel``
and pydantic-ai's ``Agent`` on ``OpenAIChatModel``. Each sends tools without tool_choice (or "auto") at some step,
which was a 400 until --tool-call-parser auto found hermes in the model's template; each loop here calls the tool
(where the framework's own setting forces one: the 135M model does not call tools on its own), gets its result back
to the server, and ends with a final answer. What each framework sent is recorded from its HTTP client. On the
same server: HTTP errors name the OpenAI request's fields, not the scheduler's; /v1/embeddings and unknown paths
are OpenAI-shaped errors saying why."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from pagedkv.cli import free_port
from pagedkv.local_server import LocalServer

pytestmark = pytest.mark.e2e

MODEL = "smollm2-135m-instruct"
QUESTION = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def server(smollm2_dir):
    port = free_port()
    s = LocalServer("--model", MODEL, "--max-model-len", "2048", "--num-pages", "384", "--http-port", str(port))
    s.base = f"http://127.0.0.1:{port}/v1"
    yield s
    s.stop()


class Sent(list):
    """The JSON bodies of the chat completions requests a client sent (its httpx request hook)."""

    def hook(self, request: httpx.Request) -> None:
        if request.url.path.endswith("/chat/completions"):
            self.append(json.loads(request.content))

    async def ahook(self, request: httpx.Request) -> None:
        self.hook(request)


def _auto(body: dict) -> bool:
    """A request with tools and tool_choice unset or auto (what --tool-call-parser auto serves)."""
    return bool(body.get("tools")) and body.get("tool_choice", "auto") == "auto"


def test_the_server_says_which_parser_auto_found(server):
    line = next(ln for ln in server.lines if "tool_call_parser" in ln)
    assert "parser=hermes" in line and "flag=auto" in line and "markup" in line


def test_langchain_bind_tools_default_and_a_tool_loop(server):
    """bind_tools with no tool_choice sends tools alone: answered (was 400). The loop: the first step forced by
    LangChain's tool_choice="any", the tool's result back through the default binding, a text answer at the end."""
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    ran: list[str] = []

    @tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        ran.append(city)
        return f"sunny and 24 C in {city}"

    sent = Sent()
    chat = ChatOpenAI(base_url=server.base, api_key="x", model=MODEL, temperature=0, max_tokens=60, seed=0,
                      http_client=httpx.Client(event_hooks={"request": [sent.hook]}))
    default = chat.bind_tools([get_weather])
    first = default.invoke([HumanMessage(QUESTION)])
    assert isinstance(first, AIMessage) and (first.content or first.tool_calls)
    assert _auto(sent[0]) and "tool_choice" not in sent[0]  # (LangChain's default: tools alone)

    forced = chat.bind_tools([get_weather], tool_choice="any")  # (LangChain's "any": OpenAI's required)
    history = [HumanMessage(QUESTION), forced.invoke([HumanMessage(QUESTION)])]
    for _ in range(3):  # (the agent loop: run each call, ask again with the default binding)
        calls = history[-1].tool_calls
        if not calls:
            break
        for call in calls:
            assert call["name"] == "get_weather" and isinstance(call["args"]["city"], str)
            history.append(ToolMessage(get_weather.invoke(call["args"]), tool_call_id=call["id"]))
        history.append(default.invoke(history))
    final = history[-1]
    assert ran and isinstance(final.content, str) and final.content.strip() and not final.tool_calls
    last = sent[-1]
    assert _auto(last) and any(m["role"] == "tool" and "sunny" in m["content"] for m in last["messages"])


def test_openai_agents_chat_completions_model_loop(server):
    """openai-agents' Runner on OpenAIChatCompletionsModel: with the agent's defaults the tools go with no
    tool_choice and the answer is text; with tool_choice "required" the first step calls the tool, the SDK resets
    tool_choice after it (reset_tool_choice, its default), and the final answer comes from an auto step."""
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
    from agents.items import ToolCallItem, ToolCallOutputItem
    from openai import AsyncOpenAI

    set_tracing_disabled(True)  # (no traces sent to OpenAI)
    ran: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        ran.append(city)
        return f"sunny and 24 C in {city}"

    async def run(settings: ModelSettings) -> tuple:
        sent = Sent()
        client = AsyncOpenAI(base_url=server.base, api_key="x", max_retries=0,
                             http_client=httpx.AsyncClient(event_hooks={"request": [sent.ahook]}, timeout=120))
        agent = Agent(name="weather", instructions="Answer the user's question in one sentence.",
                      tools=[get_weather], model=OpenAIChatCompletionsModel(model=MODEL, openai_client=client),
                      model_settings=settings)
        result = await Runner.run(agent, QUESTION, max_turns=4)
        return result, sent

    result, sent = asyncio.run(run(ModelSettings(temperature=0, max_tokens=60)))
    assert isinstance(result.final_output, str) and result.final_output.strip()
    assert _auto(sent[0]) and "tool_choice" not in sent[0]

    result, sent = asyncio.run(run(ModelSettings(temperature=0, max_tokens=60, tool_choice="required")))
    calls = [i for i in result.new_items if isinstance(i, ToolCallItem)]
    outputs = [i for i in result.new_items if isinstance(i, ToolCallOutputItem)]
    assert calls and outputs and ran and all(c.raw_item.name == "get_weather" for c in calls)
    assert json.loads(calls[0].raw_item.arguments)["city"]
    assert sent[0]["tool_choice"] == "required" and _auto(sent[-1])
    assert any(m["role"] == "tool" and "sunny" in m["content"] for m in sent[-1]["messages"])
    assert isinstance(result.final_output, str) and result.final_output.strip()


def test_pydantic_ai_agent_with_a_tool(server):
    """pydantic-ai's Agent on OpenAIChatModel with one tool: text output sends tool_choice auto (answered, was
    400); a structured output makes pydantic-ai require a tool call at each step (its output tool or ours) until
    its output tool gives the validated result."""
    from pydantic import BaseModel
    from pydantic_ai import Agent
    from pydantic_ai.messages import ToolCallPart
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    class Weather(BaseModel):
        city: str
        summary: str

    ran: list[str] = []

    def get_weather(city: str) -> str:
        """The current weather in a city."""
        ran.append(city)
        return f"sunny and 24 C in {city}"

    async def run(output_type) -> tuple:
        sent = Sent()
        provider = OpenAIProvider(base_url=server.base, api_key="x",
                                  http_client=httpx.AsyncClient(event_hooks={"request": [sent.ahook]}, timeout=120))
        agent = Agent(OpenAIChatModel(MODEL, provider=provider), tools=[get_weather], output_type=output_type,
                      model_settings={"temperature": 0, "max_tokens": 80, "seed": 0})
        return await agent.run(QUESTION), sent

    result, sent = asyncio.run(run(str))
    assert isinstance(result.output, str) and result.output.strip() and _auto(sent[0])

    result, sent = asyncio.run(run(Weather))
    assert isinstance(result.output, Weather) and result.output.city
    parts = [p for m in result.all_messages() for p in m.parts if isinstance(p, ToolCallPart)]
    assert parts and {p.tool_name for p in parts} <= {"get_weather", "final_result"}
    assert parts[-1].tool_name == "final_result" and sent[0]["tool_choice"] == "required"
    assert len(ran) == sum(p.tool_name == "get_weather" for p in parts)  # (each call of ours ran, once)


def test_errors_name_the_requests_fields_and_what_is_not_served(server):
    import openai

    client = openai.OpenAI(base_url=server.base, api_key="x", max_retries=0, timeout=60)
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError) as e:  # (refused by the scheduler: the gRPC path mapped)
        client.chat.completions.create(model=MODEL, messages=messages, tools=[tool, tool], max_tokens=4)
    assert e.value.body["param"] == "tools" and e.value.body["message"].startswith("tools[1].function.name: 'f'")
    assert "prompt.chat" not in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model=MODEL, input="hello")
    assert e.value.code == "model_not_supported" and "generation model" in e.value.body["message"]
    r = httpx.post(f"{server.base}/nothing", json={})
    assert r.status_code == 404 and "POST /v1/chat/completions" in r.json()["error"]["message"]
