"""Clients nobody here wrote, against ``pagedkv serve --http-port`` serving the built-in real model: litellm (its
context-window error and a Router's context-window fallback), LangChain (``ChatOpenAI`` invoke and stream, the
completions ``OpenAI(logprobs=N)``), and lm-eval's ``local-completions`` loglikelihood over a task file shipped
here. Log-probabilities are checked against transformers' log-softmax of the same model (float32, 2e-3 nats)."""

from __future__ import annotations

import os

import pytest
import torch

from pagedkv.cli import free_port
from pagedkv.local_server import LocalServer

pytestmark = pytest.mark.e2e

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # litellm: no fetch of its cost map at import
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # lm-eval's datasets: the local JSONL only
MODEL, MAX_LEN = "smollm2-135m-instruct", 512
TOL = 2e-3  # nats: float32 on both sides, different kernels and summation orders


class Http(LocalServer):
    def __init__(self, *args: str) -> None:
        self.http_port = free_port()
        super().__init__(*args, "--http-port", str(self.http_port))
        self.base = f"http://127.0.0.1:{self.http_port}/v1"


@pytest.fixture(scope="module")
def server(smollm2_dir):
    s = Http("--model", MODEL, "--max-model-len", str(MAX_LEN), "--num-pages", "128")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def hf(smollm2_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(str(smollm2_dir))


def logprobs_of(model, ids: list[int]) -> torch.Tensor:
    """log p(ids[i] | ids[:i]) for i >= 1, from transformers."""
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


def long_text(tokens: int) -> str:
    return "the " * tokens  # (a token each in SmolLM2's vocabulary)


# ---- litellm --------------------------------------------------------------------------------------------------


def test_litellm_completes_and_maps_the_context_window_error(server):
    import litellm

    kw = dict(model=f"openai/{MODEL}", api_base=server.base, api_key="x", max_tokens=6, temperature=0)
    r = litellm.completion(messages=[{"role": "user", "content": "What is the capital of France?"}], **kw)
    assert r.choices[0].message.content and r.usage.completion_tokens == 6
    with pytest.raises(litellm.ContextWindowExceededError) as e:
        litellm.completion(messages=[{"role": "user", "content": long_text(2 * MAX_LEN)}], **kw)
    assert "maximum context length" in str(e.value)


def test_litellm_router_falls_back_on_the_context_window(server, model_cache):
    """A Router with context_window_fallbacks: the prompt too long for the smaller deployment goes to the one that
    holds it (the same model served with a 2,048-token window)."""
    import litellm

    big = Http("--model", MODEL, "--max-model-len", "2048", "--num-pages", "256")
    try:
        router = litellm.Router(
            model_list=[
                {"model_name": "small", "litellm_params": {"model": f"openai/{MODEL}", "api_base": server.base,
                                                           "api_key": "x"}},
                {"model_name": "big", "litellm_params": {"model": f"openai/{MODEL}", "api_base": big.base,
                                                         "api_key": "x"}},
            ],
            context_window_fallbacks=[{"small": ["big"]}], num_retries=0)
        short = router.completion(model="small", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                  temperature=0)
        assert short.usage.prompt_tokens < MAX_LEN
        long = router.completion(model="small", messages=[{"role": "user", "content": long_text(2 * MAX_LEN)}],
                                 max_tokens=3, temperature=0)
        assert MAX_LEN < long.usage.prompt_tokens < 2048 and long.choices[0].finish_reason  # (only big holds it)
    finally:
        big.stop()


# ---- LangChain ------------------------------------------------------------------------------------------------


def test_langchain_chat_invoke_and_stream_agree(server):
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(base_url=server.base, api_key="x", model=MODEL, temperature=0, max_tokens=12)
    whole = chat.invoke("Name a colour.")
    streamed = "".join(chunk.content for chunk in chat.stream("Name a colour."))
    assert whole.content and streamed == whole.content
    assert whole.response_metadata["finish_reason"] == "length"


def test_langchain_completions_logprobs_match_transformers(server, hf):
    from langchain_openai import OpenAI

    model, tok = hf
    prompt = "The capital of France is"
    llm = OpenAI(base_url=server.base, api_key="x", model=MODEL, temperature=0, max_tokens=5, logprobs=3)
    gen = llm.generate([prompt]).generations[0][0]
    lp = gen.generation_info["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 5
    assert all(len(top) == 3 for top in lp["top_logprobs"])
    ids = tok(prompt)["input_ids"]
    out = tok(gen.text, add_special_tokens=False)["input_ids"]
    want = logprobs_of(model, ids + out)[len(ids) - 1:]
    got = torch.tensor(lp["token_logprobs"])
    assert len(out) == 5 and torch.allclose(got, want, atol=TOL), (got, want)
    for token, value, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):  # greedy: the top one
        assert max(top.values()) == pytest.approx(value, abs=1e-6) and token in top


# ---- lm-eval --------------------------------------------------------------------------------------------------

TASK = """task: pagedkv_tiny_ll
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{continuation}}}}"
target_delimiter: ""
metric_list:
  - metric: perplexity
    aggregation: perplexity
    higher_is_better: false
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""
DOCS = [("The capital of France is", " Paris"), ("One, two, three,", " four"),
        ("The opposite of hot is", " cold."), ("Water freezes at zero degrees", " Celsius")]


def test_lm_eval_loglikelihood_matches_transformers(server, hf, smollm2_dir, tmp_path):
    import json

    import lm_eval
    from lm_eval.tasks import TaskManager

    model, tok = hf
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"context": c, "continuation": t}) + "\n" for c, t in DOCS))
    (tmp_path / "task.yaml").write_text(TASK.format(data=data))
    out = lm_eval.simple_evaluate(
        model="local-completions", tasks=["pagedkv_tiny_ll"], task_manager=TaskManager(include_path=str(tmp_path)),
        model_args=(f"model={MODEL},base_url={server.base}/completions,tokenizer_backend=huggingface,"
                    f"tokenizer={smollm2_dir},num_concurrent=2,max_retries=1"), log_samples=True)
    samples = sorted(out["samples"]["pagedkv_tiny_ll"], key=lambda s: s["doc_id"])
    assert len(samples) == len(DOCS)
    for (context, target), sample in zip(DOCS, samples):
        got, greedy = sample["resps"][0][0]
        ctx = tok(context)["input_ids"]
        whole = tok(context + target)["input_ids"]
        want = logprobs_of(model, whole)[len(ctx) - 1:]
        assert abs(float(got) - float(want.sum())) < TOL * len(want), (context, got, want)


def test_langchain_with_structured_output_json_schema(server):
    """LangChain's ``with_structured_output(PydanticModel, method="json_schema")`` sends ``response_format``
    json_schema (strict): the answer parses into the model whatever the model would have written unconstrained."""
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    class Capital(BaseModel):
        city: str = Field(max_length=40)
        country: str = Field(max_length=40)
        population_millions: int = Field(ge=0, le=10000)

    chat = ChatOpenAI(base_url=server.base, api_key="x", model=MODEL, temperature=0, max_tokens=120)
    got = chat.with_structured_output(Capital, method="json_schema").invoke("What is the capital of France?")
    assert isinstance(got, Capital) and got.city and got.country


def test_langchain_with_structured_output_function_calling_and_json_mode(server):
    """``method="function_calling"`` binds the model as a tool with a named tool_choice: the grammar writes its
    arguments, which parse into the model; ``method="json_mode"`` sends response_format json_object: the answer is a
    JSON object, which parses into it too (given a prompt that names its keys: json_object carries no schema)."""
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    class Capital(BaseModel):
        """The capital of a country."""

        city: str = Field(max_length=40)
        population_millions: int = Field(ge=0, le=10000)

    chat = ChatOpenAI(base_url=server.base, api_key="x", model=MODEL, temperature=0, max_tokens=120)
    got = chat.with_structured_output(Capital, method="function_calling").invoke("What is the capital of France?")
    assert isinstance(got, Capital) and got.city
    got = chat.with_structured_output(Capital, method="json_mode").invoke(
        "What is the capital of France? Answer in JSON with the keys city and population_millions.")
    assert isinstance(got, Capital) and got.city  # (json_object has no schema: the prompt names the keys)


def test_langchain_bind_tools_and_a_tool_result_round_trip(server):
    """``bind_tools`` with tool_choice "any" (OpenAI's required) and one call at most: the AIMessage carries a call with
    arguments of its schema; the tool's result goes back as a ToolMessage and the model answers in text."""
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str, days: int) -> str:
        """The weather forecast for a city, for 1 to 7 days."""
        return f"sunny in {city} for {days} days"

    chat = ChatOpenAI(base_url=server.base, api_key="x", model=MODEL, temperature=0, max_tokens=80)
    question = HumanMessage("What will the weather be in Paris for the next 2 days?")
    called = chat.bind_tools([get_weather], tool_choice="any", parallel_tool_calls=False).invoke([question])
    (call,) = called.tool_calls
    assert call["name"] == "get_weather" and isinstance(call["args"]["city"], str)
    assert isinstance(call["args"]["days"], int) and called.response_metadata["finish_reason"] == "tool_calls"
    result = ToolMessage(get_weather.invoke(call["args"]), tool_call_id=call["id"])
    answer = chat.invoke([question, called, result])
    assert isinstance(answer.content, str) and answer.content and not answer.tool_calls
