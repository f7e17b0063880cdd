"""What the cluster reports about its executors (cluster.py): their schedulers' snapshots (which executors count as
live), the executors' rows of ModelInfo, a tenant's peak reset on each, and the Prometheus gauges (gauges.py).

It owns nothing the cluster changes: it reads the cluster's engines (the same mapping, by address), its tenant
ledger's weighted service and its count of unplaced requests (unplaced.py), and owns only the gauges' throttle
(``Gauges``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from pagedkv.api.v1 import api_pb2 as api
from scheduler_svc import metrics
from scheduler_svc.engine import Engine
from scheduler_svc.engine_types import State
from scheduler_svc.gauges import Gauges
from scheduler_svc.snapshot import SchedulerSnapshot
from scheduler_svc.tenant_ledger import TenantLedger

LIVE = (State.UP, State.DRAINING)  # the executors whose pools count


class ClusterReports:
    def __init__(self, engines: Mapping[str, Engine], ledger: TenantLedger, num_unplaced: Callable[[], int],
                 adapters_loaded: Callable[[], int] = lambda: 0) -> None:
        self._engines = engines  # (the cluster's own mapping: it adds and drops engines)
        self._adapters_loaded = adapters_loaded
        self._ledger = ledger
        self._num_unplaced = num_unplaced
        self._gauges = Gauges()

    @property
    def num_unplaced(self) -> int:
        """Requests held while no executor can take them."""
        return self._num_unplaced()

    def reporting(self, live: bool) -> list[Engine]:
        """The engines with a scheduler (it answered once); live: only those up or draining."""
        return [e for e in self._engines.values() if e.scheduler is not None and (not live or e.state in LIVE)]

    def snapshots(self, live: bool = False, tenants: bool = False) -> list[SchedulerSnapshot]:
        """Every executor's scheduler snapshot (their counters); live: only of executors up or draining (their
        pools); tenants: with per-tenant figures."""
        return [e.scheduler.snapshot(tenants) for e in self.reporting(live)]

    def snapshots_with_liveness(self) -> tuple[list[SchedulerSnapshot], set[int]]:
        """Every executor's snapshot with per-tenant figures, and the indices of those up or draining."""
        engines = self.reporting(live=False)
        live = {i for i, e in enumerate(engines) if e.state in LIVE}
        return [e.scheduler.snapshot(tenants=True) for e in engines], live

    def reset_peak(self, tenant_id: str, cluster: bool) -> None:
        """Peaks start again from what is held now on every executor: the tenant's, and with ``cluster`` the pools'."""
        for e in self.reporting(live=False):
            e.scheduler.reset_peak(tenant_id, cluster)

    def adapter_slots(self) -> list:
        """Each executor's LoRA device slots (adapter_slots.py; None where it has none or no planner yet)."""
        return [e.scheduler.adapters if e.scheduler is not None else None for e in self._engines.values()]

    def executor_infos(self) -> list[api.ExecutorInfo]:
        out = []
        for address, e in sorted(self._engines.items()):
            ei = e.info()
            info = api.ExecutorInfo(address=address, state=e.state.value, executor_id=ei.executor_id,
                                    num_placed=ei.num_placed, num_migrated_out=ei.num_migrated_out,
                                    kv_dtype=ei.kv_dtype, kv_bytes_per_token=ei.kv_bytes_per_token)
            if e.scheduler is not None:
                snap = e.scheduler.snapshot()
                info.num_pages, info.num_used_pages = snap.pool.num_pages, snap.pool.num_used
                info.num_cached_pages, info.num_running = snap.pool.num_cached, snap.num_running
                info.num_waiting = snap.num_waiting + snap.num_swapped
                info.num_computed_tokens = snap.counters.computed_tokens
            out.append(info)
        return out

    def update_gauges(self, force: bool = False) -> None:
        """Gauges from every executor's state (gauges.py); ``force``: the detailed ones too, now."""
        self._gauges.update(self._engines, self.num_unplaced, self._ledger.service, force, self._adapters_loaded())

    @staticmethod
    def forget(address: str) -> None:
        """An executor dropped for good: its per-executor gauges go."""
        for gauge in (metrics.EXECUTOR_PAGES_USED, metrics.EXECUTOR_RUNNING):
            try:
                gauge.remove(address)
            except KeyError:
                pass
        metrics.adapter_pages(address, [])
