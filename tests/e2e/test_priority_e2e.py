"""Priority classes through a real ``pagedkv serve --scheduling-policy priority`` on tiny-llama (executor, scheduler
and the HTTP gateway on loopback): a flood of low-priority requests holds the seats, and a high-priority request
of the same tenant sent after it is answered first; a tenant asking for more priority than its max_priority gets
INVALID_ARGUMENT over gRPC and HTTP 400 through the gateway, naming priority, the value and the limit."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request

import grpc
import pytest

from pagedkv.cli import free_port
from pagedkv.client import Client
from pagedkv.tenancy import hash_key

pytestmark = pytest.mark.e2e

GOLD, PLAIN = "key-prio-gold", "key-prio-plain"
TENANTS = f"""
[tenants.gold]
keys = ["{hash_key(GOLD)}"]
max_priority = -10

[tenants.plain]
keys = ["{hash_key(PLAIN)}"]
"""
FLOOD = 8  # low-priority requests, two seats: six wait
FLOOD_TOKENS, URGENT_TOKENS = 96, 8


@pytest.fixture(scope="module")
def server(tmp_path_factory, model_cache):
    from tests.conftest import Server

    tenants = tmp_path_factory.mktemp("priority") / "tenants.toml"
    tenants.write_text(TENANTS)
    http_port = free_port()
    s = Server("--http-port", str(http_port), "--tenants-file", str(tenants), "--scheduling-policy", "priority",
               "--max-num-seqs", "2", "--num-pages", "128", "--threads", "1")
    s.http_port = http_port
    yield s
    assert s.stop() == 0, s.log()


def test_a_high_priority_request_sent_after_a_low_priority_flood_is_answered_first(server):
    async def scenario() -> list[str]:
        finished: list[str] = []
        async with Client(server.address, api_key=GOLD) as c:
            async def one(name: str, prompt: list[int], max_tokens: int, priority: int) -> None:
                out = await c.complete(prompt, max_tokens=max_tokens, ignore_eos=True, priority=priority)
                assert len(out.token_ids) == max_tokens
                finished.append(name)

            flood = [asyncio.create_task(one(f"low{i}", [7 + i] * 24, FLOOD_TOKENS, 5)) for i in range(FLOOD)]
            info = await c.model_info()
            deadline = time.monotonic() + 60
            while info.tenant.num_running < 2 or info.tenant.num_waiting < FLOOD - 2:  # seats full, the rest waits
                assert time.monotonic() < deadline, info
                await asyncio.sleep(0.05)
                info = await c.model_info()
            await one("high", [200] * 16, URGENT_TOKENS, -5)
            await asyncio.gather(*flood)
        return finished

    finished = asyncio.run(scenario())
    assert finished[0] == "high", f"finish order {finished}: the high-priority request was not answered first"


def test_a_tenant_asking_for_more_priority_than_its_max_priority_is_refused(server):
    async def grpc_refusal() -> grpc.aio.AioRpcError:
        async with Client(server.address, api_key=PLAIN, resume=None) as c:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await c.complete([5] * 8, max_tokens=2, priority=-1)
            assert (await c.complete([5] * 8, max_tokens=2, priority=0)).token_ids  # its own limit is allowed
        return err.value

    err = asyncio.run(grpc_refusal())
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details() == ("priority: -1; tenant plain may ask for 0 or more (its max_priority in the tenants file; "
                             "lower is more important)")

    def post(key: str, priority: int) -> tuple[int, dict]:
        body = json.dumps({"model": "tiny-llama", "prompt": "hi", "max_tokens": 2, "priority": priority}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{server.http_port}/v1/completions", body, method="POST",
                                     headers={"content-type": "application/json", "authorization": f"Bearer {key}"})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    code, out = post(PLAIN, -5)
    assert code == 400 and out["error"]["param"] == "priority", out
    assert out["error"]["message"].startswith("priority: -5; tenant plain may ask for 0 or more"), out
    code, out = post(GOLD, -10)
    assert code == 200, out  # gold's max_priority is -10
    code, out = post(GOLD, -11)
    assert code == 400 and "tenant gold may ask for -10 or more" in out["error"]["message"], out
    code, out = post(GOLD, 1001)
    assert code == 400 and out["error"]["message"] == "priority: 1001; must be in [-1000, 1000]", out
