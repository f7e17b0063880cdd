"""The scheduler side of the gateway: the gRPC channel to the scheduler(s) (``Upstream``: what it learns from them,
the model's names (the first is the one answers report) and max_model_len, the LoRA adapters a caller may use
(asked with the caller's credentials: each tenant sees its own), and the health it reports), and the caller's
credentials passed on as gRPC metadata (``auth_metadata``)."""

from __future__ import annotations

import time
from dataclasses import replace

import grpc
from starlette.requests import Request

from pagedkv.api.v1 import api_pb2 as api
from pagedkv.gateway.errors import ApiError, from_grpc
from pagedkv.resume_policy import DEFAULT_RESUME, ResumePolicy
from pagedkv.trusted_hop import FAIRNESS_ID_HEADER, HOP_HEADER, OBJECTIVE_HEADER

MAX_AUTH_HEADER_CHARS = 4096
MAX_GIE_HEADER_CHARS = 256
# set by GIE's endpoint picker (through Envoy); passed on only with --trust-gie-headers
GIE_HEADERS = (FAIRNESS_ID_HEADER, OBJECTIVE_HEADER)
CREDENTIAL_HEADERS = ("authorization", "api-key", "x-api-key")  # where clients send keys; only the first is read

# The upstream streams resume as pagedkv.client's do, except that a full queue before anything was sent is passed on
# (429 with Retry-After: the HTTP client decides when to come back) instead of waited out here.
GATEWAY_RESUME = replace(DEFAULT_RESUME, queue_full_at_start=False)


class Upstream:
    """The gRPC channel to the scheduler(s) and what the gateway learns from them (the model's name, its
    max_model_len, its max_logprobs)."""

    def __init__(self, address: str, tls_ca: str = "", tls_server_name: str = "",
                 served_names: tuple[str, ...] = (), resume: ResumePolicy | None = GATEWAY_RESUME) -> None:
        from pagedkv.client import Client

        # NOTE: the client resumes a Generate stream whose scheduler went away (pagedkv.client), so an HTTP client
        # sees one stream across a scheduler's death or restart.
        self.client = Client(address, tls_ca=tls_ca, tls_server_name=tls_server_name, resume=resume)
        self.names: tuple[str, ...] = served_names  # empty: learned from ModelInfo on first use
        self.max_model_len = 0  # learned from ModelInfo on first use
        self.max_logprobs = 0  # (with it: top and prompt log-probabilities at most; 0: not known)
        self.created = int(time.time())

    async def close(self) -> None:
        await self.client.close()

    async def model_info(self, metadata) -> api.ModelInfoResponse:
        try:
            info = await self.client.stub.ModelInfo(api.ModelInfoRequest(), metadata=metadata, timeout=10)
        except grpc.aio.AioRpcError as err:
            raise from_grpc(err.code(), err.details() or "") from None
        if not self.names:  # (the scheduler's --served-model-name, in order; an older one: its model)
            self.names = tuple(info.served_model_names) or (info.model,)
        self.max_model_len, self.max_logprobs = info.max_model_len, info.max_logprobs
        return info

    async def learned_max_model_len(self, metadata) -> int:
        """The scheduler's max_model_len, asked once (with the caller's credentials: ModelInfo authenticates)."""
        if not self.max_model_len:
            await self.model_info(metadata)
        return self.max_model_len

    async def check_model(self, name: str, metadata) -> str:
        """The name answers report for a request naming ``name`` (``select_model``'s)."""
        return (await self.select_model(name, metadata))[0]

    async def select_model(self, name: str, metadata) -> tuple[str, str]:
        """(the name answers report, the LoRA adapter it selects) for a request naming ``name``: one of the model's
        names (any may be asked for; answers report the first, as vLLM's) selects the base model (adapter ''); the
        name of an adapter the caller may use (its ModelInfo, with its credentials) selects that adapter, and
        answers report it, as vLLM's. Anything else: 404 model_not_found (an adapter the caller's tenant may not
        use, as one not served)."""
        if not self.names:
            await self.model_info(metadata)
        if name in self.names:
            return self.names[0], ""
        if any(a.name == name for a in (await self.model_info(metadata)).adapters):
            return name, name
        shown = name if len(name) <= 64 else name[:61] + "..."
        raise ApiError(404, f"model: {shown!r} is not served here; GET /v1/models lists {', '.join(self.names)} and "
                       "the adapters you may use", param="model", code="model_not_found")

    async def serving(self) -> tuple[bool, str]:
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        try:
            r = await health_pb2_grpc.HealthStub(self.client.channel).Check(health_pb2.HealthCheckRequest(),
                                                                            timeout=2.0)
        except grpc.aio.AioRpcError as err:
            return False, f"{err.code().name}: {err.details()}"
        return r.status == health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.ServingStatus.Name(
            r.status)


def auth_metadata(request: Request) -> tuple[tuple[str, str], ...]:
    """The caller's Authorization header, passed to the scheduler as it came (it must be valid metadata). More
    than one credential (two Authorization headers, or one and an api-key header) is refused: which one would
    count is exactly what a client and a proxy in front of us could disagree on."""
    sent = [name for name, _ in request.headers.items() if name in CREDENTIAL_HEADERS]
    if len(sent) > 1:
        raise ApiError(401, f"Authorization: {len(sent)} credentials ({', '.join(sent)} headers); send exactly "
                       "one, as 'Authorization: Bearer <key>'", code="invalid_api_key")
    value = request.headers.get("authorization")
    if value is None:
        return ()
    if len(value) > MAX_AUTH_HEADER_CHARS or not all(0x20 <= ord(c) <= 0x7E for c in value):
        raise ApiError(401, f"Authorization: must be 'Bearer <key>' in printable ASCII, at most "
                       f"{MAX_AUTH_HEADER_CHARS} characters", code="invalid_api_key")
    return (("authorization", value),)


def gie_metadata(request: Request, hop_secret: str) -> tuple[tuple[str, str], ...]:
    """GIE's fairness id (the tenant) and objective (a priority class), passed to the scheduler as this gateway's
    trusted-hop assertion (``x-pagedkv-hop`` with ``hop_secret``); nothing when the request has neither. Only a
    gateway whose clients are the inference gateway (--trust-gie-headers) calls this: otherwise the headers are
    never read. Each header once, printable ASCII, at most MAX_GIE_HEADER_CHARS: else 400 naming it."""
    out = []
    for name in GIE_HEADERS:
        values = request.headers.getlist(name)
        if not values:
            continue
        if len(values) > 1:
            raise ApiError(400, f"{name}: sent {len(values)} times; send it once", param=name)
        value = values[0]
        if not value or len(value) > MAX_GIE_HEADER_CHARS or not all(0x21 <= ord(c) <= 0x7E for c in value):
            raise ApiError(400, f"{name}: must be 1 to {MAX_GIE_HEADER_CHARS} printable ASCII characters without "
                           "spaces", param=name)
        out.append((name, value))
    return ((HOP_HEADER, hop_secret), *out) if out else ()
