"""Dynamo's pre-tokenized request as pagedkv's GenerateRequest (pagedkv/dynamo_request.py): every field that maps,
mapped to its value; every one that cannot, refused naming it; pagedkv's messages back as Dynamo's chunks. No
Dynamo import: these run without the extra."""

from __future__ import annotations

import json

import pytest

from pagedkv.api.v1 import api_pb2 as api
from pagedkv.dynamo_request import Refused, chunk_of, generate_request, prompt_logprobs_of, token_ids_of

pytestmark = pytest.mark.unit


def dynamo_request(**sections) -> dict:
    """A request as Dynamo 1.6.1's frontend sends it (the keys of one captured from /v1/completions), nulls where
    the client set nothing."""
    req = {
        "token_ids": [1, 5, 6, 7], "model": "tiny-llama", "eos_token_ids": [2], "mdc_sum": "abc", "annotations": [],
        "stop_conditions": {"max_tokens": None, "stop": None, "stop_token_ids": None, "stop_token_ids_visible": None,
                            "stop_token_ids_hidden": [2], "min_tokens": None, "ignore_eos": None,
                            "max_thinking_tokens": None},
        "sampling_options": {"n": None, "best_of": None, "presence_penalty": None, "frequency_penalty": None,
                             "repetition_penalty": None, "temperature": None, "top_p": None, "top_k": None,
                             "min_p": None, "use_beam_search": None, "length_penalty": None, "seed": None,
                             "include_stop_str_in_output": None, "guided_decoding": None},
        "output_options": {"logprobs": None, "prompt_logprobs": None, "skip_special_tokens": None,
                           "formatted_prompt": None, "return_tokens_as_token_ids": None},
        "routing": {"dp_rank": None},
        "extra_args": {"nvext": {"cache_salt": "s"}},
        "router_config_override": None,
    }
    for name, values in sections.items():
        if isinstance(req.get(name), dict):
            req[name].update(values)
        else:
            req[name] = values
    return req


def test_nulls_leave_the_models_defaults():
    req = generate_request(dynamo_request(), "r1")
    s = req.sampling
    assert list(req.token_ids.ids) == [1, 5, 6, 7] and req.request_id == "r1"
    for field in ("temperature", "top_p", "top_k", "seed", "repetition_penalty", "min_p", "prompt_logprobs"):
        assert not s.HasField(field), field
    assert max(1, s.n) == 1 and s.max_tokens == 0 and not s.logprobs and not s.ignore_eos
    assert not s.HasField("constraint")
    assert list(s.stop_token_ids) == [2]  # EOS among the hidden stop ids
    assert req.priority == 0


def test_every_sampling_field_maps():
    req = generate_request(dynamo_request(
        sampling_options={"n": 1, "best_of": 1, "temperature": 0.7, "top_p": 0.9, "top_k": 40, "min_p": 0.05,
                          "presence_penalty": 0.5, "frequency_penalty": -0.25, "repetition_penalty": 1.2,
                          "seed": 12345, "include_stop_str_in_output": True, "length_penalty": 1.0},
        stop_conditions={"max_tokens": 17, "min_tokens": 4, "stop_token_ids": [9, 10], "stop_token_ids_visible": [11],
                         "stop": ["never"]},
        output_options={"logprobs": 3, "prompt_logprobs": 2, "skip_special_tokens": True},
        routing={"priority": 5, "cache_salt": "salt"}), "r2")
    s = req.sampling
    assert max(1, s.n) == 1  # one fork
    assert s.temperature == pytest.approx(0.7) and s.top_p == pytest.approx(0.9) and s.top_k == 40
    assert s.min_p == pytest.approx(0.05) and s.repetition_penalty == pytest.approx(1.2)
    assert s.presence_penalty == pytest.approx(0.5) and s.frequency_penalty == pytest.approx(-0.25)
    assert s.seed == 12345 and s.max_tokens == 17 and s.min_tokens == 4
    assert list(s.stop_token_ids) == [9, 10, 11, 2]
    assert list(s.stop) == []  # Dynamo's frontend applies stop strings itself
    assert s.logprobs and s.top_logprobs == 3 and s.prompt_logprobs == 2
    assert req.priority == -5  # Dynamo's higher is sooner; pagedkv's lower is more important


def test_top_k_minus_one_is_off():
    assert generate_request(dynamo_request(sampling_options={"top_k": -1}), "r").sampling.top_k == 0


def test_logprobs_zero_is_the_sampled_tokens_only():
    s = generate_request(dynamo_request(output_options={"logprobs": 0}), "r").sampling
    assert s.logprobs and s.top_logprobs == 0


def test_ignore_eos_drops_eos_from_the_hidden_stop_ids():
    s = generate_request(dynamo_request(stop_conditions={"ignore_eos": True, "stop_token_ids_hidden": [2, 8]}),
                         "r").sampling
    assert s.ignore_eos and list(s.stop_token_ids) == [8]


@pytest.mark.parametrize(("guided", "expected"), [
    ({"json": {"type": "object"}}, api.Constraint(json_schema=json.dumps({"type": "object"}))),
    ({"json": '{"type": "integer"}'}, api.Constraint(json_schema='{"type": "integer"}')),
    ({"regex": "[a-z]+", "backend": "xgrammar"}, api.Constraint(regex="[a-z]+")),
    ({"choice": ["yes", "no"]}, api.Constraint(choice=api.Choices(choices=["yes", "no"]))),
    ({"grammar": 'root ::= "a"', "whitespace_pattern": None}, api.Constraint(grammar='root ::= "a"')),
])
def test_guided_decoding_is_a_constraint(guided, expected):
    s = generate_request(dynamo_request(sampling_options={"guided_decoding": guided}), "r").sampling
    assert s.constraint == expected


@pytest.mark.parametrize(("sections", "field"), [
    ({"sampling_options": {"use_beam_search": True}}, "sampling_options.use_beam_search"),
    ({"sampling_options": {"length_penalty": 0.8}}, "sampling_options.length_penalty"),
    ({"sampling_options": {"n": 2}}, "sampling_options.n"),  # Dynamo 1.6.1 ends a response at its first finish
    ({"sampling_options": {"best_of": 4}}, "sampling_options.best_of"),
    ({"sampling_options": {"top_k": -2}}, "sampling_options.top_k"),
    ({"sampling_options": {"temperature": float("nan")}}, "sampling_options.temperature"),
    ({"sampling_options": {"seed": -1}}, "sampling_options.seed"),
    ({"sampling_options": {"n": 0}}, "sampling_options.n"),
    ({"sampling_options": {"guided_decoding": {"structural_tag": {"x": 1}}}},
     "sampling_options.guided_decoding.structural_tag"),
    ({"sampling_options": {"guided_decoding": {"whitespace_pattern": " "}}},
     "sampling_options.guided_decoding.whitespace_pattern"),
    ({"sampling_options": {"guided_decoding": {"ebnf": "x"}}}, "sampling_options.guided_decoding.ebnf"),
    ({"sampling_options": {"guided_decoding": {"regex": "a", "choice": ["a"]}}}, "sampling_options.guided_decoding"),
    ({"sampling_options": {"guided_decoding": {"choice": "yes"}}}, "sampling_options.guided_decoding.choice"),
    ({"sampling_options": {"logit_bias": {"5": 1.0}}}, "sampling_options.logit_bias"),
    ({"stop_conditions": {"max_thinking_tokens": 64}}, "stop_conditions.max_thinking_tokens"),
    ({"stop_conditions": {"max_tokens": -1}}, "stop_conditions.max_tokens"),
    ({"stop_conditions": {"stop_token_ids": "2"}}, "stop_conditions.stop_token_ids"),
    ({"output_options": {"logprobs": 1.5}}, "output_options.logprobs"),
    ({"output_options": {"prompt_logprobs": -1}}, "output_options.prompt_logprobs"),
    ({"routing": {"priority": 5000}}, "routing.priority"),
    ({"multi_modal_data": {"image_url": ["x"]}}, "multi_modal_data"),
    ({"prefill_result": {"x": 1}}, "prefill_result"),
    ({"bootstrap_info": {"x": 1}}, "bootstrap_info"),
    ({"token_ids": []}, "token_ids"),
    ({"something_new": 1}, "something_new"),
])
def test_what_cannot_map_is_refused_naming_it(sections, field):
    with pytest.raises(Refused) as err:
        generate_request(dynamo_request(**sections), "r")
    assert err.value.field == field and str(err.value).startswith(f"{field}: ")


def test_packed_token_ids():
    packed = b"".join(i.to_bytes(4, "little") for i in (1, 300, 70000))
    assert token_ids_of({"token_ids": packed}) == [1, 300, 70000]
    with pytest.raises(Refused, match="token_ids"):
        token_ids_of({"token_ids": b"\x01\x00\x00"})


def decode(token: int) -> str:
    return f"<{token}>"


def test_chunks_carry_tokens_logprobs_and_the_last_its_usage():
    msg = api.GenerateResponse(token_ids=[5, 6], logprobs=[-0.5, -1.5], index=1, top_logprobs=[
        api.TopLogprobs(token_ids=[5, 9], logprobs=[-0.5, -2.0]),
        api.TopLogprobs(token_ids=[4, 6], logprobs=[-1, -1.5])])
    chunk = chunk_of(msg, True, decode)
    assert chunk == {"token_ids": [5, 6], "index": 1, "log_probs": [-0.5, -1.5], "top_logprobs": [
        [{"rank": 1, "token_id": 5, "token": "<5>", "logprob": -0.5},
         {"rank": 2, "token_id": 9, "token": "<9>", "logprob": -2.0}],
        [{"rank": 1, "token_id": 4, "token": "<4>", "logprob": -1.0},
         {"rank": 2, "token_id": 6, "token": "<6>", "logprob": -1.5}]]}
    last = api.GenerateResponse(token_ids=[2], finish_reason=api.FINISH_REASON_STOP,
                                usage=api.Usage(prompt_tokens=40, completion_tokens=3, cached_tokens=32))
    chunk = chunk_of(last, False, decode)
    assert chunk == {"token_ids": [2], "index": 0, "finish_reason": "stop", "completion_usage": {
        "prompt_tokens": 40, "completion_tokens": 3, "total_tokens": 43,
        "prompt_tokens_details": {"cached_tokens": 32}}}
    assert chunk_of(api.GenerateResponse(finish_reason=api.FINISH_REASON_LENGTH), False, decode)["finish_reason"] \
        == "length"


def test_prompt_logprobs_in_dynamos_shape():
    prompt = api.Prompt(num_tokens=3, token_ids=[1, 7, 8], logprobs=[-1.0, -2.0], ranks=[1, 3],
                        top_logprobs=[api.TopLogprobs(token_ids=[7], logprobs=[-1.0]),
                                      api.TopLogprobs(token_ids=[4, 5], logprobs=[-0.5, -0.7])])
    assert prompt_logprobs_of(prompt, decode) == [
        None,
        {"7": {"logprob": -1.0, "rank": 1, "decoded_token": "<7>"}},
        {"8": {"logprob": -2.0, "rank": 3, "decoded_token": "<8>"},
         "4": {"logprob": -0.5, "rank": 1, "decoded_token": "<4>"},
         "5": {"logprob": pytest.approx(-0.7), "rank": 2, "decoded_token": "<5>"}},
    ]
