"""The Responses API's routes (``Responses``): ``POST /v1/responses`` (a request checked and translated by
responses_api.py onto the chat path, answered by responses_stream.py), ``GET`` and ``DELETE /v1/responses/{id}``
(the stored response of the caller's tenant: another tenant's id is 404).

The caller's tenant is the scheduler's word (ModelInfo with the caller's credentials: the key authenticates there,
as for every request). A stored response's turn keeps its KV on the scheduler (GenerateRequest.retain_kv, keyed by
the response id, for --responses-kv-ttl seconds), so that a follow-up naming it by previous_response_id, whose
prompt starts with exactly that turn's tokens, reuses the pages instead of recomputing them; DELETE releases them
(ReleaseKv; a scheduler without retention answers UNIMPLEMENTED, and a retention that ended NOT_FOUND: both fine)."""

from __future__ import annotations

import functools
import time

import grpc
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from pagedkv.api.v1 import api_pb2 as api
from pagedkv.gateway import openai_requests as requests
from pagedkv.gateway import response_budget
from pagedkv.gateway.errors import ApiError
from pagedkv.gateway.guards import read_json
from pagedkv.gateway.metrics import REQUESTS, STREAMS
from pagedkv.gateway.request_limits import check_sizes
from pagedkv.gateway.responses_api import (
    RESPONSE_ID,
    ResponsesRequest,
    conversation_items,
    new_id,
    parse,
    previous_id,
    renamed,
)
from pagedkv.gateway.responses_store import ResponsesStore
from pagedkv.gateway.responses_stream import ResponsesGeneration

ENDPOINT = "responses"
RELEASE_TIMEOUT_S = 5.0
_RELEASE_GONE = (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.NOT_FOUND)  # no retention to end: fine


def not_found(rid: str, param: str | None = None) -> ApiError:
    shown = rid if len(rid) <= 64 else rid[:61] + "..."
    where = f"{param}: " if param else ""
    return ApiError(404, f"{where}no stored response {shown!r} for this key's tenant (never stored, deleted, or "
                    "evicted by --responses-max-count / --responses-max-bytes)", param=param,
                    code="previous_response_not_found" if param else "not_found")


class Responses:
    """POST, GET and DELETE on /v1/responses, beside the gateway's other routes (``gateway``: app.Gateway, whose
    limits, stream count, metadata and logs they share)."""

    def __init__(self, gateway, store: ResponsesStore, kv_ttl_s: int) -> None:
        self.gateway, self.store, self.kv_ttl_s = gateway, store, kv_ttl_s

    def routes(self) -> list[Route]:
        return [Route("/v1/responses", self.create, methods=["POST"]),
                Route("/v1/responses/{response_id}", self.retrieve, methods=["GET"]),
                Route("/v1/responses/{response_id}", self.delete, methods=["DELETE"])]

    async def tenant(self, metadata) -> str:
        """The caller's tenant, as the scheduler authenticates its key (401 for a bad one)."""
        info = await self.gateway.upstream.model_info(metadata)
        return info.tenant.id or "default"

    def _refused(self, err: ApiError, headers: dict[str, str] | None = None) -> Response:
        REQUESTS.labels(ENDPOINT, str(err.status)).inc()
        self.gateway.log.info("request_refused", endpoint=ENDPOINT, status=err.status, error=err.message)
        return JSONResponse(err.body(), status_code=err.status, headers={**err.headers(), **(headers or {})})

    async def create(self, request: Request) -> Response:
        gw, started = self.gateway, time.perf_counter()
        header_id = request.headers.get("x-request-id")
        echo: dict[str, str] = {}
        try:
            metadata = gw.metadata(request)
            limits = await gw.request_limits(metadata)
            body = await read_json(request, limits, "input")
            client_id = requests.client_request_id(header_id, body)
            rid = new_id("resp")
            echo["x-request-id"] = client_id or rid
            asked_previous = previous_id(body)
            wants_store = not isinstance(body, dict) or body.get("store") is not False
            tenant = await self.tenant(metadata) if asked_previous or wants_store else ""
            previous = None
            if asked_previous is not None:
                stored = self.store.get(tenant, asked_previous)
                if stored is None:
                    raise not_found(asked_previous, "previous_response_id")
                previous = stored.items
            req = parse(body, client_id or rid, previous)
            plan = req.plan
            plan.client_id = client_id
            gw.log_fields(plan.screened, request_id=rid)
            check_sizes(plan, limits)
            model, adapter = await gw.upstream.select_model(plan.model, metadata)
            for one in plan.requests:
                one.adapter = adapter
            bound = response_budget.check(plan, limits.max_model_len, gw.max_response_bytes, gw.token_sizes(plan),
                                          rid, model)
            gw.check_streams(plan)
        except ApiError as err:
            return self._refused(renamed(err), echo)
        if req.store and self.kv_ttl_s:
            plan.requests[0].retain_kv.CopyFrom(api.RetainKv(key=rid, ttl_s=self.kv_ttl_s))
        gw.active += plan.num_choices
        STREAMS.inc(plan.num_choices)
        keep = functools.partial(self._keep, tenant, req) if req.store else None
        return ResponsesGeneration(gw.upstream.client, gw.finished, req, rid, model, metadata, started, bound.total,
                                   keep)

    def _keep(self, tenant: str, req: ResponsesRequest, response: dict) -> bool:
        return self.store.put(tenant, response, [*req.items, *conversation_items(response["output"])])

    async def _stored(self, request: Request) -> tuple[str, tuple, str]:
        """(the response id asked, the caller's metadata, its tenant), or 404 for an id that cannot be one."""
        rid = request.path_params["response_id"]
        metadata = self.gateway.metadata(request)
        tenant = await self.tenant(metadata)
        if not RESPONSE_ID.fullmatch(rid):
            raise not_found(rid)
        return rid, metadata, tenant

    async def retrieve(self, request: Request) -> Response:
        try:
            if request.query_params.get("stream", "false").lower() not in ("false", "0"):
                raise ApiError(400, "stream: a stored response is answered whole here (its events are not replayed);"
                               " leave stream out", param="stream")
            rid, _, tenant = await self._stored(request)
            stored = self.store.get(tenant, rid)
            if stored is None:
                raise not_found(rid)
        except ApiError as err:
            return self._refused(err)
        REQUESTS.labels(ENDPOINT, "200").inc()
        return JSONResponse(stored.response)

    async def delete(self, request: Request) -> Response:
        try:
            rid, metadata, tenant = await self._stored(request)
            if not self.store.delete(tenant, rid):
                raise not_found(rid)
        except ApiError as err:
            return self._refused(err)
        released = await self._release(rid, metadata) if self.kv_ttl_s else 0
        self.gateway.log.info("response_deleted", response_id=rid, kv_pages_released=released)
        REQUESTS.labels(ENDPOINT, "200").inc()
        return JSONResponse({"id": rid, "object": "response.deleted", "deleted": True})

    async def _release(self, rid: str, metadata) -> int:
        """Ends the retention of the response's KV on the scheduler (pages released; 0 when there was none)."""
        try:
            r = await self.gateway.upstream.client.stub.ReleaseKv(api.ReleaseKvRequest(key=rid), metadata=metadata,
                                                                  timeout=RELEASE_TIMEOUT_S)
        except grpc.aio.AioRpcError as err:
            if err.code() not in _RELEASE_GONE:
                self.gateway.log.warning("kv_release_failed", response_id=rid, code=err.code().name,
                                         error=err.details(), note="its pages are released when its TTL ends")
            return 0
        return r.pages_released
