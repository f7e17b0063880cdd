"""Log-probabilities end to end, against transformers: ``pagedkv serve --http-port`` on a small random llama with a
chat template (its own tokenizer under serve), prompts longer than a chunk (prefill in several steps), several
requests at once. Through the gRPC client: the sampled tokens' log-probabilities and their top-5, the prompt's
(with ranks and top-5), greedy, seeded with penalties and a logit bias (the log-probabilities stay the raw model's),
n = 2 (the fork parent computes the prompt's), and a prompt whose pages are cached (the request asking for prompt
log-probabilities takes no hit; one that does not, still does). Through the HTTP gateway with the official openai
client: completions with logprobs=5 and echo, streamed with continuous usage, and chat with top_logprobs, token names
being the tokenizer's text. Each value is compared with ``torch.log_softmax(model(ids).logits)`` of transformers
(eager, float32) on the same ids, within TOL."""

from __future__ import annotations

import asyncio

import pytest
import torch

from pagedkv.cli import free_port
from pagedkv.client import Client, Completion
from tests.support.chat_template import TEMPLATE, template_ids
from tests.support.hf_reference import random_prompts

pytestmark = pytest.mark.e2e

# float32 on both sides; pagedkv's chunked, paged and batched sums differ from transformers' in the last bits: a
# log-probability of this small model strays by at most ~2.4e-6 (measured over the gRPC test's 2,388), and 1e-4
# absolute is what the test allows (the test reports its largest as max_abs_deviation)
TOL = 1e-4
VOCAB = 259  # the byte tokenizer (id = byte + 3)
LENS = [6, 45, 81]  # with --max-num-batched-tokens 32: one, two and three prefill steps
K = 5


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import AutoTokenizer

    from pagedkv.tools.random_model import build_random_model

    path = build_random_model(tmp_path_factory.mktemp("lp-model") / "model", seed=11, hidden_size=64,
                              intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2)
    tok = AutoTokenizer.from_pretrained(str(path))
    tok.chat_template = TEMPLATE
    tok.save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def server(model_dir):
    from tests.conftest import Server

    http = free_port()
    s = Server("--model", str(model_dir), "--num-pages", "256", "--max-num-batched-tokens", "32",
               "--http-port", str(http), "--check-integrity")
    s.http = http
    yield s
    s.stop()


@pytest.fixture(scope="module")
def hf(model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), attn_implementation="eager", dtype=torch.float32)
    model.eval()
    tok = AutoTokenizer.from_pretrained(str(model_dir))

    def logprobs(ids: list[int]) -> torch.Tensor:
        """[len(ids), V]: row p is the distribution of token p + 1."""
        with torch.inference_mode():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    return logprobs, tok


def run(coro):
    return asyncio.run(coro)


DEVIATIONS: list[float] = []  # |pagedkv - transformers| of every log-probability compared (reported)


def check_position(ref: torch.Tensor, token: int, lp: float, top_ids, top_lps, k: int = K) -> None:
    """``lp`` is ``token``'s log-probability in ``ref`` (one row) and (top_ids, top_lps) its k most likely: each id's
    value is its own, and the values are the k largest (ids may swap between ties within TOL)."""
    assert abs(lp - float(ref[token])) < TOL, (lp, float(ref[token]))
    best = torch.topk(ref, k).values.tolist()
    assert len(top_ids) == len(top_lps) == k
    DEVIATIONS.append(abs(lp - float(ref[token])))
    for j, (t, v) in enumerate(zip(top_ids, top_lps)):
        assert abs(v - float(ref[t])) < TOL and abs(v - best[j]) < TOL, (j, t, v, float(ref[t]), best[j])
        DEVIATIONS.append(abs(v - float(ref[t])))


def check_completion(hf, prompt: list[int], out: Completion, k_prompt: int | None = K) -> None:
    logprobs, _ = hf
    ref = logprobs(prompt + out.token_ids)
    assert len(out.logprobs) == len(out.top_logprobs) == len(out.token_ids) > 0
    for j, token in enumerate(out.token_ids):
        top = out.top_logprobs[j]
        check_position(ref[len(prompt) - 1 + j], token, out.logprobs[j], list(top.token_ids), list(top.logprobs))
    if k_prompt is None:
        return
    p = out.prompt
    assert list(p.token_ids) == prompt and p.num_tokens == len(prompt)
    assert len(p.logprobs) == len(p.ranks) == len(prompt) - 1
    for i in range(1, len(prompt)):
        row, lp = ref[i - 1], p.logprobs[i - 1]
        top = p.top_logprobs[i - 1] if k_prompt else None
        if top is not None:
            check_position(row, prompt[i], lp, list(top.token_ids), list(top.logprobs), k_prompt)
        else:
            assert abs(lp - float(row[prompt[i]])) < TOL
        above = int((row > row[prompt[i]] + TOL).sum()) + 1, int((row > row[prompt[i]] - TOL).sum()) + 1
        assert above[0] <= p.ranks[i - 1] <= above[1]


def test_grpc_logprobs_equal_transformers_greedy_seeded_and_forked(server, hf, record_property):
    prompts = random_prompts(21, LENS, VOCAB)
    asked = dict(logprobs=True, top_logprobs=K, prompt_logprobs=K, max_tokens=12, ignore_eos=True)

    async def scenario():
        async with Client(server.address) as c:
            greedy = [c.complete(p, temperature=0, **asked) for p in prompts]
            # the controls and temperature change what is drawn, never the log-probabilities (the raw model's)
            seeded = [c.complete(p, temperature=0.9, seed=7, repetition_penalty=1.3, logit_bias={40: 5.0}, **asked)
                      for p in prompts]
            forked = [c.complete_n(prompts[1], 2, temperature=1.0, seed=3, **asked)]
            return await asyncio.gather(*greedy, *seeded, *forked)
    *outs, forks = run(scenario())
    for prompt, out in zip(prompts * 2, outs):
        check_completion(hf, prompt, out)
    check_completion(hf, prompts[1], forks[0])  # (the prompt's come on fork 0's stream, the parent's)
    check_completion(hf, prompts[1], forks[1], k_prompt=None)
    assert forks[0].token_ids != forks[1].token_ids and not forks[1].prompt.logprobs  # (the prompt's, once)
    record_property("max_abs_deviation", max(DEVIATIONS))
    print(f"\n{len(DEVIATIONS)} log-probabilities, largest |pagedkv - transformers| {max(DEVIATIONS):.2e}")


def test_prompt_logprobs_take_no_prefix_cache_hit_and_others_still_do(server, hf):
    (prompt,) = random_prompts(22, [70], VOCAB)

    async def scenario():
        async with Client(server.address) as c:
            first = await c.complete(prompt, max_tokens=2)
            asking = await c.complete(prompt, max_tokens=2, logprobs=True, top_logprobs=K, prompt_logprobs=K)
            plain = await c.complete(prompt, max_tokens=2)
            small = await c.complete(prompt[:1], max_tokens=2, prompt_logprobs=2, echo=True)
            return first, asking, plain, small
    first, asking, plain, small = run(scenario())
    assert first.cached_tokens == 0 and asking.cached_tokens == 0 and plain.cached_tokens == 64
    check_completion(hf, prompt, asking)
    assert small.prompt.num_tokens == 1 and not small.prompt.logprobs and list(small.prompt.token_ids) == prompt[:1]


def test_refusals_name_the_field_and_the_limit(server):
    import grpc

    async def refused(**params) -> str:
        async with Client(server.address) as c:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await c.complete([1, 50, 60], max_tokens=2, **params)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            return e.value.details()
    assert run(refused(logprobs=True, top_logprobs=21)) == ("sampling.top_logprobs: 21; must be in [0, 20] "
                                                            "(--max-logprobs=20)")
    assert run(refused(prompt_logprobs=-1)).startswith("sampling.prompt_logprobs: -1; must be in [0, 20]")
    assert run(refused(top_logprobs=2)).startswith("sampling.top_logprobs: 2 needs sampling.logprobs")


# ---- the HTTP gateway, with the official client -------------------------------------------------------------
@pytest.fixture(scope="module")
def openai_client(server):
    import openai

    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.http}/v1", api_key="none", max_retries=0, timeout=60)


def _grpc_greedy(server, prompt: list[int], max_tokens: int) -> Completion:
    async def one():
        async with Client(server.address) as c:
            return await c.complete(prompt, max_tokens=max_tokens, ignore_eos=True, temperature=0)
    return run(one())


def test_completions_logprobs_and_echo_through_the_openai_client(server, hf, openai_client):
    logprobs, tok = hf
    from pagedkv.gateway.logprobs import token_string

    (prompt,) = random_prompts(23, [40], VOCAB)
    model = openai_client.models.list().data[0].id
    r = openai_client.completions.create(model=model, prompt=prompt, max_tokens=6, logprobs=K, echo=True,
                                         temperature=0, extra_body={"ignore_eos": True, "prompt_logprobs": 2})
    (choice,) = r.choices
    out = _grpc_greedy(server, prompt, 6).token_ids  # (greedy: the same tokens)
    ids = prompt + out
    ref = logprobs(ids)
    got = choice.logprobs
    assert got.tokens == [token_string(tok, t) for t in ids]  # text, not token_id:N: serve gave the gateway its own
    assert choice.text == tok.decode(prompt) + tok.decode(out, skip_special_tokens=True)  # (the ids' text, decoded)
    assert got.token_logprobs[0] is None and got.top_logprobs[0] is None
    names = {}
    for t in range(VOCAB):
        names.setdefault(token_string(tok, t), []).append(t)
    for i in range(1, len(ids)):
        row = ref[i - 1]
        assert abs(got.token_logprobs[i] - float(row[ids[i]])) < TOL
        top = got.top_logprobs[i]
        best = set(torch.topk(row, K).indices.tolist()) | {ids[i]}  # the token and the K most likely, by name:
        assert len(top) == len({token_string(tok, t) for t in best})  # (vLLM's dict; names may coincide)
        assert top[got.tokens[i]] == got.token_logprobs[i]
        for name, value in top.items():  # (a name may stand for several ids: bytes >= 128 all read U+FFFD)
            assert any(abs(value - float(row[t])) < TOL for t in names[name] if t in best), (name, value)
    assert got.text_offset == [sum(len(n) for n in got.tokens[:i]) for i in range(len(ids))]
    prompt_lps = choice.model_extra["prompt_logprobs"]
    assert prompt_lps[0] is None and len(prompt_lps) == len(prompt)
    for i in range(1, len(prompt)):
        entry = prompt_lps[i][str(prompt[i])]
        assert abs(entry["logprob"] - float(ref[i - 1][prompt[i]])) < TOL
        assert entry["decoded_token"] == token_string(tok, prompt[i]) and entry["rank"] >= 1


def test_streamed_completions_and_chat_logprobs_through_the_openai_client(server, hf, openai_client):
    from pagedkv.gateway.logprobs import token_string

    logprobs, tok = hf
    model = openai_client.models.list().data[0].id
    (prompt,) = random_prompts(24, [50], VOCAB)
    chunks = list(openai_client.completions.create(
        model=model, prompt=prompt, max_tokens=5, logprobs=2, stream=True, temperature=0,
        stream_options={"include_usage": True, "continuous_usage_stats": True}, extra_body={"ignore_eos": True}))
    out = _grpc_greedy(server, prompt, 5).token_ids
    ref = logprobs(prompt + out)
    streamed = [lp for c in chunks if c.choices for lp in c.choices[0].logprobs.token_logprobs]
    assert len(streamed) == 5
    for j, value in enumerate(streamed):
        assert abs(value - float(ref[len(prompt) - 1 + j][out[j]])) < TOL
    counts = [c.usage.completion_tokens for c in chunks if c.choices]
    assert counts == sorted(counts) and counts[-1] == 5 and all(c.usage.prompt_tokens == 50 for c in chunks)

    messages = [{"role": "user", "content": "Say something."}]
    r = openai_client.chat.completions.create(model=model, messages=messages, max_tokens=6, logprobs=True,
                                              top_logprobs=3, temperature=0, extra_body={"ignore_eos": True})
    chat_ids = template_ids(tok, messages)
    content = r.choices[0].logprobs.content
    assert len(content) == 6
    out = _grpc_greedy(server, chat_ids, 6).token_ids  # (greedy: the chat's tokens)
    ref = logprobs(chat_ids + out)
    for j, entry in enumerate(content):
        row = ref[len(chat_ids) - 1 + j]
        assert abs(entry.logprob - float(row[out[j]])) < TOL
        best = torch.topk(row, 3)
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(best.values.tolist(), abs=TOL)
        assert entry.token == token_string(tok, out[j]) and entry.bytes == list(entry.token.encode("utf-8"))
