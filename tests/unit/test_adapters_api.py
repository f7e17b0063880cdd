"""LoRA adapters through the public API (#52), in one process (the real Generate and ModelInfo handlers, Cluster and
Engine against FakeExecutors): a tenant may select an adapter its tenants-file ``adapters`` allows, and the plan's
NewRequest names it; an adapter not served and one the tenant may not use are both NOT_FOUND, with the same message;
ModelInfo lists each tenant the adapters it may use, with the pages each holds (and pagedkv_adapter_pages per
executor); the tenants file's ``adapters`` is checked as it loads."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
import structlog
import tomllib
from prometheus_client import REGISTRY

from pagedkv.api.v1 import api_pb2 as api
from pagedkv.client import Client
from pagedkv.executor.v1 import executor_pb2 as pb
from pagedkv.tenancy import InvalidTenant, Tenants, hash_key
from scheduler_svc import metrics
from scheduler_svc.api import GenerationService
from scheduler_svc.cluster_reports import ClusterReports
from scheduler_svc.validation import Limits
from tests.support.fake_cluster import Box, FakeClient, up_cluster
from tests.support.fake_executor import NullTokenizer
from tests.support.fake_grpc import Aborted, Context

pytestmark = pytest.mark.unit

SQL = pb.Adapter(name="sql", rank=8, num_bytes=1 << 20, num_pages=3)
CHAT = pb.Adapter(name="chat", rank=16, num_bytes=2 << 20, num_pages=5)
TENANTS = f"""
[tenants.all]
keys = ["{hash_key("k-all")}"]
[tenants.sql_only]
keys = ["{hash_key("k-sql")}"]
adapters = ["sql"]
[tenants.none]
keys = ["{hash_key("k-none")}"]
adapters = []
"""


class Caller(Context):
    def __init__(self, key: str) -> None:
        self.key = key

    def invocation_metadata(self):
        return (("authorization", f"Bearer {self.key}"),)


def _run(boxes, monkeypatch, calls):
    """Runs ``calls(service)`` against a one-executor cluster serving sql and chat, with the TENANTS; returns its
    result and every NewRequest the executor was sent."""
    sent: list = []
    real_send = FakeClient.send

    async def send(self, plan):
        sent.extend(plan.new_requests)
        await real_send(self, plan)
    monkeypatch.setattr(FakeClient, "send", send)

    async def scenario():
        boxes["a:1"] = Box(64)
        boxes["a:1"].adapters = [SQL, CHAT]
        tenants = Tenants.parse(tomllib.loads(TENANTS), Path("t.toml"), 64)
        c = await up_cluster({"a:1"}, tenants=tenants, adapters=[SQL, CHAT])
        service = GenerationService(c, NullTokenizer(), Limits(max_model_len=64, vocab_size=300), {},
                                    structlog.get_logger())
        try:
            return await calls(service)
        finally:
            await c.stop()
    return asyncio.run(scenario()), sent


async def _generate(service, key: str, adapter: str):
    request = Client.build_request([1, 5, 6, 7], max_tokens=3)
    request.adapter = adapter
    try:
        msgs = [m async for m in service.Generate(request, Caller(key))]
        return msgs[-1].finish_reason
    except Aborted as err:
        return err.code, err.details


def test_a_tenant_generates_with_an_adapter_it_may_use_and_the_executor_is_told(boxes, monkeypatch):
    async def calls(service):
        return [await _generate(service, "k-sql", "sql"), await _generate(service, "k-all", "chat"),
                await _generate(service, "k-none", "")]
    results, sent = _run(boxes, monkeypatch, calls)
    assert results == [api.FINISH_REASON_LENGTH] * 3
    assert [r.adapter for r in sent] == ["sql", "chat", ""]


def test_an_adapter_not_served_and_another_tenants_are_the_same_not_found(boxes, monkeypatch):
    """sql_only asking for chat (served, not its own) and for 'nope' (not served): NOT_FOUND naming adapter and
    ModelInfo; the message for a served adapter it may not use is the one for a name nobody serves."""
    async def calls(service):
        return [await _generate(service, "k-sql", "chat"), await _generate(service, "k-none", "chat"),
                await _generate(service, "k-all", "chat-x"), await _generate(service, "k-sql", "chat")]
    results, sent = _run(boxes, monkeypatch, calls)
    forbidden, none, unknown, _ = results
    assert forbidden[0] == none[0] == unknown[0] == grpc.StatusCode.NOT_FOUND
    assert forbidden[1].startswith("adapter: 'chat' is not served;") and "ModelInfo lists" in forbidden[1]
    assert none[1] == forbidden[1]
    assert unknown[1] == forbidden[1].replace("'chat'", "'chat-x'"), "an unknown name reads the same"
    assert not sent, "nothing refused reached the executor"


def test_model_info_lists_the_adapters_each_tenant_may_use(boxes, monkeypatch):
    async def calls(service):
        out = {}
        for key in ("k-all", "k-sql", "k-none"):
            info = await service.ModelInfo(api.ModelInfoRequest(), Caller(key))
            out[key] = [(a.name, a.rank, a.num_bytes, a.num_pages) for a in info.adapters]
        out["gauge"] = {n: REGISTRY.get_sample_value("pagedkv_adapter_pages", {"executor": "a:1", "adapter": n})
                        for n in ("sql", "chat")}
        return out
    got, _ = _run(boxes, monkeypatch, calls)
    assert got == {"k-all": [("sql", 8, 1 << 20, 3), ("chat", 16, 2 << 20, 5)], "k-sql": [("sql", 8, 1 << 20, 3)],
                   "k-none": [], "gauge": {"sql": 3, "chat": 5}}


def test_the_adapter_pages_gauge_follows_an_executors_adapters():
    def rows(executor: str) -> dict:
        return {n: REGISTRY.get_sample_value("pagedkv_adapter_pages", {"executor": executor, "adapter": n})
                for n in ("sql", "chat")}
    metrics.adapter_pages("b:1", [("sql", 3), ("chat", 5)])
    assert rows("b:1") == {"sql": 3, "chat": 5}
    metrics.adapter_pages("b:1", [("chat", 5)])  # sql paged out (or rejoined with other adapters): its row goes
    assert rows("b:1") == {"sql": None, "chat": 5}
    ClusterReports.forget("b:1")  # dropped for good
    assert rows("b:1") == {"sql": None, "chat": None}


@pytest.mark.parametrize("value", ['"sql"', "[1]", '[["sql"]]', "true"])
def test_the_tenants_file_refuses_adapters_that_are_not_a_list_of_names(value):
    raw = tomllib.loads(f'[tenants.a]\nadapters = {value}\n')
    with pytest.raises(InvalidTenant, match=r"^tenants\.a\.adapters: must be a list of adapter names"):
        Tenants.parse(raw, Path("t.toml"), 64)


def test_the_tenants_file_reads_adapters_unset_as_every_one_and_empty_as_none():
    raw = tomllib.loads('[defaults]\nweight = 1\n[tenants.a]\n[tenants.b]\nadapters = []\n'
                                      '[tenants.c]\nadapters = ["x", "y"]\n')
    t = Tenants.parse(raw, Path("t.toml"), 64)
    assert (t.get("a").adapters, t.get("b").adapters, t.get("c").adapters) == (None, (), ("x", "y"))
    assert t.get("a").may_use("x") and not t.get("b").may_use("x") and t.get("c").may_use("y")
    assert not t.get("c").may_use("z")
