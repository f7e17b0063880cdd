"""The OpenAI SDK against ``pagedkv gateway`` in front of a real scheduler and executor on loopback, every link
with TLS (HTTPS to the gateway, TLS from the gateway to the scheduler) and a tenants file: completions and chat,
streamed and not, n > 1, stop strings, logprobs, greedy and seeded tokens identical to the gRPC path, auth
failures, refusals, a client disconnect freeing its pages, /health and /metrics. A gateway with no scheduler, and
serve's gateway child: test_gateway_standalone_e2e.py."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import ssl
import subprocess
import sys

import openai
import pytest

from pagedkv.cli import build_parser
from tests.support import procs
from tests.support.chat_template import TOOL_TEMPLATE, template_ids
from tests.support.gateway_stack import ADMIN_KEY, KEY, MODEL, Stack, compose_gateway, grpc_complete, ids_of, run

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = Stack(tmp_path_factory.mktemp("gateway"))
    yield s
    codes = s.stop()
    assert codes == [0, 0, 0], "\n\n".join(p.log()[-3000:] for p in s.procs)


def test_models_and_health(stack):
    models = stack.openai().models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert stack.get("/health")[0] == 200 and stack.get("/health/live")[0] == 200


def test_auth_failures_are_401(stack):
    for key in ("wrong-key", "key-gw-revoked"):
        with pytest.raises(openai.AuthenticationError) as e:
            stack.openai(key).completions.create(model=MODEL, prompt="hi", max_tokens=2)
        assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            stack.openai(key).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])
        with pytest.raises(openai.AuthenticationError):
            stack.openai(key).models.list()
    status, body = stack.get("/v1/models")  # no Authorization header at all (the SDK always sends one)
    assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key"


def test_greedy_completion_equals_grpc_streamed_and_not(stack):
    ref = run(grpc_complete(stack, "The gateway", max_tokens=24, temperature=0, ignore_eos=True, logprobs=True))
    c = stack.openai()
    r = c.completions.create(model=MODEL, prompt="The gateway", max_tokens=24, temperature=0, logprobs=0,
                             extra_body={"ignore_eos": True})
    (choice,) = r.choices
    assert ids_of(choice.logprobs.tokens) == ref.token_ids and choice.text == ref.text
    assert choice.logprobs.token_logprobs == pytest.approx(ref.logprobs, abs=1e-5) and len(ref.logprobs) == 24
    assert choice.finish_reason == "length" and r.model == MODEL
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (ref.prompt_tokens, 24)
    chunks = list(c.completions.create(model=MODEL, prompt="The gateway", stream=True, logprobs=0,
                                       stream_options={"include_usage": True}, extra_body=dict(ignore_eos=True,
                                                                                               max_tokens=24,
                                                                                               temperature=0)))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
    streamed = [t for ch in chunks[:-1] for t in (ch.choices[0].logprobs.tokens if ch.choices[0].logprobs else [])]
    assert ids_of(streamed) == ref.token_ids
    assert "".join(ch.choices[0].text for ch in chunks[:-1]) == ref.text
    assert chunks[-2].choices[0].finish_reason == "length"


def test_chat_streamed_and_not_equals_grpc_and_the_template(stack):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    ref = run(grpc_complete(stack, messages=messages, max_tokens=16, temperature=0, ignore_eos=True))
    assert ref.prompt_tokens == len(template_ids(stack.tokenizer, messages))
    c = stack.openai()
    r = c.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=16, temperature=0,
                                  logprobs=True, extra_body={"ignore_eos": True})
    msg = r.choices[0]
    assert msg.message.role == "assistant" and msg.message.content == ref.text
    assert ids_of([t.token for t in msg.logprobs.content]) == ref.token_ids
    assert r.usage.prompt_tokens == ref.prompt_tokens and r.object == "chat.completion"
    stream = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == ref.text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_tool_calls_template_kwargs_and_continue_through_the_sdk(stack):
    """OpenAI's tool-call history (an assistant's tool_calls, a tool's tool_call_id, a name), a chat_template of the
    request's own and chat_template_kwargs reach the template; continue_final_message continues the last message;
    the prompt is the one transformers renders (vLLM's shape: arguments as an object), token for token."""
    call = {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}
    messages = [{"role": "user", "content": "Weather?", "name": "ann"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "content": "18C", "tool_call_id": "call_1"}]
    seen_call = {**call, "function": {"name": "weather", "arguments": {"city": "Paris"}}}
    seen = [messages[0], {"role": "assistant", "content": "", "tool_calls": [seen_call]}, messages[2]]
    prompt = template_ids(stack.tokenizer, seen, chat_template=TOOL_TEMPLATE, enable_thinking=False)
    assert b'{"city": "Paris"}' in bytes(t - 3 for t in prompt[1:]) and prompt[-1] != prompt[-2]
    ref = run(grpc_complete(stack, prompt, max_tokens=8, temperature=0, ignore_eos=True))
    c = stack.openai()
    r = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0, extra_body=dict(
        ignore_eos=True, chat_template=TOOL_TEMPLATE, chat_template_kwargs={"enable_thinking": False}))
    assert r.usage.prompt_tokens == len(prompt) and r.choices[0].message.content == ref.text
    partial = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello, I"}]
    continued = template_ids(stack.tokenizer, partial, add_generation_prompt=False, continue_final_message=True)
    r = c.chat.completions.create(model=MODEL, messages=partial, max_tokens=2, temperature=0,
                                  extra_body=dict(continue_final_message=True, add_generation_prompt=False))
    assert r.usage.prompt_tokens == len(continued) and bytes(t - 3 for t in continued[1:]).endswith(b"Hello, I")
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=MODEL, messages=partial, max_tokens=2,
                                  extra_body={"continue_final_message": True})
    assert e.value.body["param"] == "continue_final_message" and "add_generation_prompt" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=MODEL, messages=partial, max_tokens=2,
                                  extra_body={"chat_template_kwargs": {"messages": []}})
    assert e.value.body["param"] == "chat_template_kwargs"


def test_truncate_prompt_tokens_keeps_the_last_prompt_tokens(stack):
    text = "The quick brown fox jumps over the lazy dog. " * 8
    ids = stack.tokenizer(text)["input_ids"]
    ref = run(grpc_complete(stack, ids[-9:], max_tokens=6, temperature=0, ignore_eos=True))
    c = stack.openai()
    r = c.completions.create(model=MODEL, prompt=text, max_tokens=6, temperature=0,
                             extra_body={"truncate_prompt_tokens": 9, "ignore_eos": True})
    assert r.usage.prompt_tokens == 9 and r.choices[0].text == ref.text
    r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=1,
                                  extra_body={"truncate_prompt_tokens": 5})
    assert r.usage.prompt_tokens == 5
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=MODEL, prompt=text, max_tokens=1, extra_body={"truncate_prompt_tokens": 0})
    assert e.value.body["param"] == "truncate_prompt_tokens"


def test_tokenize_and_detokenize_give_the_ids_generate_runs(stack):
    """vLLM's /tokenize and /detokenize: a prompt's ids with BOS as Generate adds it (the usage agrees), a chat's as
    its template renders them, the text back from ids; the caller's key is checked; 405 for another method."""
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    status, prompt = stack.post("/tokenize", {"model": MODEL, "prompt": "Hello there", "return_token_strs": True})
    assert status == 200 and prompt["tokens"] == stack.tokenizer("Hello there")["input_ids"]
    assert prompt["count"] == len(prompt["tokens"]) and len(prompt["token_strs"]) == prompt["count"]
    assert prompt["max_model_len"] == stack.openai().models.list().data[0].max_model_len
    r = stack.openai().completions.create(model=MODEL, prompt="Hello there", max_tokens=1)
    assert r.usage.prompt_tokens == prompt["count"]
    status, chat = stack.post("/tokenize", {"messages": messages})
    assert status == 200 and chat["tokens"] == template_ids(stack.tokenizer, messages) and chat["token_strs"] is None
    status, text = stack.post("/detokenize", {"model": MODEL, "tokens": prompt["tokens"]})
    assert status == 200 and text == {"prompt": stack.tokenizer.decode(prompt["tokens"])}
    status, err = stack.post("/detokenize", {"tokens": [1 << 30]})
    assert status == 400 and err["error"]["param"] == "tokens"
    assert stack.post("/tokenize", {"prompt": "x"}, key="wrong-key")[0] == 401
    status, err = stack.post("/tokenize", {"prompt": "x"}, method="GET")
    assert status == 405 and err["error"]["type"] == "invalid_request_error"


def test_an_unset_temperature_is_openais_default_of_1(stack):
    """A checkpoint whose generation_config.json sets no sampling values: a request without temperature samples at
    1 (OpenAI's and vLLM's default), seed for seed what temperature=1 gives; ModelInfo says so."""
    c = stack.openai()

    def texts(**kw) -> list[str]:
        return [c.completions.create(model=MODEL, prompt="Once upon", max_tokens=12, seed=seed,
                                     extra_body={"ignore_eos": True}, **kw).choices[0].text for seed in (1, 2, 3)]
    unset = texts()
    assert unset == texts(temperature=1.0) and len(set(unset)) > 1 and len(set(texts(temperature=0))) == 1

    async def defaults():
        async with stack.grpc() as client:
            return (await client.model_info()).sampling_defaults
    d = run(defaults())
    assert (d.temperature, d.top_p, d.top_k, d.repetition_penalty, d.min_p) == (1.0, 1.0, 0, 1.0, 0.0)


def test_n_forks_with_a_seed_equal_grpc(stack):
    ref = run(grpc_complete(stack, "fork me", n=3, max_tokens=12, temperature=1.0, seed=42, ignore_eos=True))
    c = stack.openai()
    r = c.completions.create(model=MODEL, prompt="fork me", n=3, max_tokens=12, temperature=1.0, seed=42,
                             logprobs=0, extra_body={"ignore_eos": True})
    assert [ids_of(ch.logprobs.tokens) for ch in r.choices] == [o.token_ids for o in ref]
    assert len({tuple(o.token_ids) for o in ref}) > 1  # the forks differ: sampling really ran
    assert r.usage.prompt_tokens == ref[0].prompt_tokens and r.usage.completion_tokens == 36
    texts = ["", "", ""]
    for ch in c.completions.create(model=MODEL, prompt="fork me", n=3, max_tokens=12, temperature=1.0, seed=42,
                                   stream=True, extra_body={"ignore_eos": True}):
        for choice in ch.choices:
            texts[choice.index] += choice.text
    assert texts == [o.text for o in ref]


def test_stop_string_ends_the_completion(stack):
    full = run(grpc_complete(stack, "stop here", max_tokens=32, temperature=0, ignore_eos=True)).text
    at = next(i for i in range(4, len(full) - 2) if full[i].isprintable() and full[i] != "\ufffd"
              and full.find(full[i]) == i)
    stop = full[at]
    r = stack.openai().completions.create(model=MODEL, prompt="stop here", max_tokens=32, temperature=0,
                                          stop=[stop], extra_body={"ignore_eos": True})
    assert r.choices[0].text == full[:at] and r.choices[0].finish_reason == "stop"


def test_refusals(stack):
    c = stack.openai()
    with pytest.raises(openai.NotFoundError) as e:
        c.completions.create(model="gpt-4", prompt="x")
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError) as e:  # past the scheduler's --max-logprobs (20, from ModelInfo)
        c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], logprobs=True,
                                  top_logprobs=21)
    assert e.value.body["param"] == "top_logprobs" and "at most 20" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:  # refused by the scheduler, named in OpenAI's terms
        c.completions.create(model=MODEL, prompt="x", n=17)
    assert e.value.body["param"] == "n" and "16" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=MODEL, prompt="x", extra_body={"priority": 5000})
    assert e.value.body["param"] == "priority"



def test_fields_table_context_length_and_request_id_through_the_sdk(stack):
    """A refused field is the SDK's BadRequestError naming it; an unknown one passes, named in a header; the
    client's X-Request-Id is used and echoed; a request too long for the context is OpenAI's
    context_length_exceeded (pagedkv/gateway/fields.py, errors.py)."""
    c = stack.openai()
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=MODEL, prompt="x", max_tokens=2, extra_body={"best_of": 2})
    assert e.value.body["param"] == "best_of" and e.value.body["message"].startswith("best_of: ")
    raw = c.completions.with_raw_response.create(model=MODEL, prompt="x", max_tokens=2, temperature=0,
                                                 extra_body={"frobnicate": 1, "repetition_penalty": 1.0},
                                                 extra_headers={"X-Request-Id": "e2e-fields-1"})
    assert raw.headers["x-pagedkv-ignored-fields"] == "frobnicate" and raw.headers["x-request-id"] == "e2e-fields-1"
    r = raw.parse()
    assert r.id == "cmpl-e2e-fields-1" and r.usage.completion_tokens >= 1
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=10**6)
    assert e.value.code == "context_length_exceeded" and e.value.body["param"] == "messages"
    assert e.value.body["message"].startswith("This model's maximum context length is ")
    status, body = stack.get("/version")
    assert status == 200 and json.loads(body)["version"]

def test_client_disconnect_cancels_the_request_and_frees_its_pages(stack):
    stream = stack.openai().completions.create(model=MODEL, prompt="a long one", max_tokens=1800, temperature=0,
                                               stream=True, extra_body={"ignore_eos": True})
    it = iter(stream)
    first = next(it)
    for _ in range(3):
        next(it)
    stream.close()

    async def used() -> tuple[int, int]:
        async with stack.grpc(ADMIN_KEY) as c:
            info = await c.model_info()
            return info.num_used_pages, info.num_running

    assert procs.wait_for(lambda: stack.scheduler.saw("request_cancelled", request_id=first.id), timeout=15), \
        "the scheduler never saw the request cancelled"
    assert procs.wait_for(lambda: run(used()) == (0, 0), timeout=10, interval=0.2), run(used())
    assert procs.wait_for(lambda: stack.gateway.saw("request_finished", request_id=first.id,
                                                    client_disconnected=True), timeout=5)
    status, metrics = stack.get("/metrics")
    assert status == 200 and re.search(r"^pagedkv_gateway_client_disconnects_total [1-9]", metrics, re.M)
    assert 'pagedkv_gateway_requests_total{endpoint="completions",status="200"}' in metrics


def test_sigterm_lets_in_flight_streams_finish(stack):
    """What a rolling update does to a gateway pod: SIGTERM, the open stream ends normally, exit 0, fast."""
    gw = procs.Proc("gateway", "--address", stack.scheduler.address, "--tls-ca", stack.ca, "--served-model-name",
                    MODEL, "--shutdown-timeout", "60")
    try:
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{gw.port}/v1", api_key=KEY, max_retries=0, timeout=60)
        stream = c.completions.create(model=MODEL, prompt="drain", max_tokens=300, temperature=0, stream=True,
                                      stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        it = iter(stream)
        next(it)
        gw.signal(signal.SIGTERM)
        rest = list(it)
        assert rest[-1].usage.completion_tokens == 300 and rest[-2].choices[0].finish_reason == "length"
        assert gw.wait(30) == 0
        assert gw.saw("gateway_stopped")
    finally:
        gw.kill()


def test_compose_gateway_service_runs_and_its_healthcheck_passes(stack):
    """docker-compose.yml's gateway: its command run as a local process (the scheduler's name and /certs mapped
    to this stack), its health check run as docker would; the file validates with the gateway's profile on."""
    svc = compose_gateway()
    assert svc["profiles"] == ["http"] and svc["ports"] == ["${PAGEDKV_PUBLISH_HOST:-127.0.0.1}:8000:8000"]
    command = [str(c).replace("/certs", str(stack.certs)) for c in svc["command"]]
    parsed = build_parser().parse_args(command)
    assert parsed.address == "scheduler:50051" and parsed.tls_server_name == "scheduler" and parsed.port == 8000
    args = command[1:]
    for flag_, value in (("--address", stack.scheduler.address), ("--host", "127.0.0.1")):
        args[args.index(flag_) + 1] = value
    at = args.index("--port")
    del args[at:at + 2]  # Proc gives it a free port (and --log-format json)
    gw = procs.Proc("gateway", *args)
    port = gw.port
    try:
        test = [str(t).replace("/certs", str(stack.certs)).replace(":8000/", f":{port}/")
                for t in svc["healthcheck"]["test"][1:]]
        assert test[:3] == ["pagedkv", "health", "--http"]
        r = subprocess.run([sys.executable, "-m", *test], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and '"scheduler":"SERVING"' in r.stdout, (r.stdout, r.stderr)
        r = subprocess.run([sys.executable, "-m", "pagedkv", "health", "--http", f"https://127.0.0.1:{port}/nope",
                            "--tls-ca", stack.ca], capture_output=True, text=True, timeout=60)
        assert r.returncode == 1 and "404" in r.stderr
        http = openai.DefaultHttpxClient(verify=ssl.create_default_context(cafile=stack.ca))
        c = openai.OpenAI(base_url=f"https://127.0.0.1:{port}/v1", api_key=KEY, http_client=http, max_retries=0)
        (model,) = c.models.list().data  # no --served-model-name: the executor's --model
        r = c.completions.create(model=model.id, prompt="compose", max_tokens=3, extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 3
    finally:
        assert gw.stop() == 0, gw.log()
    compose = shutil.which("docker-compose")
    if compose:
        r = subprocess.run([compose, "-f", str(procs.ROOT / "docker-compose.yml"), "config"], capture_output=True,
                           text=True, cwd=procs.ROOT, env={**os.environ, "COMPOSE_PROFILES": "cpu,http"}, timeout=120)
        assert r.returncode == 0, r.stderr
        import yaml

        assert yaml.safe_load(r.stdout)["services"]["gateway"]["command"] == svc["command"]


def test_tokenizer_names_logprob_tokens_by_their_text(stack):
    messages = [{"role": "user", "content": "Hi"}]
    ref = run(grpc_complete(stack, messages=messages, max_tokens=8, temperature=0, ignore_eos=True))
    gw = procs.Proc("gateway", "--address", stack.scheduler.address, "--tls-ca", stack.ca, "--served-model-name",
                    MODEL, "--tokenizer", str(stack.model_dir))
    try:
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{gw.port}/v1", api_key=KEY, max_retries=0, timeout=60)
        r = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0, logprobs=True,
                                      extra_body={"ignore_eos": True})
        names = [stack.tokenizer.decode([t]) for t in ref.token_ids]
        assert [t.token for t in r.choices[0].logprobs.content] == names
        assert [t.bytes for t in r.choices[0].logprobs.content] == [list(n.encode()) for n in names]
    finally:
        assert gw.stop() == 0, gw.log()
