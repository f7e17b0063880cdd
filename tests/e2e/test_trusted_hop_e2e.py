"""A tenant asserted by a trusted hop, through real processes on loopback: an executor, a scheduler with a tenants
file and --trusted-hop-secret-file, and a gateway with --trust-gie-headers. From a caller without the hop's secret
the assertion headers are refused naming the header, on every API RPC; from the hop the named tenant's prefix-cache
namespace applies (its own cached pages hit, another tenant's do not), through gRPC and through GIE's headers at the
gateway. Last (it stops the scheduler): the GIE gauges read the pages a running request holds, and the gateway's
/health turns 503 while its scheduler drains."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import urllib.error
import urllib.request

import grpc
import pytest

from pagedkv.api.v1 import api_pb2 as api
from pagedkv.cli import free_port
from pagedkv.client import Client
from pagedkv.tenancy import hash_key
from pagedkv.trusted_hop import FAIRNESS_ID_HEADER, HOP_HEADER, OBJECTIVE_HEADER, TENANT_HEADER, hop_metadata
from tests.support import procs

pytestmark = pytest.mark.e2e

HOP_SECRET = "trusted-hop-secret-for-tests-0123"
KEY_A, KEY_B = "key-hop-alpha", "key-hop-beta"
TENANTS = f"""
[tenants.alpha]
keys = ["{hash_key(KEY_A)}"]

[tenants.beta]
keys = ["{hash_key(KEY_B)}"]
max_priority = -10
"""
PROMPT = list(range(5, 69))  # 64 token ids: 4 pages of 16, 3 of them servable from the cache on a repeat
NUM_PAGES = 256


class Stack:
    def __init__(self, tmp) -> None:
        self.tenants_path = tmp / "tenants.toml"
        self.tenants_path.write_text(TENANTS)
        (tmp / "hop.secret").write_text(HOP_SECRET)
        self.procs: list[procs.Proc] = []
        self.executor = self._start(lambda: procs.executor("--num-pages", str(NUM_PAGES)))
        self.metrics_port = free_port()
        self.scheduler = self._start(lambda: procs.scheduler(self.executor.address, args=(
            "--tenants-file", str(tmp / "tenants.toml"), "--trusted-hop-secret-file", str(tmp / "hop.secret"),
            "--objective", "interactive=-10", "--objective", "batch=10", "--shutdown-timeout", "120",
            "--metrics-port", str(self.metrics_port))))
        self.gateway = self._start(lambda: procs.Proc(
            "gateway", "--address", self.scheduler.address, "--served-model-name", "tiny", "--trust-gie-headers",
            "--trusted-hop-secret-file", str(tmp / "hop.secret")))
        self.base = f"http://127.0.0.1:{self.gateway.port}"

    def _start(self, start):
        try:
            p = start()
        except Exception:
            self.stop()
            raise
        self.procs.append(p)
        return p

    def stop(self) -> list[int | None]:
        return [p.stop(60) for p in reversed(self.procs)]

    def post(self, path: str, body: dict, headers: dict[str, str]) -> tuple[int, dict]:
        req = urllib.request.Request(self.base + path, json.dumps(body).encode(),
                                     {"content-type": "application/json", **headers})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read())

    def get(self, url: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(url, timeout=30) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as err:
            return err.code, err.read().decode()


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = Stack(tmp_path_factory.mktemp("hop"))
    yield s
    s.stop()


def run(coro):
    return asyncio.run(coro)


async def _calls(address: str, metadata) -> list[grpc.aio.AioRpcError]:
    """Each API RPC once with ``metadata``: the errors they ended with."""
    errors = []
    async with Client(address, metadata=metadata, resume=None) as c:
        for call in (lambda: c.complete(PROMPT, max_tokens=1), c.model_info, lambda: c.stub.Tokenize(
                api.TokenizeRequest(text="hi"), metadata=c.metadata), lambda: c.stub.Detokenize(
                api.DetokenizeRequest(token_ids=[5]), metadata=c.metadata)):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call()
            errors.append(err.value)
    return errors


def test_an_untrusted_caller_naming_a_tenant_is_refused(stack):
    address = stack.scheduler.address
    for header, value in ((TENANT_HEADER, "beta"), (FAIRNESS_ID_HEADER, "beta"), (OBJECTIVE_HEADER, "interactive")):
        for err in run(_calls(address, (("authorization", f"Bearer {KEY_A}"), (header, value)))):
            assert err.code() == grpc.StatusCode.PERMISSION_DENIED, err
            assert err.details().startswith(f"{header}: only a trusted hop may send it"), err.details()
    for err in run(_calls(address, hop_metadata(HOP_SECRET + "-guessed", "beta"))):
        assert err.code() == grpc.StatusCode.PERMISSION_DENIED and err.details().startswith(f"{HOP_HEADER}: not this")
    for err in run(_calls(address, hop_metadata(HOP_SECRET, "gamma"))):
        assert err.code() == grpc.StatusCode.PERMISSION_DENIED and "tenant 'gamma' is not in the tenants file" in \
            err.details()

    async def direct_client() -> str:  # the key path is unchanged
        async with Client(address, api_key=KEY_B) as c:
            return (await c.model_info()).tenant.id
    assert run(direct_client()) == "beta"


def test_a_trusted_hop_speaks_for_the_tenant_it_names(stack):
    address = stack.scheduler.address

    async def scenario() -> tuple[str, int, int, int]:
        async with Client(address, api_key=KEY_A) as own:
            first = await own.complete(PROMPT, max_tokens=1)  # alpha's pages, cached under alpha's root
        async with Client(address, metadata=hop_metadata(HOP_SECRET, "alpha")) as as_alpha:
            again = await as_alpha.complete(PROMPT, max_tokens=1)
        async with Client(address, metadata=hop_metadata(HOP_SECRET, "beta", "batch")) as as_beta:
            info = await as_beta.model_info()
            other = await as_beta.complete(PROMPT, max_tokens=1)
        return info.tenant.id, first.cached_tokens, again.cached_tokens, other.cached_tokens
    tenant, first, again, other = run(scenario())
    assert tenant == "beta"
    assert first == 0 and again == 48, "the hop's alpha request did not hit alpha's cached pages"
    assert other == 0, "the hop's beta request hit alpha's pages"
    code, _ = run(_calls_ok(address, hop_metadata(HOP_SECRET, "beta", "gold")))
    assert code == grpc.StatusCode.INVALID_ARGUMENT


async def _calls_ok(address: str, metadata) -> tuple[grpc.StatusCode | None, str]:
    async with Client(address, metadata=metadata, resume=None) as c:
        try:
            await c.complete(PROMPT, max_tokens=1)
        except grpc.aio.AioRpcError as err:
            return err.code(), err.details()
    return None, ""


def test_the_gateway_passes_gie_headers_as_a_trusted_hop(stack):
    body = {"model": "tiny", "prompt": [*PROMPT[:8], *range(200, 256)], "max_tokens": 1}
    code, first = stack.post("/v1/completions", body, {"authorization": f"Bearer {KEY_B}"})
    assert code == 200, first
    code, hit = stack.post("/v1/completions", body, {FAIRNESS_ID_HEADER: "beta", OBJECTIVE_HEADER: "interactive"})
    assert code == 200, hit  # (no key: the fairness id names the tenant)
    assert hit["usage"]["prompt_tokens_details"]["cached_tokens"] == 48
    assert procs.wait_for(lambda: stack.scheduler.saw("request_admitted", tenant="beta", trusted_hop={
        "tenant": True, "priority": -10}), 30), "the objective's priority was not the request's"
    code, miss = stack.post("/v1/completions", body, {FAIRNESS_ID_HEADER: "alpha"})
    assert code == 200 and miss["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, miss
    # alpha may not ask for priority below 0 (its max_priority): neither may a hop's objective for it
    code, err = stack.post("/v1/completions", body, {FAIRNESS_ID_HEADER: "alpha", OBJECTIVE_HEADER: "interactive"})
    assert code == 400 and err["error"]["param"] == "priority" and err["error"]["message"].startswith(
        f"priority: -10 (the objective in {OBJECTIVE_HEADER}); tenant alpha may ask for 0 or more"), err
    code, err = stack.post("/v1/completions", body, {FAIRNESS_ID_HEADER: "beta", OBJECTIVE_HEADER: "gold"})
    assert code == 400 and err["error"]["message"].startswith(f"{OBJECTIVE_HEADER}: objective 'gold' is unknown")
    code, err = stack.post("/v1/completions", body, {FAIRNESS_ID_HEADER: "gamma"})
    assert code == 403 and "'gamma'" in err["error"]["message"]
    # a client's own x-pagedkv-tenant is not passed on: its key decides
    code, err = stack.post("/v1/completions", body, {TENANT_HEADER: "beta"})
    assert code == 401, err


def test_a_reload_ends_a_hop_stream_only_when_its_tenant_goes(stack):
    """A stream a hop opened for beta carries no key: a reload that keeps beta lets it run on (a key check would
    have ended it), one that removes beta ends it."""
    sched, hold = stack.scheduler, {"max_tokens": 1500, "ignore_eos": True}
    without_beta = TENANTS.split("[tenants.beta]")[0]

    async def scenario():
        async with Client(sched.address, metadata=hop_metadata(HOP_SECRET, "beta"), resume=None) as c:
            stream = c.generate([1, 52, 7], **hold)
            await anext(stream)
            sched.signal(signal.SIGHUP)  # (the same file)
            assert await asyncio.to_thread(procs.wait_for, lambda: sched.log().count("tenants_reloaded") >= 1, 60)
            still = await anext(stream)
            stack.tenants_path.write_text(without_beta)
            sched.signal(signal.SIGHUP)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in stream:
                    pass
            return still, err.value
    try:
        still, err = run(scenario())
    finally:
        stack.tenants_path.write_text(TENANTS)
        sched.signal(signal.SIGHUP)
    assert still.token_ids
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED, err
    assert err.details() == "tenant beta no longer in the tenants file: the tenants file was reloaded and this " \
        "stream ended"
    assert procs.wait_for(lambda: sched.log().count("tenants_reloaded") >= 3, 60)


def _metric(text: str, name: str, labels: str = "") -> float:
    m = re.search(rf"^{re.escape(name + labels)} (\S+)$", text, re.M)
    assert m, f"{name}{labels} not in /metrics"
    return float(m.group(1))


def test_gie_gauges_and_health_while_draining(stack):
    """Last in this module: it stops the scheduler. A request runs; once its first token is in, the executor is
    stopped (SIGSTOP), so the request holds its pages and the gauges hold still; the scheduler, sent SIGTERM,
    drains (its stream cannot end), and the gateway's /health is 503 until the executor goes on."""
    sched, executor = stack.scheduler, stack.executor
    assert stack.get(stack.base + "/health")[0] == 200
    async def scenario():
        async with Client(sched.address, api_key=KEY_A, resume=None) as c:
            stream = c.generate(PROMPT, max_tokens=400, ignore_eos=True)
            await anext(stream)
            executor.signal(signal.SIGSTOP)
            try:
                code, text = stack.get(f"http://127.0.0.1:{stack.metrics_port}/metrics")
                assert code == 200
                used = _metric(text, "pagedkv_pages_used")
                capacity = _metric(text, "pagedkv_pages_capacity")
                assert capacity == NUM_PAGES and used >= 4
                assert _metric(text, "pagedkv_kv_cache_usage_perc") == used / capacity
                config = f'{{block_size="16",num_gpu_blocks="{NUM_PAGES}"}}'
                assert _metric(text, "pagedkv_cache_config_info", config) == 1
                assert _metric(text, "pagedkv_requests_running") >= 1
                assert re.search(r"^pagedkv_requests_waiting \S+$", text, re.M)
                sched.signal(signal.SIGTERM)
                assert procs.wait_for(lambda: sched.saw("scheduler_draining"), 60)
                code, body = stack.get(stack.base + "/health")
                assert code == 503 and "NOT_SERVING" in body, body
            finally:
                executor.signal(signal.SIGCONT)
            async for _ in stream:
                pass
    run(scenario())
    assert sched.wait(120) == 0
