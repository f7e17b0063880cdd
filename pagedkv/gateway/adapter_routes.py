"""vLLM's run-time LoRA endpoints (#52), answered by the scheduler's LoadAdapter and UnloadAdapter with the caller's
credentials (``AdapterRoutes``):

  POST /v1/load_lora_adapter    {"lora_name", "lora_path", "public"?}  -> 200 "Success: LoRA adapter 'x' added
                                                                          successfully."
  POST /v1/unload_lora_adapter  {"lora_name"}                          -> 200 "Success: LoRA adapter 'x' removed
                                                                          successfully."

The caller's tenant owns what it loads (at most its ``max_adapters`` in the tenants file): only it sees the adapter
in GET /v1/models and selects it by ``model``. ``public`` (pagedkv's; an admin tenant's only) loads one every tenant
may use. A success is vLLM's plain-text line (curl users and scripts read it); a refusal is OpenAI's error shape,
as everywhere in the gateway. The body is bounded before it is parsed (MAX_BODY_BYTES, 413) and its fields before
anything is sent (pagedkv.bounds: the scheduler's own rules), each refusal a 400 naming the field.

Fields, as the gateway's table treats them (fields.py): the ones above honoured; vLLM's ``load_inplace`` refused
unless false (an adapter is never replaced under running requests: unload it, then load); vLLM's ``lora_int_id``
ignored by design (vLLM unloads by ``lora_name`` too); any other field accepted, named in a warning and in
IGNORED_FIELDS_HEADER.

The scheduler's refusals (``refusal``), as vLLM answers the same case where it has one:

  INVALID_ARGUMENT 400 · UNAUTHENTICATED 401 · PERMISSION_DENIED 403 (a tenant with max_adapters 0, ``public``
  from a non-admin) · NOT_FOUND 404 (no adapter at the path, as vLLM's "No adapter found"; unloading a name the
  caller does not own, as vLLM's "cannot be found") · ALREADY_EXISTS 400 (vLLM's "has already been loaded" is a
  400) · FAILED_PRECONDITION on load 400 (vLLM: an adapter it cannot load), on unload 409 (in use: the same call
  succeeds once those requests end; vLLM has no such case) · RESOURCE_EXHAUSTED 400 ``resource_exhausted`` (a
  tenant's adapters or pages at their limit: vLLM's 400 for a load that fails; a 429 would invite a retry that
  cannot succeed until the tenant unloads), 429 for a full queue as elsewhere · UNIMPLEMENTED 501 (a scheduler
  without run-time loading) · the rest as errors.GRPC_STATUS."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping

import grpc
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from pagedkv.api.v1 import api_pb2 as api
from pagedkv.bounds import InvalidRequest, check_load_adapter, check_loaded_name
from pagedkv.gateway import fields
from pagedkv.gateway.errors import ApiError, bad, from_grpc
from pagedkv.gateway.fields import HONOURED, IGNORED, REFUSED, Field, Screened, check_fields
from pagedkv.gateway.guards import read_bounded_json
from pagedkv.gateway.metrics import REQUESTS

MAX_BODY_BYTES = 64 << 10  # a 4096-character path, every character a JSON escape, and the rest
LOAD_TIMEOUT_S = 300.0  # (every executor reads the adapter from disk and checks it)
UNLOAD_TIMEOUT_S = 30.0
LOAD, UNLOAD = "load_lora_adapter", "unload_lora_adapter"  # (the endpoints' metric labels)

LOAD_FIELDS = {f.name: f for f in (
    Field("lora_name", fields.BOTH, HONOURED, "sql", note="LoadAdapterRequest.name"),
    Field("lora_path", fields.BOTH, HONOURED, "/adapters/sql", note="LoadAdapterRequest.path"),
    Field("public", fields.BOTH, HONOURED, True, note="LoadAdapterRequest.public (an admin tenant's)"),
    Field("load_inplace", fields.BOTH, REFUSED, True, (None, False),
          "an adapter is not replaced in place: unload it, then load"),
)}
UNLOAD_FIELDS = {f.name: f for f in (
    Field("lora_name", fields.BOTH, HONOURED, "sql", note="UnloadAdapterRequest.name"),
    Field("lora_int_id", fields.BOTH, IGNORED, 1, note="adapters are named; vLLM unloads by lora_name too"),
)}
# the scheduler's field names (its refusals start with them) -> this body's
_PARAMS = {"name": "lora_name", "adapter": "lora_name", "path": "lora_path", "public": "public"}
_HEAD = re.compile(rf"^({'|'.join(_PARAMS)}):")


def _object(body) -> Mapping:
    if not isinstance(body, Mapping):
        raise ApiError(400, "the request body must be a JSON object")
    return body


def _name(body: Mapping) -> str:
    name = body.get("lora_name")
    if not isinstance(name, str) or not name:
        raise bad("lora_name", "required: the adapter's name (a string; requests select it as their model)")
    return name


def _checked(check: Callable[[object], None], req: object) -> None:
    """pagedkv.bounds' refusal (it names the scheduler's field) as a 400 naming this body's."""
    try:
        check(req)
    except InvalidRequest as err:
        raise _renamed(400, str(err), code=None) from None


def load_request(body) -> tuple[api.LoadAdapterRequest, Screened]:
    """POST /v1/load_lora_adapter's body -> the LoadAdapter request (and the fields ignored or unknown)."""
    body = _object(body)
    screened = Screened([], [])
    check_fields(LOAD_FIELDS, body, "", screened)
    name, path, public = _name(body), body.get("lora_path"), body.get("public", False)
    if not isinstance(path, str) or not path:
        raise bad("lora_path", "required: the adapter's PEFT directory (a string), under the executors' --lora-root")
    if not isinstance(public, bool):
        raise bad("public", f"{str(public)[:32]!r} is not a boolean")
    req = api.LoadAdapterRequest(name=name, path=path, public=public)
    _checked(check_load_adapter, req)
    return req, screened


def unload_request(body) -> tuple[api.UnloadAdapterRequest, Screened]:
    """POST /v1/unload_lora_adapter's body -> the UnloadAdapter request (and the fields ignored or unknown)."""
    body = _object(body)
    screened = Screened([], [])
    check_fields(UNLOAD_FIELDS, body, "", screened)
    name = _name(body)
    _checked(check_loaded_name, name)
    return api.UnloadAdapterRequest(name=name), screened


def _renamed(status: int, details: str, code: str | None, param: str | None = None) -> ApiError:
    """An ApiError whose message and param name this body's fields (``lora_name:`` for the scheduler's
    ``name:``)."""
    m = _HEAD.match(details)
    if m:
        details = _PARAMS[m.group(1)] + details[m.end(1):]
    return ApiError(status, details, param=_PARAMS[m.group(1)] if m else param, code=code)


def refusal(code: grpc.StatusCode, details: str, unload: bool) -> ApiError:
    """The scheduler's refusal of a LoadAdapter (``unload`` False) or an UnloadAdapter, in HTTP terms (the module
    doc's table)."""
    details = details or code.name
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return _renamed(400, details, None)
    if code == grpc.StatusCode.NOT_FOUND:
        return _renamed(404, details, "not_found", param="lora_name" if unload else "lora_path")
    if code == grpc.StatusCode.ALREADY_EXISTS:
        return _renamed(400, details, "already_exists", param="lora_name")
    if code == grpc.StatusCode.FAILED_PRECONDITION:
        return _renamed(409 if unload else 400, details, "failed_precondition", param="lora_name" if unload else None)
    if code == grpc.StatusCode.UNIMPLEMENTED:
        return ApiError(501, f"this scheduler does not load LoRA adapters at run time ({details})",
                        code="not_implemented")
    return from_grpc(code, details)


class AdapterRoutes:
    """The two routes, beside the gateway's others (``gateway``: app.Gateway, whose metadata and log they share)."""

    def __init__(self, gateway) -> None:
        self.gateway = gateway

    def routes(self) -> list[Route]:
        return [Route("/v1/load_lora_adapter", self.load, methods=["POST"]),
                Route("/v1/unload_lora_adapter", self.unload, methods=["POST"])]

    async def load(self, request: Request) -> Response:
        return await self._answer(request, unload=False)

    async def unload(self, request: Request) -> Response:
        return await self._answer(request, unload=True)

    async def _answer(self, request: Request, unload: bool) -> Response:
        gw, endpoint = self.gateway, UNLOAD if unload else LOAD
        try:
            metadata = gw.metadata(request)
            body = await read_bounded_json(request, MAX_BODY_BYTES, _body_too_large)
            req, screened = unload_request(body) if unload else load_request(body)
            stub = gw.upstream.client.stub
            try:
                if unload:
                    await stub.UnloadAdapter(req, metadata=metadata, timeout=UNLOAD_TIMEOUT_S)
                else:
                    info = await stub.LoadAdapter(req, metadata=metadata, timeout=LOAD_TIMEOUT_S)
            except grpc.aio.AioRpcError as err:
                raise refusal(err.code(), err.details() or "", unload) from None
        except ApiError as err:
            REQUESTS.labels(endpoint, str(err.status)).inc()
            gw.log.info("request_refused", endpoint=endpoint, status=err.status, error=err.message)
            return JSONResponse(err.body(), status_code=err.status, headers=err.headers())
        REQUESTS.labels(endpoint, "200").inc()
        gw.log_fields(screened, endpoint=endpoint)
        if unload:
            gw.log.info("adapter_unloaded", name=req.name)
        else:
            gw.log.info("adapter_loaded", name=info.name, owner=info.owner or None, public=req.public,
                        rank=info.rank, pages=info.num_pages)
        headers = {fields.IGNORED_FIELDS_HEADER: fields.ignored_header(screened.unknown)} if screened.unknown else {}
        done = "removed" if unload else "added"
        return PlainTextResponse(f"Success: LoRA adapter '{req.name}' {done} successfully.", headers=headers)


def _body_too_large(size: str) -> ApiError:
    return ApiError(413, f"request body: {size} bytes; at most {MAX_BODY_BYTES} (an adapter's name and path)",
                    code="body_too_large")
