"""The gateway's edge mode (``pagedkv gateway --edge-upstream URL``): an authenticating proxy in front of a fleet
router's OpenAI frontend (NVIDIA Dynamo's, which authenticates nobody and takes any routing hint a client sends).

For ``POST /v1/completions``, ``POST /v1/chat/completions`` and ``GET /v1/models`` it

1. checks the API key against the tenants file (``--tenants-file``: the schedulers' own; 401 as they would);
2. drops what a client could steer the fleet with: every header but ``content-type``, ``accept`` and
   ``x-request-id`` (so ``x-dynamo-meta-*``, ``x-dynamo-request-priority``, GIE's and pagedkv's own, and the key
   itself), and the body's ``nvext.cache_salt``;
3. sets them from the tenant: ``nvext.cache_salt`` = ``fleet_salt.cache_salt(secret, tenant)`` (the router keys the
   tenant's blocks by it, as the schedulers salt their KV events) and ``x-dynamo-meta-pagedkv-tenant`` = a signed,
   short-lived tenant assertion (``fleet_salt.make_assertion``) the Dynamo sidecar checks before it names the tenant
   to its scheduler as a trusted hop;
4. relays the answer as it comes (SSE chunk by chunk, nothing held whole: edge_relay.py), the upstream's status
   and error body unchanged; an upstream that cannot be reached is 502, one that stops answering 504.

The request body is bounded (``--max-body-bytes``, default EDGE_MAX_BODY_BYTES), and so are the answer relayed
(``--max-response-bytes``: past it the relay ends; an SSE stream gets an error event first) and the answers relayed
at once (``--max-streams``: past it 429 with Retry-After).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import ssl
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from pagedkv import fleet_salt
from pagedkv.gateway import app as gateway_app
from pagedkv.gateway.edge_relay import Relay
from pagedkv.gateway.errors import RETRY_AFTER_S, ApiError
from pagedkv.gateway.guards import read_json
from pagedkv.gateway.metrics import EDGE_STRIPPED, LATENCY, REQUESTS
from pagedkv.gateway.upstream import auth_metadata
from pagedkv.tenancy import MAX_INT, InvalidTenant, Tenant, Tenants, Unauthenticated
from pagedkv.trusted_hop import ASSERTION_HEADERS, HOP_HEADER

EDGE_MAX_BODY_BYTES = 8 << 20
FORWARDED_HEADERS = ("content-type", "accept", "x-request-id")  # the only client headers the upstream sees
RELAYED_HEADERS = ("content-type", "cache-control", "x-request-id", "retry-after")  # the only upstream ones relayed
DYNAMO_META_PREFIX = "x-dynamo-meta-"
MAX_ERROR_BODY_BYTES = 64 << 10  # an upstream error's body relayed at most (an error is small)
MAX_REQUEST_ID_CHARS = 128
CONNECT_TIMEOUT_S = 10.0
READ_TIMEOUT_S = 300.0  # between two reads of an answer (a long prefill sends nothing for a while)
HEALTH_TIMEOUT_S = 2.0


@dataclass(frozen=True, slots=True)
class EdgeLimits:
    """read_json's bound on the body (the edge asks no scheduler for its request limit)."""

    body_bytes: int

    def describe(self) -> str:
        return "in edge mode, no scheduler is asked: 8 MiB"


def upstream_base(url: str) -> str:
    """``--edge-upstream``'s base URL (no trailing slash); ValueError naming the flag when it is no http(s) URL."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.query or parts.fragment:
        raise ValueError(f"--edge-upstream {url!r}: give the fleet frontend's base URL, http://HOST:PORT or "
                         "https://HOST:PORT (e.g. Dynamo's frontend: http://127.0.0.1:8080)")
    return url.rstrip("/")


def load_tenants(path: str) -> Tenants:
    """The tenants file, for its keys (page settings are the schedulers' business: counts checked against no pool)."""
    try:
        return Tenants.load(path, MAX_INT)
    except InvalidTenant as err:
        raise ValueError(str(err)) from err


class Edge:
    def __init__(self, upstream: str, tenants_file: str, secret: bytes, log, tls_ca: str = "",
                 max_body_bytes: int = 0, max_response_bytes: int = 0,
                 assertion_ttl: float = fleet_salt.DEFAULT_ASSERTION_TTL_S, max_streams: int = 1024) -> None:
        if not tenants_file:
            raise ValueError("--edge-upstream needs --tenants-file: the edge checks every API key itself (the "
                             "fleet frontend behind it checks none)")
        if not secret:
            raise ValueError(f"--edge-upstream needs {fleet_salt.FLEET_SECRET_FLAG} (or "
                             f"${fleet_salt.FLEET_SECRET_ENV}): the secret the tenants' cache salts and assertions "
                             "are derived from (the schedulers' and the sidecars' too)")
        if assertion_ttl <= 0:
            raise ValueError(f"--tenant-assertion-ttl {assertion_ttl}: must be > 0")
        self.base, self.tenants_file, self.secret, self.log = upstream_base(upstream), tenants_file, secret, log
        self.tenants = load_tenants(tenants_file)
        self.limits = EdgeLimits(max_body_bytes or EDGE_MAX_BODY_BYTES)
        self.max_response_bytes = max_response_bytes or (1 << 62)
        self.assertion_ttl = assertion_ttl
        self.max_streams, self.active = max_streams, 0  # answers being relayed (--max-streams bounds them)
        verify: ssl.SSLContext | bool = ssl.create_default_context(cafile=tls_ca) if tls_ca else True
        timeout = httpx.Timeout(READ_TIMEOUT_S, connect=CONNECT_TIMEOUT_S)
        # NOTE: no proxies from the environment (trust_env=False): the tenant's assertion goes to --edge-upstream only.
        self.client = httpx.AsyncClient(timeout=timeout, verify=verify, trust_env=False, follow_redirects=False,
                                        limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))

    async def close(self) -> None:
        await self.client.aclose()

    def reload(self) -> None:
        """SIGHUP: the tenants file read again (a revoked key refused from the next request on); a file that does
        not load leaves the previous one in force."""
        try:
            self.tenants = load_tenants(self.tenants_file)
        except ValueError as err:
            self.log.error("tenants_reload_failed", error=str(err), hint="the previous tenants stay in force")
            return
        self.log.info("tenants_reloaded", path=self.tenants_file, tenants=len(list(self.tenants)))

    def tenant(self, request: Request) -> Tenant:
        try:
            return self.tenants.authenticate(auth_metadata(request))
        except Unauthenticated as err:
            raise ApiError(401, str(err), code="invalid_api_key") from None

    def headers(self, request: Request, tenant: Tenant) -> dict[str, str]:
        """What the upstream is sent: the few client headers it needs and the tenant's assertion; the rest
        (x-dynamo-meta-*, GIE's, pagedkv's, the key) dropped and counted."""
        names = {name for name, _ in request.headers.items()}
        for name in names:
            kind = ("dynamo_meta" if name.startswith(DYNAMO_META_PREFIX) else
                    "trusted_hop" if name in ASSERTION_HEADERS or name == HOP_HEADER else "")
            if kind:
                EDGE_STRIPPED.labels(kind).inc()
        out = {"content-type": "application/json", "accept": request.headers.get("accept", "*/*")}
        rid = request.headers.get("x-request-id")
        if rid and len(rid) <= MAX_REQUEST_ID_CHARS and all(0x21 <= ord(c) <= 0x7E for c in rid):
            out["x-request-id"] = rid
        out[fleet_salt.TENANT_META_HEADER] = fleet_salt.make_assertion(self.secret, tenant.id, self.assertion_ttl)
        return out

    def body(self, body, tenant: Tenant) -> bytes:
        """The body with ``nvext.cache_salt`` the tenant's (none for the default tenant), whatever the client sent."""
        if not isinstance(body, dict):
            raise ApiError(400, "request body: must be a JSON object")
        nvext = body.get("nvext")
        if nvext is not None and not isinstance(nvext, dict):
            raise ApiError(400, "nvext: must be an object", param="nvext")
        nvext = dict(nvext or {})
        if nvext.pop("cache_salt", None) is not None:
            EDGE_STRIPPED.labels("cache_salt").inc()
        salt = fleet_salt.cache_salt(self.secret, tenant.id)
        if salt:
            nvext["cache_salt"] = salt
        if nvext or "nvext" in body:
            body["nvext"] = nvext
        return json.dumps(body, separators=(",", ":")).encode()

    async def completions(self, request: Request) -> Response:
        return await self.relay(request, "completions", "/v1/completions", "prompt")

    async def chat(self, request: Request) -> Response:
        return await self.relay(request, "chat", "/v1/chat/completions", "messages")

    async def models(self, request: Request) -> Response:
        return await self.relay(request, "models", "/v1/models", "")

    def check_streams(self) -> None:
        if self.active >= self.max_streams:
            raise ApiError(429, f"this gateway is relaying {self.active} answers, its limit (--max-streams); retry "
                           "later", code="too_many_requests", retry_after=RETRY_AFTER_S)

    async def relay(self, request: Request, endpoint: str, path: str, param: str) -> Response:
        started = time.perf_counter()
        try:
            tenant = self.tenant(request)
            content = self.body(await read_json(request, self.limits, param), tenant) if param else None
            headers = self.headers(request, tenant)
            self.check_streams()
            upstream = self.client.build_request("POST" if param else "GET", self.base + path, headers=headers,
                                                 content=content)
            self.active += 1  # (until finished)
            try:
                answer = await self._send(upstream)
            except BaseException:
                self.active -= 1
                raise
        except ApiError as err:
            REQUESTS.labels(endpoint, str(err.status)).inc()
            self.log.info("request_refused", endpoint=endpoint, status=err.status, error=err.message)
            return JSONResponse(err.body(), status_code=err.status, headers=err.headers())
        relayed = [(k, v) for k, v in answer.headers.items() if k in RELAYED_HEADERS]
        if answer.status_code >= 400:  # an error: small, read whole (bounded) and passed on as it is
            body = await self._read_bounded(answer, MAX_ERROR_BODY_BYTES)
            self.finished(endpoint, answer.status_code, started, tenant)
            return Response(body, status_code=answer.status_code, headers=dict(relayed))
        declared = answer.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_response_bytes:
            await answer.aclose()
            err = ApiError(502, f"the upstream's answer is {declared} bytes; this gateway relays at most "
                           f"{self.max_response_bytes} (--max-response-bytes)")
            self.finished(endpoint, 502, started, tenant)
            return JSONResponse(err.body(), status_code=502)
        return Relay(self, answer, relayed, endpoint, started, tenant)

    async def _send(self, upstream: httpx.Request) -> httpx.Response:
        try:
            return await self.client.send(upstream, stream=True)
        except httpx.TimeoutException as err:
            raise ApiError(504, f"the upstream ({self.base}) did not answer in time: {type(err).__name__}") from None
        except httpx.HTTPError as err:
            raise ApiError(502, f"the upstream ({self.base}) cannot be reached: {type(err).__name__}: {err}") from None

    async def _read_bounded(self, answer: httpx.Response, limit: int) -> bytes:
        body = bytearray()
        try:
            async for chunk in answer.aiter_raw():
                body += chunk[:limit - len(body)]
                if len(body) >= limit:
                    break
        except httpx.HTTPError:
            pass  # (what came is relayed)
        finally:
            await answer.aclose()
        return bytes(body)

    def finished(self, endpoint: str, status: int, started: float, tenant: Tenant) -> None:
        self.active -= 1
        elapsed = time.perf_counter() - started
        REQUESTS.labels(endpoint, str(status)).inc()
        LATENCY.labels(endpoint).observe(elapsed)
        self.log.debug("request_finished", endpoint=endpoint, status=status, tenant=tenant.id,
                       seconds=round(elapsed, 4))

    async def health(self, request: Request) -> Response:
        """200 while the upstream's /health answers 200, else 503 (a fleet frontend that is down or draining)."""
        try:
            r = await self.client.get(self.base + "/health", timeout=HEALTH_TIMEOUT_S)
            status = f"{r.status_code}"
            ok = r.status_code == 200
        except httpx.HTTPError as err:
            ok, status = False, type(err).__name__
        if ok:
            return JSONResponse({"status": "ok", "upstream": status})
        return JSONResponse(ApiError(503, f"the edge upstream ({self.base}/health) is not serving ({status})").body(),
                            status_code=503)


def create_edge_app(edge: Edge, on_shutdown=()) -> Starlette:
    """The edge's routes; /version, /health/live and /metrics are the gateway's own."""
    routes = [
        Route("/v1/completions", edge.completions, methods=["POST"]),
        Route("/v1/chat/completions", edge.chat, methods=["POST"]),
        Route("/v1/models", edge.models, methods=["GET"]),
        Route("/health", edge.health, methods=["GET"]),
        Route("/health/live", gateway_app.live, methods=["GET"]),
        Route("/version", gateway_app.version, methods=["GET"]),
        Route("/metrics", gateway_app.metrics, methods=["GET"]),
    ]

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, edge.reload)
        yield
        await edge.close()
        for close in on_shutdown:
            await close()

    return Starlette(routes=routes, exception_handlers={HTTPException: gateway_app.http_error}, lifespan=lifespan)
