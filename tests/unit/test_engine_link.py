"""engine_link: an engine's (re)connection to its executor. ``join`` waits for the executor, refuses one that may not
join (dropping the stream), and hands back the planner and figures to adopt; ``adopt`` keeps the prefix cache only for
the same executor process that kept its pages."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import structlog

from pagedkv.executor.v1 import executor_pb2 as pb
from scheduler_svc.engine_link import adopt, join
from scheduler_svc.engine_types import EngineHooks, EngineInfo, State
from scheduler_svc.executor_client import ExecutorUnavailable

pytestmark = pytest.mark.unit

DESCRIBE = pb.DescribeResponse(executor_id="exec-1", num_device_pages=64, num_host_pages=0, block_size=16,
                               vocab_size=300, kv_dtype="auto", kv_bytes_per_token=128)


class FakePlanner:
    """What adopt reads of a planner: its snapshot's geometry, and reconnected's arguments."""

    def __init__(self, num_pages: int = 64, block_size: int = 16) -> None:
        self.calls = []
        self._snap = SimpleNamespace(pool=SimpleNamespace(num_pages=num_pages, num_cached=3),
                                     host=SimpleNamespace(num_pages=0), block_size=block_size)

    def snapshot(self):
        return self._snap

    def use_adapters(self, slots):
        self.adapters = slots  # (the executor's LoRA slots as its Describe gives them: None without)

    def reconnected(self, num_pages, block_size, num_host_pages, costs, kept):
        self.calls.append((num_pages, block_size, num_host_pages, kept))
        return self


class FakeClient:
    def __init__(self, failures: int = 0, pages_kept: bool = True) -> None:
        self.failures, self.pages_kept = failures, pages_kept
        self.connects = self.drops = 0
        self.callbacks = []

    async def connect(self, timeout: float):
        self.connects += 1
        if self.connects <= self.failures:
            raise ExecutorUnavailable("not yet")
        return DESCRIBE

    def drop(self) -> None:
        self.drops += 1

    def on_stream_end(self, callback) -> None:
        self.callbacks.append(callback)


def _hooks(problem: str = "", made=None) -> EngineHooks:
    return EngineHooks(make_scheduler=lambda d: made, check_compatible=lambda d: problem, up=None, down=None,
                       relocate=None, gauges=None)


def _join(client, hooks, planner, info=None, give_up=lambda: False):
    return asyncio.run(join(client, hooks, structlog.get_logger(), planner, info or EngineInfo(), State.CONNECTING,
                            give_up, 0.01, on_stream_end=lambda: None))


def test_adopt_makes_a_planner_for_a_first_executor():
    made = FakePlanner()
    assert adopt(DESCRIBE, None, "", True, _hooks(made=made), structlog.get_logger()) is made


@pytest.mark.parametrize("executor_id, pages_kept, kept", [("exec-1", True, True), ("exec-1", False, False),
                                                            ("exec-0", True, False)])
def test_adopt_keeps_the_cache_only_for_the_same_process_that_kept_its_pages(executor_id, pages_kept, kept):
    planner = FakePlanner()
    assert adopt(DESCRIBE, planner, executor_id, pages_kept, _hooks(), structlog.get_logger()) is planner
    assert planner.calls == [(64, 16, 0, kept)]


def test_join_waits_for_the_executor_and_names_it_in_the_figures():
    client, planner = FakeClient(failures=2), FakePlanner()
    joined = _join(client, _hooks(), planner, EngineInfo(executor_id="exec-1", steps=7))
    assert client.connects == 3 and client.drops == 0 and len(client.callbacks) == 1
    assert joined.planner is planner and joined.describe is DESCRIBE
    assert joined.info == EngineInfo(executor_id="exec-1", kv_dtype="auto", kv_bytes_per_token=128, steps=7)
    assert planner.calls == [(64, 16, 0, True)]


def test_join_refuses_an_executor_that_may_not_join():
    client = FakeClient()
    assert _join(client, _hooks(problem="model 'x' differs"), FakePlanner()) is None
    assert client.drops == 1 and client.callbacks == []


def test_join_refuses_pools_the_planner_cannot_account_for():
    def broken(describe):
        raise ValueError("bad geometry")
    client = FakeClient()
    hooks = EngineHooks(make_scheduler=broken, check_compatible=lambda d: "", up=None, down=None, relocate=None,
                        gauges=None)
    assert _join(client, hooks, None) is None
    assert client.drops == 1


def test_join_gives_up_when_told():
    client = FakeClient()
    assert _join(client, _hooks(), FakePlanner(), give_up=lambda: True) is None
    assert client.connects == 0
