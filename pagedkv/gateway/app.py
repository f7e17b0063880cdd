"""The gateway's ASGI app: the routes (``create_app``) and what answers them (``Gateway``): a request checked and
translated (openai_requests.py, after fields.py's table), then answered by a ``Generation`` (streaming.py);
/v1/models, vLLM's /tokenize and /detokenize (tokenize.py) and run-time LoRA endpoints (adapter_routes.py), /version,
/health, /metrics. A known path asked with another method is a 405 in OpenAI's shape (invalid_request_error, with
Allow)."""

from __future__ import annotations

import contextlib
import time
import uuid

import grpc
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

import pagedkv
from pagedkv.gateway import fields, logprobs, response_budget
from pagedkv.gateway import openai_requests as requests
from pagedkv.gateway import tokenize as tokens
from pagedkv.gateway.adapter_routes import AdapterRoutes
from pagedkv.gateway.errors import RETRY_AFTER_S, ApiError, from_grpc
from pagedkv.gateway.guards import read_json
from pagedkv.gateway.metrics import LATENCY, REGISTRY, REQUESTS, STREAMS
from pagedkv.gateway.not_served import no_such_endpoint, pooling_routes
from pagedkv.gateway.openai_requests import Plan
from pagedkv.gateway.request_limits import RequestLimits, check_sizes
from pagedkv.gateway.streaming import Generation
from pagedkv.gateway.upstream import Upstream, auth_metadata, gie_metadata

DEFAULT_MAX_STREAMS = 1024


class Gateway:
    def __init__(self, upstream: Upstream, log, max_body_bytes: int = 0, max_streams: int = DEFAULT_MAX_STREAMS,
                 token_text=None, max_prompt_bytes: int = 0,
                 max_response_bytes: int = response_budget.DEFAULT_MAX_RESPONSE_BYTES,
                 gie_hop_secret: str = "") -> None:
        """``max_body_bytes``, ``max_prompt_bytes``: 0 for the scheduler's own limits (RequestLimits.of).
        ``token_text``: how logprobs name tokens (a logprobs.TokenNames loading --tokenizer, or a function of the
        token id; None: token_id:N). ``max_response_bytes``: the most an answer may take (response_budget.py).
        ``gie_hop_secret``: with --trust-gie-headers, the scheduler's trusted-hop secret: GIE's fairness id and
        objective are passed on as this gateway's assertion ('': they are dropped, never read)."""
        self.gie_hop_secret = gie_hop_secret
        self.upstream, self.log, self.token_text = upstream, log, token_text
        self.max_response_bytes = max_response_bytes
        self.max_body_bytes, self.max_prompt_bytes, self.max_streams = max_body_bytes, max_prompt_bytes, max_streams
        self.limits: RequestLimits | None = None  # once the scheduler's max_model_len is known
        self.active = 0  # streams (prompts x n) being answered

    def metadata(self, request: Request) -> tuple[tuple[str, str], ...]:
        """The scheduler call's metadata: the caller's key, and with --trust-gie-headers GIE's headers as a
        trusted hop's assertion (upstream.gie_metadata)."""
        own = auth_metadata(request)
        return (*own, *gie_metadata(request, self.gie_hop_secret)) if self.gie_hop_secret else own

    async def request_limits(self, metadata) -> RequestLimits:
        if self.limits is None:
            max_model_len = await self.upstream.learned_max_model_len(metadata)
            self.limits = RequestLimits.of(max_model_len, self.max_prompt_bytes, self.max_body_bytes,
                                           self.upstream.max_logprobs)
        return self.limits

    async def token_names(self):
        """The function that names tokens in logprobs (waits for --tokenizer to load; 503 if it could not)."""
        if not isinstance(self.token_text, logprobs.TokenNames):
            return self.token_text
        try:
            return await self.token_text.get()
        except ValueError as err:
            raise ApiError(503, f"this gateway cannot name tokens in logprobs: {err}") from None

    def token_sizes(self, plan: Plan) -> response_budget.TokenSizes:
        """The most bytes a token takes in this plan's answer: by the loaded --tokenizer's longest token (before it
        is loaded, and for a token_text function, response_budget.FALLBACK_TOKEN_BYTES)."""
        longest = self.token_text.longest if isinstance(self.token_text, logprobs.TokenNames) else None
        return response_budget.token_sizes(longest, by_id=plan.tokens_as_ids or self.token_text is None)

    def check_streams(self, plan: Plan) -> None:
        """--max-streams counts streams, each prompt's n forks: one request may be 32 prompts x n=16 = 512."""
        streams = plan.num_choices
        if streams > self.max_streams:
            raise ApiError(400, f"n: {len(plan.requests)} prompt(s) x n={plan.n} = {streams} streams; this gateway "
                           f"answers at most {self.max_streams} at once (--max-streams)", param="n")
        if self.active + streams > self.max_streams:
            raise ApiError(429, f"this gateway is answering {self.active} streams; {streams} more would pass its "
                           f"limit of {self.max_streams} (--max-streams); retry later", code="too_many_requests",
                           retry_after=RETRY_AFTER_S)

    def finished(self, gen: Generation) -> None:
        self.active -= gen.plan.num_choices
        STREAMS.dec(gen.plan.num_choices)
        status = 499 if gen.disconnected else gen.status_code
        elapsed = time.perf_counter() - gen.started
        REQUESTS.labels(gen.endpoint, str(status)).inc()
        LATENCY.labels(gen.endpoint).observe(elapsed)
        self.log.debug("request_finished", request_id=gen.rid, endpoint=gen.endpoint, status=status,
                       stream=gen.plan.stream, n=gen.plan.n, prompts=len(gen.plan.requests), user=gen.plan.user or None,
                       completion_tokens=sum(c.completion_tokens for c in gen.choices), seconds=round(elapsed, 4),
                       client_disconnected=gen.disconnected)

    def log_fields(self, screened: fields.Screened | None, **where: str) -> None:
        """Unknown fields: a warning (and IGNORED_FIELDS_HEADER in the answer); fields ignored by design: debug.
        ``where``: the request's id (request_id=), or the endpoint's name."""
        if screened and screened.unknown:
            self.log.warning("request_fields_ignored", **where, count=len(screened.unknown),
                             fields=[name[:64] for name in screened.unknown[:fields.MAX_HEADER_NAMES]],
                             note="fields were present in the request but ignored (not in the gateway's table)")
        if screened and screened.ignored:
            self.log.debug("request_fields_ignored_by_design", **where, fields=screened.ignored)

    async def generate(self, request: Request, chat: bool) -> Response:
        started = time.perf_counter()
        endpoint = "chat" if chat else "completions"
        header_id = request.headers.get("x-request-id")
        echo: dict[str, str] = {}
        try:
            metadata = self.metadata(request)
            limits = await self.request_limits(metadata)
            body = await read_json(request, limits, "messages" if chat else "prompt")
            client_id = requests.client_request_id(header_id, body)
            if header_id is not None and client_id != header_id:
                self.log.warning("x_request_id_not_used", length=len(header_id),
                                 note=f"not 1 to {requests.MAX_CLIENT_ID_CHARS} printable ASCII characters")
            rid = f"{'chatcmpl' if chat else 'cmpl'}-{client_id or uuid.uuid4().hex}"
            echo["x-request-id"] = client_id or rid
            upstream_id = client_id or rid  # (the scheduler's request_id: its logs and its Cancel know it by it)
            plan = requests.parse_chat(body, upstream_id) if chat else requests.parse_completion(body, upstream_id)
            plan.client_id = client_id
            self.log_fields(plan.screened, request_id=rid)
            check_sizes(plan, limits)
            logprobs.check_limits(plan, limits.max_logprobs)
            plan.token_text = await self.token_names() if plan.names_tokens else None
            model, adapter = await self.upstream.select_model(plan.model, metadata)
            for req in plan.requests:
                req.adapter = adapter
            bound = response_budget.check(plan, limits.max_model_len, self.max_response_bytes, self.token_sizes(plan),
                                          rid, model)  # (a 400: before check_streams' 429, which clears)
            self.check_streams(plan)
        except ApiError as err:
            REQUESTS.labels(endpoint, str(err.status)).inc()
            self.log.info("request_refused", endpoint=endpoint, status=err.status, error=err.message)
            return JSONResponse(err.body(), status_code=err.status, headers={**err.headers(), **echo})
        self.active += plan.num_choices
        STREAMS.inc(plan.num_choices)
        return Generation(self.upstream.client, self.finished, plan, rid, model, metadata, endpoint, started,
                          bound.total)

    async def completions(self, request: Request) -> Response:
        return await self.generate(request, chat=False)

    async def chat(self, request: Request) -> Response:
        return await self.generate(request, chat=True)

    async def tokenize(self, request: Request) -> Response:
        return await self._tokens(request, detokenize=False)

    async def detokenize(self, request: Request) -> Response:
        return await self._tokens(request, detokenize=True)

    async def _tokens(self, request: Request, detokenize: bool) -> Response:
        """vLLM's /tokenize and /detokenize (tokenize.py), answered by the scheduler's Tokenize and Detokenize with
        the caller's credentials."""
        endpoint = "detokenize" if detokenize else "tokenize"
        try:
            metadata = self.metadata(request)
            limits = await self.request_limits(metadata)
            body = await read_json(request, limits, "tokens" if detokenize else "prompt")
            if detokenize:
                model, req, strs = (*tokens.detokenize_request(body, limits), False)
            else:
                model, req, strs = tokens.tokenize_request(body, limits)
            if model is not None:
                await self.upstream.check_model(model, metadata)
            stub = self.upstream.client.stub
            try:
                r = await (stub.Detokenize if detokenize else stub.Tokenize)(req, metadata=metadata, timeout=60)
            except grpc.aio.AioRpcError as err:
                error = from_grpc(err.code(), err.details() or "", chat=not detokenize and req.HasField("chat"))
                if detokenize and error.param == "prompt":  # (the scheduler's token_ids)
                    error.param = "tokens"
                    error.message = error.message.replace("token_ids", "tokens", 1)
                raise error from None
        except ApiError as err:
            REQUESTS.labels(endpoint, str(err.status)).inc()
            return JSONResponse(err.body(), status_code=err.status, headers=err.headers())
        REQUESTS.labels(endpoint, "200").inc()
        unknown = tokens.unknown_fields(body, tokens.DETOKENIZE_FIELDS if detokenize else tokens.TOKENIZE_FIELDS)
        headers = {fields.IGNORED_FIELDS_HEADER: fields.ignored_header(unknown)} if unknown else {}
        out = {"prompt": r.text} if detokenize else tokens.tokenize_body(r, limits.max_model_len, strs)
        return JSONResponse(out, headers=headers)

    async def models(self, request: Request) -> Response:
        try:
            info = await self.upstream.model_info(self.metadata(request))
        except ApiError as err:
            return JSONResponse(err.body(), status_code=err.status, headers=err.headers())
        card = {"object": "model", "created": self.upstream.created, "owned_by": "pagedkv",
                "max_model_len": info.max_model_len}
        names = self.upstream.names
        data = [{"id": name, **card, "root": info.model, "parent": None} for name in names]
        # the LoRA adapters the caller may use (its tenant's), after the base model, as vLLM lists them
        data += [{"id": a.name, **card, "root": a.name, "parent": names[0]} for a in info.adapters]
        return JSONResponse({"object": "list", "data": data})

    async def health(self, request: Request) -> Response:
        ok, status = await self.upstream.serving()
        if ok:
            return JSONResponse({"status": "ok", "scheduler": status})
        return JSONResponse(ApiError(503, f"the scheduler is not serving ({status})").body(), status_code=503)



async def version(request: Request) -> Response:
    return JSONResponse({"version": pagedkv.__version__})


async def live(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


async def metrics(request: Request) -> Response:
    return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)


async def http_error(request: Request, exc: HTTPException) -> Response:
    status = exc.status_code
    if status == 404:
        return JSONResponse(no_such_endpoint(request).body(), status_code=404, headers=exc.headers)
    message = {405: f"{request.method} is not allowed on {request.url.path}"}.get(status, str(exc.detail))
    return JSONResponse(ApiError(status, message).body(), status_code=status, headers=exc.headers)


def create_app(gateway: Gateway, on_shutdown=(), extra_routes=()) -> Starlette:
    """``extra_routes``: more of the API (the Responses API's: responses_routes.py)."""
    routes = [*extra_routes,
        Route("/v1/completions", gateway.completions, methods=["POST"]),
        Route("/v1/chat/completions", gateway.chat, methods=["POST"]),
        Route("/v1/models", gateway.models, methods=["GET"]),
        Route("/tokenize", gateway.tokenize, methods=["POST"]),
        Route("/detokenize", gateway.detokenize, methods=["POST"]),
        *AdapterRoutes(gateway).routes(),  # vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter
        Route("/version", version, methods=["GET"]),
        Route("/health", gateway.health, methods=["GET"]),
        Route("/health/live", live, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        *pooling_routes(),  # (400: a generation model; not a bare 404)
    ]

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        yield
        for close in on_shutdown:
            await close()

    return Starlette(routes=routes, exception_handlers={HTTPException: http_error}, lifespan=lifespan)
