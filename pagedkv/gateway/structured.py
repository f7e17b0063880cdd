"""Structured outputs in OpenAI's and vLLM's spellings -> the GenerateRequest's ``sampling.constraint``:

  response_format {"type": "json_object"}                          -> json_object
  response_format {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}
                                                                   -> json_schema (+ strict); no schema: json_object
  structured_outputs {"json" | "regex" | "choice" | "grammar" | "json_object"} (vLLM's; "disable_additional_properties":
                                                                   strict)
  guided_json, guided_regex, guided_choice, guided_grammar         -> json_schema (strict), regex, choice, grammar

A request carries one constraint: two of these (or two keys of structured_outputs) are a 400 naming both. vLLM's
guided_json is strict (no property the schema does not name), as vLLM's xgrammar backend makes it; response_format's
json_schema follows its own "strict" (OpenAI's). The scheduler bounds sizes and the executor compiles (a schema,
regex or grammar it cannot use: 400 naming sampling.constraint.<kind>)."""

from __future__ import annotations

import json
from collections.abc import Mapping

from pagedkv.api.v1 import api_pb2 as api
from pagedkv.gateway.errors import bad

GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
STRUCTURED_KINDS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
                    "json_object": "json_object"}
# structured_outputs' other keys (vLLM's StructuredOutputsParams): accepted where they change nothing here
STRUCTURED_OPTIONS = {
    "disable_any_whitespace": (True, False),  # JSON is written compact either way (valid under both)
    "disable_fallback": (True, False),  # one backend, no fallback
    "disable_additional_properties": (True, False),  # true: strict
    "whitespace_pattern": (None,), "structural_tag": (None,),
}


def _schema_text(value, name: str) -> str:
    """A schema given as an object, or as its JSON text."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) or isinstance(value, bool):
        return json.dumps(value, ensure_ascii=False)
    raise bad(name, "must be a JSON Schema (an object, or its JSON text)")


def _string(value, name: str) -> str:
    if not isinstance(value, str) or not value:
        raise bad(name, "must be a non-empty string")
    return value


def _choices(value, name: str) -> api.Choices:
    if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
        raise bad(name, "must be a non-empty list of non-empty strings")
    return api.Choices(choices=value)


def _from_kind(kind: str, value, name: str, strict: bool) -> api.Constraint:
    if kind == "json_schema":
        return api.Constraint(json_schema=_schema_text(value, name), strict=strict)
    if kind == "json_object":
        if value is not True:
            raise bad(name, "must be true when set")
        return api.Constraint(json_object=True)
    if kind == "choice":
        return api.Constraint(choice=_choices(value, name))
    return api.Constraint(**{kind: _string(value, name)})


def _response_format(value) -> api.Constraint | None:
    if not isinstance(value, Mapping):
        raise bad("response_format", 'must be an object such as {"type": "json_object"}')
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return api.Constraint(json_object=True)
    if kind != "json_schema":
        raise bad("response_format.type", f"{str(kind)[:40]!r}; give text, json_object or json_schema")
    spec = value.get("json_schema")
    if not isinstance(spec, Mapping) or not isinstance(spec.get("name"), str):
        raise bad("response_format.json_schema", "must be an object with a name (and a schema)")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise bad("response_format.json_schema.strict", "must be true or false")
    if spec.get("schema") is None:
        return api.Constraint(json_object=True)
    return api.Constraint(json_schema=_schema_text(spec["schema"], "response_format.json_schema.schema"),
                          strict=bool(strict))


def _structured_outputs(value) -> list[tuple[str, api.Constraint]]:
    if not isinstance(value, Mapping):
        raise bad("structured_outputs", "must be an object such as {\"choice\": [\"yes\", \"no\"]}")
    for key, v in value.items():
        if key not in STRUCTURED_KINDS and (key not in STRUCTURED_OPTIONS or v not in STRUCTURED_OPTIONS[key]):
            allowed = ", ".join([*STRUCTURED_KINDS, *(k for k, a in STRUCTURED_OPTIONS.items() if a != (None,))])
            raise bad(f"structured_outputs.{key}", f"not supported by this server; give one of {allowed}")
    strict = bool(value.get("disable_additional_properties", True))
    return [(f"structured_outputs.{key}", _from_kind(kind, value[key], f"structured_outputs.{key}", strict))
            for key, kind in STRUCTURED_KINDS.items() if value.get(key) is not None and value.get(key) is not False]


def constraint_of(body: Mapping) -> api.Constraint | None:
    """The request's one constraint (None: none), or a 400 naming the field (both fields, when two are given)."""
    found: list[tuple[str, api.Constraint]] = []
    if body.get("response_format") is not None:
        c = _response_format(body["response_format"])
        if c is not None:
            found.append(("response_format", c))
    if body.get("structured_outputs") is not None:
        found += _structured_outputs(body["structured_outputs"])
    for name in GUIDED:
        if body.get(name) is not None:
            kind = {"guided_json": "json_schema"}.get(name, name.removeprefix("guided_"))
            found.append((name, _from_kind(kind, body[name], name, strict=True)))
    if len(found) > 1:
        raise bad(found[1][0], f"a request takes one constraint; {found[0][0]} and {found[1][0]} are both set")
    return found[0][1] if found else None
