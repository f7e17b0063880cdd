"""The Responses API in process (no sockets): a /v1/responses body translated onto the chat path (input items,
instructions, tools, function-call items, text.format, max_output_tokens), its field table walked (refused fields
are 400s naming them), the answer's shapes (object, typed SSE events, function_call items, usage with cached
tokens), the store (per tenant, bounded by count and bytes, oldest evicted, files read back by a new store), and the
routes against a scripted scheduler: retain_kv set when stored, GET and DELETE per tenant, previous_response_id."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest

from pagedkv.api.v1 import api_pb2 as api
from pagedkv.gateway import responses_fields
from pagedkv.gateway.app import Gateway, create_app
from pagedkv.gateway.errors import ApiError
from pagedkv.gateway.fields import REFUSED
from pagedkv.gateway.responses_api import canonical_items, messages_of, parse
from pagedkv.gateway.responses_routes import Responses
from pagedkv.gateway.responses_store import ResponsesStore
from tests.unit.test_gateway_unit import FakeUpstream, Log, _msg, asgi, rpc_error

pytestmark = pytest.mark.unit

WEATHER = {"type": "function", "name": "weather", "description": "the weather",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def _parse(**body):
    return parse({"model": "m", "input": "hi", **body}, "r", None)


# ---- translation -----------------------------------------------------------------------------------------------
def test_input_items_become_the_chat_conversation():
    items = canonical_items([
        {"role": "user", "content": "weather in Paris?"},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Let me look.", "annotations": []}]},
        {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "weather", "arguments": '{"city":"P"}'},
        {"type": "function_call", "call_id": "call_2", "name": "weather", "arguments": '{"city":"R"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "rain"}]},
    ])
    msgs = messages_of("be brief", items)
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "tool", "tool"]
    assert msgs[2]["content"] == "Let me look." and [c["id"] for c in msgs[2]["tool_calls"]] == ["call_1", "call_2"]
    assert msgs[4] == {"role": "tool", "tool_call_id": "call_2", "content": "rain"}
    req = parse({"model": "m", "input": [{"role": "user", "content": "x"}], "instructions": "be brief"}, "r", items)
    chat = req.plan.requests[0].chat
    assert [m.role for m in chat.messages] == ["system", "user", "assistant", "tool", "tool", "user"]
    assert chat.messages[2].tool_calls[1].function.arguments == '{"city":"R"}'


def test_sampling_tools_and_text_format_reach_the_generate_request():
    req = _parse(max_output_tokens=9, temperature=0.0, top_p=0.5, tools=[WEATHER],
                 tool_choice={"type": "function", "name": "weather"}, parallel_tool_calls=False)
    r = req.plan.requests[0]
    assert (r.sampling.max_tokens, r.sampling.temperature, r.sampling.top_p) == (9, 0.0, 0.5)
    assert r.chat.tools[0].function.name == "weather" and json.loads(r.chat.tools[0].function.parameters)
    assert r.chat.tool_choice.function == "weather" and req.plan.parallel_tool_calls is False
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    r = _parse(text={"format": {"type": "json_schema", "name": "s", "schema": schema, "strict": True}}).plan.requests[0]
    assert json.loads(r.sampling.constraint.json_schema) == schema and r.sampling.constraint.strict
    assert _parse(text={"format": {"type": "json_object"}}).plan.requests[0].sampling.constraint.json_object
    assert not _parse(text={"format": {"type": "text"}}).plan.requests[0].sampling.HasField("constraint")
    assert _parse().store and not _parse(store=False).store  # (store: true by default, as OpenAI's)


@pytest.mark.parametrize("f", [f for f in responses_fields.FIELDS if f.kind == REFUSED], ids=lambda f: f.name)
def test_every_refused_field_is_a_400_naming_it_and_accepted_at_its_default(f):
    with pytest.raises(ApiError) as e:
        _parse(**{f.name: f.example})
    assert e.value.status == 400 and e.value.param == f.name
    for value in f.accepted:
        _parse(**{f.name: value})


@pytest.mark.parametrize("body, param", [
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0].type"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format.name"),
    ({"text": {"verbosity": "low"}}, "text.verbosity"),
    ({"reasoning": {"effort": "high"}}, "reasoning.effort"),
    ({"max_output_tokens": 0}, "max_output_tokens"),  # (the chat path's refusal, named as this request names it)
    ({"metadata": {"k": 1}}, "metadata"),
])
def test_bad_fields_are_named_as_the_responses_request_names_them(body, param):
    with pytest.raises(ApiError) as e:
        _parse(**body)
    assert e.value.status == 400 and e.value.param == param, e.value.message
    assert e.value.message.startswith(param)


def test_unknown_fields_are_kept_for_the_warning_and_the_header():
    screened = _parse(surprise=1, user="u").plan.screened
    assert screened.unknown == ["surprise"] and screened.ignored == ["user"]


# ---- the store -------------------------------------------------------------------------------------------------
def _response(i: int, size: int = 10) -> dict:
    return {"id": f"resp_{i:032x}", "created_at": i, "output": [], "pad": "x" * size}


def test_the_store_is_per_tenant_and_evicts_the_oldest_past_count_and_bytes():
    store = ResponsesStore(None, max_count=3, max_bytes=2000)
    for i in range(4):
        assert store.put("a", _response(i), [])
    assert store.get("a", _response(0)["id"]) is None and store.get("a", _response(3)["id"]) is not None
    assert store.get("b", _response(3)["id"]) is None  # (another tenant's id)
    assert store.count("a")[0] == 3
    assert store.put("a", _response(9, 1850), [])  # (past the bytes: the older ones go)
    assert store.count("a")[0] == 1 and store.count("a")[1] <= 2000
    assert not store.put("a", _response(10, 5000), [])  # (alone over the bound: not stored)
    assert store.get("a", _response(9)["id"]) is not None


def test_stored_files_are_read_back_by_a_new_store(tmp_path):
    store = ResponsesStore(tmp_path, max_count=5)
    for i in range(3):
        store.put("a" if i < 2 else "b", _response(i), [{"type": "message", "role": "user", "content": f"q{i}"}])
    store.delete("a", _response(0)["id"])
    store.close()
    again = ResponsesStore(tmp_path, max_count=5)
    assert again.get("a", _response(0)["id"]) is None
    assert again.get("a", _response(1)["id"]).items[0]["content"] == "q1"
    assert again.get("b", _response(2)["id"]) is not None and again.get("a", _response(2)["id"]) is None
    assert all(p.stat().st_mode & 0o077 == 0 for p in tmp_path.glob("*/*.json"))
    smaller = ResponsesStore(tmp_path, max_count=1)  # (read back within the bounds: the newest kept)
    assert smaller.get("a", _response(1)["id"]) is not None and smaller.count("a")[0] == 1


# ---- the routes against a scripted scheduler ------------------------------------------------------------------
class TenantUpstream(FakeUpstream):
    """The scheduler's word on the caller's tenant (ModelInfo), by key; and ReleaseKv."""

    def __init__(self, *scripts) -> None:
        super().__init__(*scripts)
        self.released: list[str] = []

    async def model_info(self, metadata):
        key = dict(metadata).get("authorization", "")
        if key == "Bearer bad":
            raise ApiError(401, "bad key", code="invalid_api_key")
        return api.ModelInfoResponse(model="m", tenant=api.TenantInfo(id=key.removeprefix("Bearer ")))

    async def ReleaseKv(self, req, metadata, timeout):  # noqa: N802
        self.released.append(req.key)
        if len(self.released) > 1:
            raise rpc_error(grpc.StatusCode.UNIMPLEMENTED, "no retention")
        return api.ReleaseKvResponse(pages_released=3)


def _first(text="", fmt="", **kw) -> api.GenerateResponse:
    m = _msg(text=text, **kw)
    m.prompt.CopyFrom(api.Prompt(num_tokens=20, tool_call_format=fmt))
    return m


def _app(up, store=None, ttl=600):
    gw = Gateway(up, Log())
    responses = Responses(gw, store or ResponsesStore(None), ttl)
    return create_app(gw, extra_routes=responses.routes()), responses


def _call(app, path, body=None, key="alice", method="POST"):
    data = json.dumps(body).encode() if body is not None else b""
    status, headers, out = asyncio.run(asgi(app, path, data, headers=[(b"authorization", f"Bearer {key}".encode())],
                                            method=method))
    return status, headers, out


def test_create_answers_a_response_object_stores_it_and_retains_its_kv():
    up = TenantUpstream([_first("Par", ids=[1]), _msg(text="is", ids=[2], finish=api.FINISH_REASON_STOP, prompt=20,
                                                       completion=2, cached=16)])
    app, responses = _app(up)
    status, _, out = _call(app, "/v1/responses", {"model": "m", "input": "capital of France?", "metadata": {"k": "v"}})
    body = json.loads(out)
    assert status == 200 and body["object"] == "response" and body["status"] == "completed"
    assert body["output"][0]["content"][0]["text"] == "Paris" and body["metadata"] == {"k": "v"}
    assert body["usage"] == {"input_tokens": 20, "input_tokens_details": {"cached_tokens": 16}, "output_tokens": 2,
                             "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 22}
    assert up.requests[0].retain_kv == api.RetainKv(key=body["id"], ttl_s=600)
    status, _, got = _call(app, f"/v1/responses/{body['id']}", method="GET")
    assert status == 200 and json.loads(got) == body
    assert _call(app, f"/v1/responses/{body['id']}", key="bob", method="GET")[0] == 404  # (another tenant's)
    assert _call(app, f"/v1/responses/{body['id']}", key="bad", method="GET")[0] == 401
    assert _call(app, f"/v1/responses/{body['id']}", key="bob", method="DELETE")[0] == 404
    status, _, out = _call(app, f"/v1/responses/{body['id']}", method="DELETE")
    assert status == 200 and json.loads(out)["deleted"] and up.released == [body["id"]]
    assert _call(app, f"/v1/responses/{body['id']}", method="GET")[0] == 404


def test_store_false_keeps_nothing_and_retains_no_kv():
    up = TenantUpstream([_first("a", ids=[1], finish=api.FINISH_REASON_STOP, prompt=3, completion=1)])
    app, responses = _app(up)
    body = json.loads(_call(app, "/v1/responses", {"model": "m", "input": "x", "store": False})[2])
    assert body["store"] is False and not up.requests[0].HasField("retain_kv")
    assert _call(app, f"/v1/responses/{body['id']}", method="GET")[0] == 404


def test_previous_response_id_continues_the_tenants_stored_conversation():
    up = TenantUpstream(
        [_first(fmt="named", ids=[1]), _msg(text='{"city": "Oslo"}', ids=[2], finish=api.FINISH_REASON_STOP)],
        [_first("Cold.", ids=[3], finish=api.FINISH_REASON_STOP, prompt=40, completion=1, cached=32)])
    app, _ = _app(up)
    first = json.loads(_call(app, "/v1/responses", {"model": "m", "input": "weather?", "tools": [WEATHER],
                                                    "tool_choice": {"type": "function", "name": "weather"}})[2])
    call = first["output"][0]
    assert call["type"] == "function_call" and call["name"] == "weather" and json.loads(call["arguments"])
    follow = {"model": "m", "previous_response_id": first["id"], "tools": [WEATHER],
              "input": [{"type": "function_call_output", "call_id": call["call_id"], "output": "-3 C"}]}
    assert _call(app, "/v1/responses", follow, key="bob")[0] == 404  # (another tenant's conversation)
    status, _, out = _call(app, "/v1/responses", follow)
    assert status == 200 and json.loads(out)["previous_response_id"] == first["id"]
    msgs = up.requests[1].chat.messages
    assert [m.role for m in msgs] == ["user", "assistant", "tool"]
    assert msgs[1].tool_calls[0].id == call["call_id"] and msgs[2].content == "-3 C"


def _events(out: bytes) -> list[dict]:
    events = []
    for block in out.decode().split("\n\n"):
        if block:
            kind, data = block.split("\n")
            events.append(json.loads(data.removeprefix("data: ")))
            assert kind == f"event: {events[-1]['type']}"
    return events


def test_a_stream_sends_the_typed_events_in_order():
    up = TenantUpstream([_first("Hel", ids=[1]), _msg(text="lo", ids=[2]),
                         _msg(ids=[3], finish=api.FINISH_REASON_LENGTH, prompt=5, completion=3)])
    app, responses = _app(up)
    status, headers, out = _call(app, "/v1/responses", {"model": "m", "input": "x", "stream": True,
                                                        "max_output_tokens": 3})
    events = _events(out)
    assert status == 200 and headers[b"content-type"].startswith(b"text/event-stream")
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.incomplete"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    final = events[-1]["response"]
    assert final["status"] == "incomplete" and final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["output"][0]["content"][0]["text"] == "Hello" and final["usage"]["output_tokens"] == 3
    assert responses.store.get("alice", final["id"]).response == final  # (stored as streamed)


def test_a_streamed_tool_call_is_a_function_call_item_with_argument_deltas():
    up = TenantUpstream([_first('[{"name": "weather", "parameters": {"city"', fmt="required", ids=[1]),
                         _msg(text=': "Rome"}}]', ids=[2], finish=api.FINISH_REASON_STOP, prompt=9, completion=2)])
    app, _ = _app(up)
    out = _call(app, "/v1/responses", {"model": "m", "input": "x", "stream": True, "tools": [WEATHER],
                                       "tool_choice": "required"})[2]
    events = _events(out)
    kinds = [e["type"] for e in events]
    assert kinds[2] == "response.output_item.added" and events[2]["item"]["type"] == "function_call"
    assert "response.function_call_arguments.delta" in kinds and "response.output_text.delta" not in kinds
    done = next(e for e in events if e["type"] == "response.function_call_arguments.done")
    assert json.loads(done["arguments"]) == {"city": "Rome"} and done["name"] == "weather"
    assert "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta") == \
        done["arguments"]
    assert events[-1]["type"] == "response.completed" and events[-1]["response"]["output"][0]["call_id"]


def test_a_refusal_names_the_responses_field():
    up = TenantUpstream([rpc_error(grpc.StatusCode.INVALID_ARGUMENT, "prompt.chat.messages[0]: too long")])
    app, _ = _app(up)
    status, _, out = _call(app, "/v1/responses", {"model": "m", "input": "x"})
    assert status == 400 and json.loads(out)["error"]["param"] == "input"
    assert _call(app, "/v1/responses", {"model": "m", "input": "x", "previous_response_id": "resp_x"})[0] == 404
    assert _call(app, "/v1/responses", {"model": "m", "input": "x"}, key="bad")[0] == 401


# ---- flags -----------------------------------------------------------------------------------------------------
def test_the_flags_have_defaults_are_checked_and_reach_serves_gateway_child():
    import argparse

    from pagedkv.gateway.responses_store import (
        add_responses_args,
        check_responses_args,
        responses_child_args,
        responses_dir,
    )

    p = argparse.ArgumentParser()
    add_responses_args(p)
    args = p.parse_args([])
    assert (args.responses_kv_ttl, args.responses_max_count, args.responses_max_bytes) == (600, 1000, 64 << 20)
    assert responses_child_args(args) == [] and responses_dir("memory") is None
    assert responses_dir("").name == "responses"  # (under the cache directory)
    args = p.parse_args(["--responses-kv-ttl", "0", "--responses-dir", "memory"])
    assert responses_child_args(args) == ["--responses-dir", "memory", "--responses-kv-ttl", "0"]
    for bad_args, flag in ((["--responses-kv-ttl", "-1"], "--responses-kv-ttl -1"),
                           (["--responses-max-count", "0"], "--responses-max-count 0")):
        with pytest.raises(ValueError, match=flag):
            check_responses_args(p.parse_args(bad_args))


def test_kv_ttl_zero_asks_no_retention_and_delete_calls_no_release():
    up = TenantUpstream([_first("a", ids=[1], finish=api.FINISH_REASON_STOP, prompt=3, completion=1)])
    app, _ = _app(up, ttl=0)
    body = json.loads(_call(app, "/v1/responses", {"model": "m", "input": "x"})[2])
    assert body["store"] and not up.requests[0].HasField("retain_kv")
    assert _call(app, f"/v1/responses/{body['id']}", method="DELETE")[0] == 200 and up.released == []


def test_an_error_mid_stream_is_an_error_event_and_response_failed_and_nothing_is_stored():
    up = TenantUpstream([_first("Hel", ids=[1]), rpc_error(grpc.StatusCode.INVALID_ARGUMENT, "sampling.constraint: "
                                                           "the grammar did not compile")])
    app, responses = _app(up)
    events = _events(_call(app, "/v1/responses", {"model": "m", "input": "x", "stream": True})[2])
    assert [e["type"] for e in events][-2:] == ["error", "response.failed"]
    assert events[-2]["message"].startswith("text.format: ") and events[-2]["param"] == "text.format"  # (its name here)
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and responses.store.get("alice", failed["id"]) is None
