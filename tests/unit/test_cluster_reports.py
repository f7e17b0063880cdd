"""cluster_reports: what the cluster reports about its executors. Only those that answered once report snapshots;
those up or draining count as live; the executors' rows of ModelInfo include one never up; it reads the cluster's own
mapping, so an engine added later is reported."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from scheduler_svc import metrics
from scheduler_svc.cluster_reports import ClusterReports
from scheduler_svc.engine_types import EngineInfo, State

pytestmark = pytest.mark.unit


class FakeScheduler:
    def __init__(self, name: str) -> None:
        self.name, self.resets = name, []

    def snapshot(self, tenants: bool = False):
        pool = SimpleNamespace(num_pages=10, num_used=4, num_cached=1)
        return SimpleNamespace(name=self.name, tenants=tenants, pool=pool, num_running=2, num_waiting=1,
                               num_swapped=1, counters=SimpleNamespace(computed_tokens=99))

    def reset_peak(self, tenant_id: str, cluster: bool) -> None:
        self.resets.append((tenant_id, cluster))


def _engine(state: State, name: str | None):
    return SimpleNamespace(state=state, scheduler=FakeScheduler(name) if name else None,
                           info=lambda: EngineInfo(executor_id=f"id-{name}", num_placed=5))


def _reports():
    engines = {"a:1": _engine(State.UP, "a"), "b:1": _engine(State.DOWN, "b"), "c:1": _engine(State.CONNECTING, None)}
    return engines, ClusterReports(engines, SimpleNamespace(service=None), lambda: 0)


def test_snapshots_of_the_executors_that_answered_and_which_are_live():
    engines, reports = _reports()
    assert [s.name for s in reports.snapshots()] == ["a", "b"]
    assert [s.name for s in reports.snapshots(live=True, tenants=True)] == ["a"]
    snaps, live = reports.snapshots_with_liveness()
    assert [s.name for s in snaps] == ["a", "b"] and all(s.tenants for s in snaps) and live == {0}
    engines["d:1"] = _engine(State.DRAINING, "d")  # (the cluster's mapping: read each time)
    assert [s.name for s in reports.snapshots(live=True)] == ["a", "d"]


def test_executor_rows_and_peak_resets():
    engines, reports = _reports()
    rows = reports.executor_infos()
    assert [(r.address, r.state, r.executor_id, r.num_placed) for r in rows] == [
        ("a:1", "up", "id-a", 5), ("b:1", "down", "id-b", 5), ("c:1", "connecting", "id-None", 5)]
    first = rows[0]
    assert (first.num_pages, first.num_used_pages, first.num_waiting, first.num_computed_tokens) == (10, 4, 2, 99)
    assert rows[2].num_pages == 0  # (never answered: no pool to report)
    reports.reset_peak("t", True)
    assert engines["a:1"].scheduler.resets == engines["b:1"].scheduler.resets == [("t", True)]


def test_forgetting_an_executor_drops_its_gauges():
    _, reports = _reports()
    metrics.EXECUTOR_RUNNING.labels("a:1").set(2)
    reports.forget("a:1")
    reports.forget("a:1")  # (twice: no error)
    assert ("a:1",) not in metrics.EXECUTOR_RUNNING._metrics
