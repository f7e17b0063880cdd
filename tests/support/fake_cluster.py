"""A stand-in for the gRPC executor client, so that real Cluster, Engine and Scheduler objects drive
FakeExecutors (tests/support/fake_executor.py) in one process: Box (what runs at one address), FakeClient (installed
by the ``boxes`` fixture, tests/conftest.py), and a Cluster built on them."""

from __future__ import annotations

import asyncio
import itertools
from collections import deque

import structlog

from pagedkv.executor.v1 import executor_pb2 as pb
from pagedkv.wire import EXECUTOR_PROTOCOL
from scheduler_svc import cluster as cluster_mod
from scheduler_svc import engine as engine_mod
from scheduler_svc.executor_client import ExecutorUnavailable
from scheduler_svc.kv_events import KvEventLog
from scheduler_svc.pages import tier_pools
from scheduler_svc.scheduler import Scheduler, SchedulerConfig
from tests.support.fake_executor import FakeExecutor

BS = 16
_ids = itertools.count()


class FakeCall:
    def __init__(self) -> None:
        self._done = False
        self._callbacks = []

    def done(self) -> bool:
        return self._done

    def add_done_callback(self, cb) -> None:
        self._callbacks.append(cb)

    def cancel(self) -> None:
        if not self._done:
            self._done = True
            for cb in self._callbacks:
                cb(self)


class Box:
    """What runs at one address: an executor process (restart() gives a new one with empty pools)."""

    def __init__(self, pages: int) -> None:
        self.pages = pages
        self.alive = True
        self.draining = False
        self.delay = 0.0
        self.adapters: list[pb.Adapter] = []  # the LoRA adapters its Describe lists
        self.restart()

    def restart(self) -> None:
        self.executor = FakeExecutor(BS)
        self.executor_id = f"x{next(_ids)}"


class FakeClient:
    boxes: dict[str, Box] = {}
    pages_kept = True  # the executor's answer on Run (x-pagedkv-pages); a restarted Box has a new executor id

    def __init__(self, address: str, step_timeout: float, link=None) -> None:
        self.address = address
        self.call = None
        self.sent: deque = deque()  # plans sent, not yet answered
        self.running: asyncio.Future | None = None  # the oldest plan's step, started by result_within

    @property
    def box(self) -> Box:
        return self.boxes[self.address]

    # (the stream as the engine reads it: ExecutorClient's)
    @property
    def has_stream(self) -> bool:
        return self.call is not None

    @property
    def stream_ended(self) -> bool:
        return self.call is None or self.call.done()

    def on_stream_end(self, callback) -> None:
        self.call.add_done_callback(lambda _call: callback())

    async def connect(self, timeout: float):
        await asyncio.sleep(0)
        if not self.box.alive or self.box.draining:
            await asyncio.sleep(timeout)
            raise ExecutorUnavailable(f"{self.address} down")
        self.call = FakeCall()
        self.sent.clear()
        return pb.DescribeResponse(protocol=EXECUTOR_PROTOCOL, model="m", vocab_size=300, block_size=BS,
                                   max_position_embeddings=4096, num_device_pages=self.box.pages, eos_token_ids=[2],
                                   executor_id=self.box.executor_id, adapters=self.box.adapters)

    async def send(self, plan) -> None:
        """Plans run in order, when their result is read (``step``: tests replace it to watch each step)."""
        if self.call is None or self.call.done() or not self.box.alive:
            self.drop()
            raise ExecutorUnavailable(f"{self.address} gone")
        self.sent.append(plan)

    async def result_within(self, timeout: float) -> bool:
        if self.running is None and self.sent:
            self.running = asyncio.ensure_future(self.step(self.sent[0]))
        if self.running is None:
            return True
        done, _ = await asyncio.wait({self.running}, timeout=timeout)
        return bool(done)

    async def receive(self, step_id: int):
        plan = self.sent.popleft()
        assert plan.step_id == step_id
        running, self.running = self.running, None
        return await (running if running is not None else self.step(plan))

    async def step(self, plan):
        await asyncio.sleep(self.box.delay)
        if self.call is None or self.call.done() or not self.box.alive:
            self.drop()
            raise ExecutorUnavailable(f"{self.address} gone")
        result = self.box.executor.step(plan)
        result.draining = self.box.draining
        result.timings.total_ms = self.box.delay * 1e3  # (the step's own time, as an executor reports it)
        return result

    def drop(self) -> None:
        if self.call is not None:
            self.call.cancel()
        if self.running is not None:
            self.running.cancel()
        self.call = self.running = None
        self.sent.clear()

    async def close(self) -> None:
        self.drop()


def install_fake_clients(monkeypatch) -> dict[str, Box]:
    """FakeClient in place of the gRPC executor client (the ``boxes`` fixture of tests/conftest.py); returns
    the Boxes by address, empty."""
    monkeypatch.setattr(cluster_mod, "ExecutorClient", FakeClient)
    monkeypatch.setattr(engine_mod, "RECONNECT_POLL", 0.05)
    FakeClient.boxes = {}
    return FakeClient.boxes


def new_cluster(events: KvEventLog | None = None, adapters=(), **kw) -> cluster_mod.Cluster:
    """A Cluster of the executors at the Boxes' addresses (``events``: its pools report to that KV event log;
    ``adapters``: the LoRA adapters (pb.Adapter) of its reference Describe, the Boxes' to set alike)."""
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=2048)

    def make_scheduler(d, ledger) -> Scheduler:
        pool, _ = tier_pools(d.num_device_pages, d.block_size, 0, events)
        return Scheduler(pool, config, list(d.eos_token_ids), ledger=ledger)
    reference = pb.DescribeResponse(protocol=EXECUTOR_PROTOCOL, model="m", vocab_size=300, block_size=BS,
                                    max_position_embeddings=4096, adapters=adapters)
    kw.setdefault("step_timeout", 5)
    return cluster_mod.Cluster(reference, make_scheduler, structlog.get_logger(), check_every_step=True, **kw)


async def up_cluster(addresses: set[str], **kw) -> cluster_mod.Cluster:
    """A started cluster (new_cluster's keywords) on the Boxes at ``addresses``, once every engine is up."""
    c = new_cluster(**kw)
    c.start()
    c.set_addresses(addresses)
    await until(lambda: all(e.state is engine_mod.State.UP for e in c.engines.values()))
    return c


async def collect(req) -> tuple[list[int], str | None]:
    tokens = []
    while True:
        out = await req.outbox.get()
        tokens += out.token_ids
        if out.error:
            return tokens, out.error
        if out.finish is not None:
            return tokens, None


async def until(predicate, timeout: float = 3.0) -> None:
    for _ in range(int(timeout / 0.01)):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached")
