"""Executors with different KV cache dtypes behind one scheduler (in one process, FakeExecutors): all join,
each reports its own KV dtype and bytes per token, and a request moved off a failed fp8 executor finishes on
an int8 one with no token lost (pages never cross executors: the moved request is recomputed there)."""

from __future__ import annotations

import asyncio

import pytest

from scheduler_svc import cluster as cluster_mod
from scheduler_svc import engine as engine_mod
from tests.support.fake_cluster import Box, FakeClient, collect, until, up_cluster
from tests.support.fake_executor import make_request

pytestmark = pytest.mark.unit

KV = {"a:1": ("fp8_e4m3", 1088), "b:1": ("int8", 1088), "c:1": ("float32", 4096)}


class KvClient(FakeClient):
    async def connect(self, timeout: float):
        d = await super().connect(timeout)
        d.kv_dtype, d.kv_bytes_per_token = KV[self.address]
        return d


@pytest.fixture
def boxes(monkeypatch):
    monkeypatch.setattr(cluster_mod, "ExecutorClient", KvClient)
    monkeypatch.setattr(engine_mod, "RECONNECT_POLL", 0.05)
    KvClient.boxes = FakeClient.boxes = {}
    return KvClient.boxes


def test_mixed_kv_dtypes_join_report_and_migrate(boxes):
    async def scenario():
        boxes.update({"a:1": Box(64), "b:1": Box(64), "c:1": Box(16)})
        c = await up_cluster(set(boxes))
        infos = {i.address: (i.kv_dtype, i.kv_bytes_per_token, i.state) for i in c.reports.executor_infos()}
        boxes["b:1"].delay = boxes["a:1"].delay = 0.002
        boxes["c:1"].alive = False  # the float32 executor leaves: only fp8 and int8 remain
        req = make_request(1, 40, 60)
        c.add_request(req)
        await until(lambda: any(req.request_id in e.scheduler.queues.requests for e in c.engines.values()))
        first = next(a for a, e in c.engines.items() if req.request_id in e.scheduler.queues.requests)
        task = asyncio.create_task(collect(req))
        await until(lambda: len(req.output_ids) >= 20)
        boxes[first].alive = False
        tokens, error = await asyncio.wait_for(task, 5)
        other = c.engines[next(a for a in ("a:1", "b:1") if a != first)]
        await until(lambda: other.scheduler.kv.pool.num_used == 0)
        other.check_integrity()
        await c.stop()
        return infos, tokens, error, c.engines[first].info().num_migrated_out
    infos, tokens, error, migrated = asyncio.run(scenario())
    assert infos == {"a:1": ("fp8_e4m3", 1088, "up"), "b:1": ("int8", 1088, "up"), "c:1": ("float32", 4096, "up")}
    assert error is None and len(tokens) == 60 and migrated == 1
