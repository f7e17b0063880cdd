"""What the gateway answers for what it does not serve, in OpenAI's error shape: vLLM's pooling endpoints
(``/v1/embeddings`` and the rest: pagedkv serves generation models only, and says so rather than a bare 404), and a
path that is no endpoint at all (404 naming it and the endpoints that exist)."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from pagedkv.gateway.errors import ApiError

# vLLM's endpoints for pooling models (embedding, classification, scoring, reranking) -> what they serve
POOLING = {"/v1/embeddings": "embeddings", "/pooling": "pooling", "/classify": "classification",
           "/score": "scores", "/v1/score": "scores", "/rerank": "reranking", "/v1/rerank": "reranking",
           "/v2/rerank": "reranking"}


async def pooling(request: Request) -> JSONResponse:
    """400 for a pooling endpoint, as vLLM answers one for a generation model: the model generates text."""
    path = request.url.path
    err = ApiError(400, f"{path}: this server does not serve {POOLING.get(path, 'pooling')}; the served model is a "
                   "generation model (pagedkv serves no embedding or pooling models). Its endpoints: "
                   f"{_endpoints(request)}", param="model", code="model_not_supported")
    return JSONResponse(err.body(), status_code=err.status)


def pooling_routes() -> list[Route]:
    return [Route(path, pooling, methods=["POST"]) for path in POOLING]


def no_such_endpoint(request: Request) -> ApiError:
    """404 for a path no route has, naming it and the endpoints this gateway answers."""
    return ApiError(404, f"{request.method} {request.url.path}: no such endpoint; this server answers "
                    f"{_endpoints(request)}", code="not_found")


def _endpoints(request: Request) -> str:
    served = []
    for route in getattr(request.app, "routes", ()):
        if isinstance(route, Route) and route.endpoint is not pooling:
            methods = sorted((route.methods or set()) - {"HEAD"})
            served.append(f"{'|'.join(methods)} {route.path}")
    return ", ".join(served)
