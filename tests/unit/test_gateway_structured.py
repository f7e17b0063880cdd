"""The gateway's structured-outputs fields (pagedkv/gateway/structured.py): OpenAI's response_format, vLLM's
structured_outputs and guided_* become the one sampling.constraint of each GenerateRequest, on both endpoints; two
constraints, or a malformed one, are a 400 naming the field."""

from __future__ import annotations

import json

import pytest

from pagedkv.api.v1 import api_pb2 as api
from pagedkv.gateway.errors import ApiError
from pagedkv.gateway.openai_requests import parse_chat, parse_completion

pytestmark = pytest.mark.unit

SCHEMA = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}, "required": ["b"]}
BASE = {False: {"model": "m", "prompt": ["one", "two"]}, True: {"model": "m", "messages": [{"role": "user",
                                                                                          "content": "hi"}]}}


def _constraints(chat: bool, **extra) -> list[api.Constraint]:
    plan = (parse_chat if chat else parse_completion)({**BASE[chat], **extra}, "r")
    return [r.sampling.constraint for r in plan.requests]


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("extra, expected", [
    ({"response_format": {"type": "json_object"}}, api.Constraint(json_object=True)),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}},
     api.Constraint(json_schema=json.dumps(SCHEMA), strict=True)),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}},
     api.Constraint(json_schema=json.dumps(SCHEMA))),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, api.Constraint(json_object=True)),
    ({"structured_outputs": {"json": SCHEMA}}, api.Constraint(json_schema=json.dumps(SCHEMA), strict=True)),
    ({"structured_outputs": {"json": json.dumps(SCHEMA), "disable_additional_properties": False,
                             "disable_any_whitespace": True}}, api.Constraint(json_schema=json.dumps(SCHEMA))),
    ({"structured_outputs": {"regex": "[a-z]+"}}, api.Constraint(regex="[a-z]+")),
    ({"structured_outputs": {"choice": ["a", "b"]}}, api.Constraint(choice=api.Choices(choices=["a", "b"]))),
    ({"structured_outputs": {"grammar": 'root ::= "x"'}}, api.Constraint(grammar='root ::= "x"')),
    ({"structured_outputs": {"json_object": True}}, api.Constraint(json_object=True)),
    ({"guided_json": SCHEMA}, api.Constraint(json_schema=json.dumps(SCHEMA), strict=True)),
    ({"guided_regex": "\\d+"}, api.Constraint(regex="\\d+")),
    ({"guided_choice": ["yes", "no"]}, api.Constraint(choice=api.Choices(choices=["yes", "no"]))),
    ({"guided_grammar": 'root ::= "a"', "guided_decoding_backend": "xgrammar"}, api.Constraint(grammar='root ::= "a"')),
])
def test_each_spelling_becomes_the_constraint_of_every_request(chat, extra, expected):
    found = _constraints(chat, **extra)
    assert found and all(c == expected for c in found)
    schema = json.loads(expected.json_schema) if expected.json_schema else None
    if schema is not None:
        assert list(schema["properties"]) == ["b", "a"]  # (property order kept: the output follows it)


def test_text_and_nothing_mean_no_constraint():
    for extra in ({}, {"response_format": {"type": "text"}}, {"structured_outputs": {"json_object": False}}):
        assert not parse_chat({**BASE[True], **extra}, "r").requests[0].sampling.HasField("constraint")


@pytest.mark.parametrize("extra, param, words", [
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex",
     "response_format and guided_regex are both set"),
    ({"guided_choice": ["a"], "guided_json": SCHEMA}, "guided_choice", "guided_json and guided_choice"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs.choice", "one constraint"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "give text, json_object or json_schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "with a name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": "yes"}}},
     "response_format.json_schema.strict", "true or false"),
    ({"response_format": "json"}, "response_format", "must be an object"),
    ({"guided_json": 5}, "guided_json", "must be a JSON Schema"),
    ({"guided_choice": []}, "guided_choice", "non-empty list"),
    ({"guided_regex": ""}, "guided_regex", "non-empty string"),
    ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern", "not supported"),
    ({"structured_outputs": {"json_object": 1}}, "structured_outputs.json_object", "must be true"),
    ({"guided_decoding_backend": "outlines", "guided_regex": "a"}, "guided_decoding_backend", "xgrammar"),
])
def test_malformed_or_double_constraints_are_a_400_naming_the_field(extra, param, words):
    with pytest.raises(ApiError) as e:
        _constraints(True, **extra)
    assert e.value.status == 400 and e.value.param == param and words in e.value.message
