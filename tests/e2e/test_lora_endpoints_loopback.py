"""The run-time LoRA endpoints (#52) over real gRPC on loopback: a stand-in scheduler (a Generation servicer with
per-key adapters) behind the gateway's own Upstream and pagedkv.client.Client, and ``pagedkv adapters`` against it.
The unit tier (tests/unit/test_gateway_lora_endpoints.py, test_adapters_command.py) fakes the stub; this checks the
generated stubs, the metadata and the status codes as grpc carries them."""

from __future__ import annotations

import asyncio

import grpc
import httpx
import pytest

from pagedkv.adapters_command import run as adapters
from pagedkv.api.v1 import api_pb2 as api
from pagedkv.api.v1 import api_pb2_grpc as api_grpc
from pagedkv.cli import build_parser
from pagedkv.gateway.app import Gateway, create_app
from pagedkv.gateway.upstream import Upstream
from tests.support.gateway_stub import Log

pytestmark = pytest.mark.e2e


class Scheduler(api_grpc.GenerationServicer):
    """Each key's tenant owns what it loads; a second load of a name is ALREADY_EXISTS, an unknown one NOT_FOUND."""

    def __init__(self) -> None:
        self.by_key: dict[str, dict[str, api.AdapterInfo]] = {}

    def _own(self, context) -> dict[str, api.AdapterInfo]:
        key = dict(context.invocation_metadata()).get("authorization", "")
        return self.by_key.setdefault(key, {})

    async def ModelInfo(self, request, context):  # noqa: N802
        return api.ModelInfoResponse(model="base", max_model_len=64, adapters=list(self._own(context).values()))

    async def LoadAdapter(self, request, context):  # noqa: N802
        own = self._own(context)
        if request.name in own:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"name: {request.name!r} is already loaded")
        own[request.name] = api.AdapterInfo(name=request.name, rank=8, num_pages=2, owner="t", resident=1)
        return own[request.name]

    async def UnloadAdapter(self, request, context):  # noqa: N802
        if self._own(context).pop(request.name, None) is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"adapter: {request.name!r} is not loaded")
        return api.UnloadAdapterResponse()


async def _scenario(capsys) -> None:
    server = grpc.aio.server()
    api_grpc.add_GenerationServicer_to_server(Scheduler(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    upstream = Upstream(f"127.0.0.1:{port}", resume=None)
    app = create_app(Gateway(upstream, Log()))
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as http:
            def post(path, body, key="alice"):
                return http.post(path, json=body, headers={"authorization": f"Bearer {key}"})

            r = await post("/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": "sql"})
            assert (r.status_code, r.text) == (200, "Success: LoRA adapter 'sql' added successfully.")
            r = await post("/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": "sql"})
            assert (r.status_code, r.json()["error"]["param"]) == (400, "lora_name"), r.text
            models = await http.get("/v1/models", headers={"authorization": "Bearer alice"})
            assert [(m["id"], m["parent"]) for m in models.json()["data"]] == [("base", None), ("sql", "base")]
            r = await post("/v1/unload_lora_adapter", {"lora_name": "sql"}, key="bob")
            assert r.status_code == 404 and r.json()["error"]["message"].startswith("lora_name: 'sql'"), r.text

            def args(*argv):
                return build_parser().parse_args(["adapters", *argv, "--address", f"127.0.0.1:{port}",
                                                  "--api-key", "alice"])
            assert await adapters(args("list")) == 0
            assert capsys.readouterr().out.startswith("name=sql rank=8 ")
            assert await adapters(args("unload", "sql")) == 0
            assert await adapters(args("unload", "sql")) == 1
            assert "error: NOT_FOUND: adapter: 'sql' is not loaded" in capsys.readouterr().err
            assert await adapters(args("load", "chat", "chat")) == 0
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as http:
            models = await http.get("/v1/models", headers={"authorization": "Bearer alice"})
            assert [m["id"] for m in models.json()["data"]] == ["base", "chat"]
    finally:
        await upstream.close()
        await server.stop(None)


def test_the_endpoints_and_the_cli_against_a_scheduler_on_loopback(capsys):
    asyncio.run(asyncio.wait_for(_scenario(capsys), 60))
