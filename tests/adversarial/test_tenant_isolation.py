"""Tenant side channels and bounds, probed as a tenant would (issue 29), in one process: the real API servicer,
Cluster, Engine and Scheduler over a FakeExecutor (tests/support/fake_cluster.py), called with each tenant's key.

- B's ModelInfo is the same, field by field, whether tenant A is idle or floods the server (before: B's weighted
  service was lifted to A's on its return from idle, which told B A's usage; its fair share halved).
- request ids are per tenant: B may use A's live id; A may not use its own twice; one ending leaves the other.
- two credentials in one call are refused, whatever they hold.
- a reload that revokes a key ends the streams opened with it (UNAUTHENTICATED), not the tenant's other keys'.
- queue bounds: past a tenant's max_queued_requests, or the scheduler's total, a new request gets
  RESOURCE_EXHAUSTED "queue full: ..." naming the bound; nothing queued is lost.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest
import structlog
from google.protobuf.json_format import MessageToDict

from pagedkv.api.v1 import api_pb2 as api
from pagedkv.client import Client
from pagedkv.grpc_common import QUEUE_FULL_PREFIX
from pagedkv.tenancy import Tenants, hash_key
from scheduler_svc.api import GenerationService
from scheduler_svc.queue_bounds import QueueBounds
from scheduler_svc.validation import Limits
from tests.support.fake_cluster import Box, until, up_cluster
from tests.support.fake_executor import NullTokenizer
from tests.support.fake_grpc import Aborted, Context

pytestmark = pytest.mark.unit

UNAUTHENTICATED, EXHAUSTED = grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.RESOURCE_EXHAUSTED


class Caller(Context):
    def __init__(self, *keys: str) -> None:
        self.metadata = tuple(("authorization", f"Bearer {k}") for k in keys)

    def invocation_metadata(self):
        return self.metadata


def tenants_file(tmp_path, body: str) -> Tenants:
    path = tmp_path / "tenants.toml"
    path.write_text(body)
    return Tenants.load(path, 64)


def keys(*names: str) -> str:
    return "keys = [" + ", ".join(f'"{hash_key(n)}"' for n in names) + "]\n"


def service_on(c, bounds: QueueBounds | None = None) -> GenerationService:
    return GenerationService(c, NullTokenizer(), Limits(max_model_len=2048, vocab_size=300), {},
                             structlog.get_logger(), queue_bounds=bounds)


def request(first: int, prompt_len: int, max_tokens: int, request_id: str = "") -> api.GenerateRequest:
    """A greedy request whose prompt starts with ``first`` (distinct prompts share no cached page)."""
    return Client.build_request([first] + [5] * (prompt_len - 1), max_tokens=max_tokens, ignore_eos=True,
                                request_id=request_id, temperature=0)


async def drain(stream) -> tuple[int, object]:
    """(tokens received, None) when the stream finished, or (tokens, Aborted) when it was refused or ended."""
    tokens = 0
    try:
        async for msg in stream:
            tokens += len(msg.token_ids)
    except Aborted as err:
        return tokens, err
    return tokens, None


async def refusal(stream) -> Aborted:
    with pytest.raises(Aborted) as err:
        await stream.__anext__()
    return err.value


# ---- ModelInfo: nothing that depends on another tenant -------------------------------------------------
ISOLATION_TENANTS = (f"[tenants.a]\n{keys('ka')}max_concurrent_requests = 4\npage_quota = 32\n"
                     f"[tenants.b]\n{keys('kb')}\n[tenants.ops]\n{keys('ko')}admin = true\n")


def a_waiting(c) -> int:
    return sum(snap.tenants["a"].num_waiting for snap in c.reports.snapshots(tenants=True) if "a" in snap.tenants)


def b_views(boxes, tmp_path, a_floods: bool) -> tuple[list[api.ModelInfoResponse], list[api.ModelInfoResponse]]:
    """Three rounds of one request of B, returning from idle each time: B's ModelInfo at its first token and after
    its end, and the admin's at B's first token. With ``a_floods``, A keeps 4 requests running and ~40 queued."""
    async def scenario():
        boxes["x:1"] = Box(64)
        c = await up_cluster({"x:1"}, tenants=tenants_file(tmp_path, ISOLATION_TENANTS))
        boxes["x:1"].delay = 0.01
        svc = service_on(c)
        flood = []
        if a_floods:
            flood = [asyncio.create_task(drain(svc.Generate(request(100 + i, 20, 30), Caller("ka"))))
                     for i in range(48)]
            await until(lambda: a_waiting(c) >= 40)
        views, admin = [], []
        for round_ in range(3):
            stream = svc.Generate(request(10 + round_, 17, 14), Caller("kb"))  # 31 tokens: 2 pages all along
            first = await stream.__anext__()
            assert first.token_ids
            views.append(await svc.ModelInfo(api.ModelInfoRequest(), Caller("kb")))  # (before the next step)
            admin.append(await svc.ModelInfo(api.ModelInfoRequest(), Caller("ko")))
            assert (await drain(stream))[1] is None
            views.append(await svc.ModelInfo(api.ModelInfoRequest(), Caller("kb")))
            if a_floods:
                assert a_waiting(c) > 0, "the flood ended before B's rounds did"
        for task in flood:
            task.cancel()
        await asyncio.gather(*flood, return_exceptions=True)
        await c.stop()
        return views, admin
    return asyncio.run(scenario())


def test_a_tenants_model_info_is_the_same_whatever_another_tenant_does(boxes, tmp_path):
    quiet, _ = b_views(boxes, tmp_path, a_floods=False)
    loud, admin = b_views(boxes, tmp_path, a_floods=True)
    assert admin[0].num_waiting >= 30 and admin[0].num_running > 1  # A did flood (the admin sees it)
    during, after = quiet[0].tenant, quiet[1].tenant
    assert (during.num_running, during.used_pages, after.num_running, after.peak_used_pages) == (1, 2, 0, 2)
    assert quiet[-1].tenant.service > quiet[1].tenant.service > during.service > 0  # B's own history grows
    for i, (alone, flooded) in enumerate(zip(quiet, loud)):
        assert differences(alone, flooded) == {}, f"view {i} (round {i // 2 + 1})"


def differences(alone: api.ModelInfoResponse, flooded: api.ModelInfoResponse) -> dict[str, tuple]:
    """Every field (tenant.* included) whose value differs: (with A idle, with A flooding)."""
    flat = {}
    for name, view in (("alone", alone), ("flooded", flooded)):
        d = MessageToDict(view, always_print_fields_with_no_presence=True, preserving_proto_field_name=True)
        d |= {f"tenant.{k}": v for k, v in d.pop("tenant").items()}
        flat[name] = d
    keys = flat["alone"].keys() | flat["flooded"].keys()
    return {k: (flat["alone"].get(k), flat["flooded"].get(k)) for k in sorted(keys)
            if flat["alone"].get(k) != flat["flooded"].get(k)}


# ---- request ids -----------------------------------------------------------------------------------------
def test_request_ids_are_per_tenant_and_so_is_cancellation(boxes, tmp_path):
    """A holds "job-1" live. B's "job-1" is served (before: ALREADY_EXISTS, which told B that A had it and let B
    squat A's ids); A's second "job-1" is still refused. A's stream ending leaves B's running to its end."""
    async def scenario():
        boxes["x:1"] = Box(64)
        c = await up_cluster({"x:1"}, tenants=tenants_file(tmp_path, ISOLATION_TENANTS))
        boxes["x:1"].delay = 0.005
        svc = service_on(c)
        a_stream = svc.Generate(request(3, 20, 400, "job-1"), Caller("ka"))
        await a_stream.__anext__()
        b_task = asyncio.create_task(drain(svc.Generate(request(4, 20, 60, "job-1"), Caller("kb"))))
        await until(lambda: ("b", "job-1") in svc.live)
        again = await refusal(svc.Generate(request(5, 20, 4, "job-1"), Caller("ka")))
        await a_stream.aclose()  # A cancels its job-1
        b_tokens, b_error = await asyncio.wait_for(b_task, 10)
        await until(lambda: c.engines["x:1"].scheduler.kv.pool.num_used == 0)
        await c.stop()
        return again, b_tokens, b_error
    again, b_tokens, b_error = asyncio.run(scenario())
    assert again.code == grpc.StatusCode.ALREADY_EXISTS and "'job-1'" in again.details
    assert (b_tokens, b_error) == (60, None)


# ---- credentials -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("keys_sent", [("ka", "kb"), ("kb", "ka"), ("ka", "ka")], ids=["two", "swapped", "same"])
def test_two_credentials_in_one_call_are_refused(boxes, tmp_path, keys_sent):
    """Before, the last authorization entry won (and a rejected first one went unnoticed)."""
    async def scenario():
        boxes["x:1"] = Box(64)
        c = await up_cluster({"x:1"}, tenants=tenants_file(tmp_path, ISOLATION_TENANTS))
        svc = service_on(c)
        refused = await refusal(svc.Generate(request(3, 20, 4), Caller(*keys_sent)))
        with pytest.raises(Aborted) as info:
            await svc.ModelInfo(api.ModelInfoRequest(), Caller(*keys_sent))
        one = await drain(svc.Generate(request(3, 20, 4), Caller(keys_sent[0])))
        await c.stop()
        return refused, info.value, one
    refused, info, one = asyncio.run(scenario())
    for err in (refused, info):
        assert err.code == UNAUTHENTICATED
        assert err.details.startswith("authorization metadata: sent 2 times; send exactly one"), err.details
    assert one == (4, None)


# ---- revocation ----------------------------------------------------------------------------------------
def test_a_reload_that_revokes_a_key_ends_its_open_streams(boxes, tmp_path):
    """Tenant a has two keys; a reload revokes ka. The stream opened with ka ends with UNAUTHENTICATED and its
    pages are freed; the one opened with a's other key, and b's, run to their end."""
    before = f"[tenants.a]\n{keys('ka', 'ka2')}[tenants.b]\n{keys('kb')}"
    after = (f'[tenants.a]\n{keys("ka2")}revoked_keys = ["{hash_key("ka")}"]\n'
             f"[tenants.b]\n{keys('kb')}")

    async def scenario():
        boxes["x:1"] = Box(64)
        c = await up_cluster({"x:1"}, tenants=tenants_file(tmp_path, before))
        boxes["x:1"].delay = 0.005
        svc = service_on(c)
        revoked = svc.Generate(request(3, 20, 1000), Caller("ka"))
        await revoked.__anext__()
        others = [asyncio.create_task(drain(svc.Generate(request(4 + i, 20, 80), Caller(k))))
                  for i, k in enumerate(("ka2", "kb"))]
        await until(lambda: len(svc.live) == 3)
        (tmp_path / "tenants.toml").write_text(after)
        c.set_tenants(str(tmp_path / "tenants.toml"))
        ended = svc.end_revoked_streams()
        outcome = await asyncio.wait_for(drain(revoked), 5)
        rest = await asyncio.wait_for(asyncio.gather(*others), 10)
        await until(lambda: c.engines["x:1"].scheduler.kv.pool.num_used == 0)
        again = await refusal(svc.Generate(request(3, 20, 4), Caller("ka")))
        await c.stop()
        return ended, outcome, rest, again
    ended, (_, err), rest, again = asyncio.run(scenario())
    assert ended == 1
    assert err.code == UNAUTHENTICATED
    assert err.details == "API key revoked: the tenants file was reloaded and this stream ended"
    assert rest == [(80, None), (80, None)]
    assert (again.code, again.details) == (UNAUTHENTICATED, "API key revoked")


# ---- queue bounds --------------------------------------------------------------------------------------
def test_a_queue_flood_is_refused_past_the_tenant_and_the_scheduler_bound(boxes, tmp_path):
    """a may run 1 request and queue 2 (its own max_queued_requests); b may run 1 and queue 3 (the server's
    default); the scheduler queues at most 4. Before, a tenant limited to 1 running request queued any number
    (issue 29: 64 running, 889 more queued, ~62 KB each)."""
    body = (f"[tenants.a]\n{keys('ka')}max_concurrent_requests = 1\nmax_queued_requests = 2\n"
            f"[tenants.b]\n{keys('kb')}max_concurrent_requests = 1\n")

    async def scenario():
        boxes["x:1"] = Box(64)
        c = await up_cluster({"x:1"}, tenants=tenants_file(tmp_path, body))
        boxes["x:1"].delay = 0.005
        svc = service_on(c, QueueBounds(per_tenant=3, total=4))
        streams = []

        def live(tenant: str) -> int:
            return sum(1 for t, _ in svc.live if t == tenant)

        async def hold(tenant: str, first: int, queued: int) -> None:
            """A request of the tenant that runs (its first token came), then ``queued`` more behind it."""
            holder = svc.Generate(request(first, 20, 1000), Caller("k" + tenant))
            await holder.__anext__()
            streams.append(asyncio.create_task(drain(holder)))
            for i in range(queued):
                count = live(tenant)
                stream = svc.Generate(request(first + 1 + i, 20, 1000), Caller("k" + tenant))
                streams.append(asyncio.create_task(drain(stream)))
                await until(lambda n=count + 1: live(tenant) == n)  # (in the queue, in this order)

        await hold("a", 10, 2)
        await until(lambda: c.queued("a") == (2, 2))
        a_full = await refusal(svc.Generate(request(20, 20, 4), Caller("ka")))
        await hold("b", 30, 2)  # 4 queued in all
        await until(lambda: c.queued("b") == (2, 4))
        b_full = await refusal(svc.Generate(request(40, 20, 4), Caller("kb")))
        info = {k: (await svc.ModelInfo(api.ModelInfoRequest(), Caller(k))).tenant for k in ("ka", "kb")}
        streams[1].cancel()  # one of a's queued requests goes: a may queue one more
        await until(lambda: c.queued("a") == (1, 3))
        streams.append(asyncio.create_task(drain(svc.Generate(request(50, 20, 4), Caller("ka")))))
        await until(lambda: c.queued("a") == (2, 4))
        for s in streams:
            s.cancel()
        await asyncio.gather(*streams, return_exceptions=True)
        await until(lambda: c.engines["x:1"].scheduler.kv.pool.num_used == 0 and c.queued("a") == (0, 0))
        await c.stop()
        return a_full, b_full, info
    a_full, b_full, info = asyncio.run(scenario())
    assert a_full.code == b_full.code == EXHAUSTED
    assert a_full.details == (f"{QUEUE_FULL_PREFIX}tenant a has 2 requests waiting to start; its max_queued_requests "
                              "is 2 (retry once some have started)")
    assert b_full.details == (f"{QUEUE_FULL_PREFIX}the scheduler holds its limit of 4 requests waiting to start "
                              "(--max-queued-total); retry later or on another scheduler")
    assert (info["ka"].max_queued_requests, info["ka"].num_waiting) == (2, 2)
    assert (info["kb"].max_queued_requests, info["kb"].num_waiting) == (3, 2)
