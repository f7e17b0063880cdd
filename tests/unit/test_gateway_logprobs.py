"""The gateway's log-probabilities (pagedkv/gateway/logprobs.py) in OpenAI's and vLLM's shapes: completions'
{tokens, token_logprobs, top_logprobs, text_offset} with the sampled token beside the N most likely, echo's prompt
first (its first token null), chat's content entries with exactly N alternatives, vLLM's prompt_logprobs with ranks;
token names with SentencePiece's leading spaces; then through the ASGI app against scripted upstream streams:
non-streamed and streamed (echo on each choice's first chunk, text_offset carried across chunks, usage in every
chunk with continuous_usage_stats), n > 1 sharing one prompt message, the limit and the tokenizer refusals."""

from __future__ import annotations

import asyncio
import json
import math

import pytest

from pagedkv.api.v1 import api_pb2 as api
from pagedkv.gateway import logprobs as lp
from pagedkv.gateway.app import Gateway, create_app
from tests.unit.test_gateway_unit import FakeUpstream, Log, _msg, asgi

pytestmark = pytest.mark.unit

NAMES = {1: "<s>", 5: " the", 6: " cat", 7: "é", 8: " dog", 9: "a"}


def names(token_id: int) -> str:
    return NAMES[token_id]


def top(ids, lps) -> api.TopLogprobs:
    return api.TopLogprobs(token_ids=ids, logprobs=lps)


def test_completion_logprobs_show_the_sampled_token_and_the_n_most_likely_with_offsets():
    got = lp.completion_logprobs([5, 6], [-0.5, -2.0], [top([5, 8], [-0.5, -1.5]), top([8, 9], [-1.0, -float("inf")])],
                                 2, names, offset=3)
    assert got["tokens"] == [" the", " cat"] and got["token_logprobs"] == [-0.5, -2.0]
    assert got["top_logprobs"] == [{" the": -0.5, " dog": -1.5}, {" cat": -2.0, " dog": -1.0, "a": -9999.0}]
    assert got["text_offset"] == [3, 7]  # (from where the chunk's text starts, by the token strings' lengths)
    assert lp.completion_logprobs([5], [-0.5], [None], 0, None)["top_logprobs"] == [{"token_id:5": -0.5}]


def test_echo_puts_the_prompts_tokens_first_with_a_null_for_the_first():
    prompt = api.Prompt(num_tokens=3, token_ids=[1, 5, 6], text="<s> the cat", logprobs=[-3.0, -4.0],
                        top_logprobs=[top([9, 8, 5], [-1.0, -2.0, -3.0]), top([6, 9, 8], [-4.0, -5.0, -6.0])])
    ids, lps, tops = lp.echoed(prompt)
    got = lp.completion_logprobs(ids + [8], lps + [-0.1], tops + [None], 1, names)
    assert got["tokens"] == ["<s>", " the", " cat", " dog"]
    assert got["token_logprobs"] == [None, -3.0, -4.0, -0.1]
    assert got["top_logprobs"] == [None, {" the": -3.0, "a": -1.0}, {" cat": -4.0}, {" dog": -0.1}]
    assert got["text_offset"] == [0, 3, 7, 11]


def test_chat_logprobs_have_exactly_n_alternatives_and_bytes():
    got = lp.chat_logprobs([7, 5], [-0.25, -1.0], [top([8, 7, 9], [-0.125, -0.25, -3.0]), None], 2, names)
    first = got["content"][0]
    assert first == {"token": "é", "logprob": -0.25, "bytes": [0xC3, 0xA9],
                     "top_logprobs": [{"token": " dog", "logprob": -0.125, "bytes": list(b" dog")},
                                      {"token": "é", "logprob": -0.25, "bytes": [0xC3, 0xA9]}]}
    assert got["content"][1]["top_logprobs"] == [] and got["refusal"] is None
    assert lp.chat_logprobs([5], [-1.0], [None], 0, None)["content"][0]["bytes"] is None  # (token_id:N)


def test_prompt_logprobs_are_vllms_dicts_with_ranks():
    prompt = api.Prompt(num_tokens=3, token_ids=[1, 5, 6], logprobs=[-3.0, -float("inf")], ranks=[4, 1],
                        top_logprobs=[top([9, 8], [-1.0, -2.0]), top([6, 9], [-0.5, -5.0])])
    assert lp.prompt_logprobs_body(prompt, 1, names) == [
        None,
        {"5": {"logprob": -3.0, "rank": 4, "decoded_token": " the"},
         "9": {"logprob": -1.0, "rank": 1, "decoded_token": "a"}},
        {"6": {"logprob": -9999.0, "rank": 1, "decoded_token": " cat"}}]


def test_token_strings_keep_the_leading_space_sentencepiece_strips():
    class Tok:  # decode() strips the word-start space, as SentencePiece's does for a lone token
        pieces = {0: "\u2581the", 1: "ing", 2: "\u2581\u2581x", 3: "<0xE4>"}

        def decode(self, ids):
            return self.pieces[ids[0]].replace("\u2581", " ").lstrip(" ") if ids[0] != 3 else "\ufffd"

        def convert_ids_to_tokens(self, token_id):
            return self.pieces[token_id]
    assert [lp.token_string(Tok(), i) for i in range(4)] == [" the", "ing", "  x", "\ufffd"]


def test_limits_name_the_field_and_tokenizer_paths_are_checked(tmp_path):
    from pagedkv.gateway.errors import ApiError
    from pagedkv.gateway.openai_requests import parse_chat, parse_completion

    plan = parse_completion({"model": "m", "prompt": "x", "logprobs": 6, "prompt_logprobs": 2}, "r")
    with pytest.raises(ApiError) as e:
        lp.check_limits(plan, 5)
    assert e.value.param == "logprobs" and e.value.message == "logprobs: 6; at most 5 (the server's --max-logprobs)"
    chat = parse_chat({"model": "m", "messages": [{"role": "user", "content": "x"}], "logprobs": True,
                       "prompt_logprobs": 9}, "r")
    with pytest.raises(ApiError) as e:
        lp.check_limits(chat, 5)
    assert e.value.param == "prompt_logprobs"
    lp.check_limits(plan, 0)  # (not known: the scheduler refuses them itself)
    with pytest.raises(ValueError, match="not a directory"):
        lp.TokenNames(str(tmp_path / "none"))
    echo = parse_completion({"model": "m", "prompt": "x", "echo": True, "logprobs": 2, "prompt_logprobs": 1}, "r")
    s = echo.requests[0].sampling
    assert (s.echo, s.top_logprobs, s.prompt_logprobs, echo.prompt_logprobs) == (True, 2, 2, 1)  # (the larger)


# ---- the app ------------------------------------------------------------------------------------------------
PROMPT = api.Prompt(num_tokens=3, token_ids=[1, 5, 6], text="<s> the cat", logprobs=[-3.0, -4.0], ranks=[2, 1],
                    top_logprobs=[top([9, 5], [-1.0, -3.0]), top([6, 8], [-4.0, -4.5])])


def _with_prompt(msg: api.GenerateResponse, prompt: api.Prompt = PROMPT) -> api.GenerateResponse:
    msg.prompt.CopyFrom(prompt)
    return msg


def _tokens(index: int = 0) -> list[api.GenerateResponse]:
    a = _msg(index=index, text=" dog", ids=[8], lps=[-0.5])
    a.top_logprobs.add(token_ids=[8, 9], logprobs=[-0.5, -0.75])
    b = _msg(index=index, text="a", ids=[9], lps=[-1.5], finish=api.FINISH_REASON_LENGTH, prompt=3, completion=2)
    b.top_logprobs.add(token_ids=[8, 9], logprobs=[-0.375, -1.5])
    return [a, b]


def _post(script: list, body: dict, chat: bool = False, token_text=names):
    up = FakeUpstream(script)
    app = create_app(Gateway(up, Log(), token_text=token_text))
    path = "/v1/chat/completions" if chat else "/v1/completions"
    base = {"model": "m", **({"messages": [{"role": "user", "content": "x"}]} if chat else {"prompt": "<s> the cat"})}
    status, _, data = asyncio.run(asgi(app, path, json.dumps({**base, **body}).encode()))
    return status, data, up


def _events(data: bytes) -> list[dict]:
    events = [e.removeprefix(b"data: ") for e in data.split(b"\n\n") if e]
    assert events[-1] == b"[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_a_completion_with_echo_logprobs_and_prompt_logprobs():
    script = [_with_prompt(_msg()), *_tokens()]
    status, data, up = _post(script, {"echo": True, "logprobs": 1, "prompt_logprobs": 1, "max_tokens": 2})
    assert status == 200, data
    sent = up.requests[0].sampling
    assert (sent.echo, sent.logprobs, sent.top_logprobs, sent.prompt_logprobs) == (True, True, 1, 1)
    (choice,) = json.loads(data)["choices"]
    assert choice["text"] == "<s> the cat dog" + "a"
    got = choice["logprobs"]
    assert got["tokens"] == ["<s>", " the", " cat", " dog", "a"]
    assert got["token_logprobs"] == [None, -3.0, -4.0, -0.5, -1.5]
    assert got["top_logprobs"] == [None, {" the": -3.0, "a": -1.0}, {" cat": -4.0}, {" dog": -0.5},
                                   {"a": -1.5, " dog": -0.375}]
    assert got["text_offset"] == [0, 3, 7, 11, 15]
    assert choice["prompt_logprobs"][0] is None and choice["prompt_logprobs"][1]["5"]["rank"] == 2


def test_streamed_echo_comes_once_per_choice_offsets_go_on_and_usage_is_in_every_chunk():
    forks = [_with_prompt(_msg(index=1, text="a", ids=[9], lps=[-1.0])),
             _msg(index=0, text=" dog", ids=[8], lps=[-0.5]),
             _msg(index=1, text="", ids=[9], lps=[-1.0], finish=api.FINISH_REASON_LENGTH, prompt=3, completion=2),
             _msg(index=0, text="a", ids=[9], lps=[-1.5], finish=api.FINISH_REASON_LENGTH, prompt=3, completion=2)]
    status, data, _ = _post(forks, {"echo": True, "logprobs": 0, "n": 2, "max_tokens": 2, "stream": True,
                                    "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    assert status == 200, data
    chunks = _events(data)
    by_choice: dict[int, list[dict]] = {}
    for c in chunks[:-1]:
        by_choice.setdefault(c["choices"][0]["index"], []).append(c)
    assert sorted(by_choice) == [0, 1]
    for cs in by_choice.values():
        first = cs[0]["choices"][0]
        assert first["text"].startswith("<s> the cat") and first["logprobs"]["tokens"][:3] == ["<s>", " the", " cat"]
        assert first["logprobs"]["token_logprobs"][0] is None
        assert all(not c["choices"][0]["text"].startswith("<s>") for c in cs[1:])  # (echoed once)
        text = "".join(c["choices"][0]["text"] for c in cs)
        offsets = [o for c in cs for o in c["choices"][0]["logprobs"]["text_offset"]]
        assert offsets[0] == 0 and offsets == sorted(offsets) and offsets[-1] <= len(text)
        assert [c["usage"]["completion_tokens"] for c in cs] == [1, 2] and cs[0]["usage"]["prompt_tokens"] == 3
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4


def test_chat_streams_top_logprobs_and_usage_from_the_role_chunk_on():
    script = [_with_prompt(_msg(), api.Prompt(num_tokens=3)), *_tokens()]
    status, data, up = _post(script, {"logprobs": True, "top_logprobs": 2, "stream": True,
                                      "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
                             chat=True)
    assert status == 200, data
    assert up.requests[0].sampling.top_logprobs == 2 and not up.requests[0].sampling.HasField("prompt_logprobs")
    role, first, last, usage = _events(data)
    assert role["choices"][0]["delta"]["role"] == "assistant" and role["usage"]["completion_tokens"] == 0
    content = first["choices"][0]["logprobs"]["content"]
    assert [(e["token"], e["logprob"]) for e in content] == [(" dog", -0.5)]
    assert [t["token"] for t in content[0]["top_logprobs"]] == [" dog", "a"]
    assert last["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    assert usage["choices"] == [] and usage["usage"]["total_tokens"] == 5


def test_chat_prompt_logprobs_come_beside_the_choices():
    script = [_with_prompt(_msg()), *_tokens()]
    status, data, _ = _post(script, {"prompt_logprobs": 0}, chat=True)
    body = json.loads(data)
    assert status == 200 and body["prompt_logprobs"][2] == {"6": {"logprob": -4.0, "rank": 1,
                                                                  "decoded_token": " cat"}}
    assert "prompt_logprobs" not in body["choices"][0] and body["choices"][0]["logprobs"] is None


def test_over_the_limit_is_a_400_and_a_tokenizer_that_failed_a_503_for_logprobs_only():
    status, data, up = _post([], {"logprobs": 21})
    error = json.loads(data)["error"]
    assert status == 400 and error["param"] == "logprobs" and "at most 20" in error["message"] and not up.requests

    class Broken(lp.TokenNames):
        def __init__(self) -> None:
            self.path, self.log, self._task = "x", None, None

        async def get(self):
            raise ValueError("--tokenizer x: cannot load a tokenizer there")
    status, data, _ = _post([], {"logprobs": 1}, token_text=Broken())
    assert status == 503 and "cannot name tokens" in json.loads(data)["error"]["message"]
    status, data, _ = _post([_msg(text="a", ids=[9], finish=1, prompt=1, completion=1)], {}, token_text=Broken())
    assert status == 200 and json.loads(data)["choices"][0]["text"] == "a"
    status, data, _ = _post(_tokens(), {"logprobs": 0, "return_tokens_as_token_ids": True}, token_text=Broken())
    assert status == 200 and json.loads(data)["choices"][0]["logprobs"]["tokens"] == ["token_id:8", "token_id:9"]
    assert not math.isnan(json.loads(data)["choices"][0]["logprobs"]["token_logprobs"][0])
