"""The cluster's Prometheus gauges (metrics.py), from every executor's snapshot: page and request counts on every
call (cheap: per executor); KV utilization and per-tenant figures, which walk the requests, at most every
GAUGE_PERIOD seconds unless forced."""

from __future__ import annotations

import time
from collections.abc import Mapping

from scheduler_svc import metrics
from scheduler_svc.engine import Engine
from scheduler_svc.engine_types import State
from scheduler_svc.snapshot import SchedulerSnapshot
from scheduler_svc.wait_queue import VtcCounters

GAUGE_PERIOD = 0.25  # seconds


class Gauges:
    def __init__(self) -> None:
        self._updated_at = 0.0  # of the detailed gauges
        self._tenant_counted: dict[str, tuple[int, int]] = {}  # (budget hits, fair-share preemptions) counted
        self._cache_config: tuple[str, str] | None = None  # the labels pagedkv_cache_config_info has now

    def update(self, engines: Mapping[str, Engine], num_unplaced: int, service: VtcCounters, force: bool,
               adapters_loaded: int = 0) -> None:
        states = {s: 0 for s in State}
        for e in engines.values():
            states[e.state] += 1
        for state, n in states.items():
            metrics.EXECUTORS.labels(state.value).set(n)
        now = time.monotonic()
        detailed = force or now - self._updated_at >= GAUGE_PERIOD
        live: list[SchedulerSnapshot] = []
        for address, e in engines.items():
            if e.scheduler is None or e.state not in (State.UP, State.DRAINING):
                metrics.EXECUTOR_PAGES_USED.labels(address).set(0)
                metrics.EXECUTOR_RUNNING.labels(address).set(0)
                continue
            snap = e.scheduler.snapshot(tenants=detailed)
            live.append(snap)
            metrics.EXECUTOR_PAGES_USED.labels(address).set(snap.pool.num_used)
            metrics.EXECUTOR_RUNNING.labels(address).set(snap.num_running)
        used = sum(s.pool.num_used for s in live)
        metrics.PAGES_USED.set(used)
        metrics.PAGES_FREE.set(sum(s.pool.num_free for s in live))
        metrics.PAGES_CACHED.set(sum(s.pool.num_cached for s in live))
        capacity = sum(s.pool.num_pages for s in live)
        metrics.PAGES_CAPACITY.set(capacity)
        metrics.KV_CACHE_USAGE.set(used / capacity if capacity else 0.0)
        if live:
            self._set_cache_config(live[0].block_size, capacity)
        metrics.HOST_PAGES_CAPACITY.set(sum(s.host.num_pages for s in live))
        metrics.HOST_PAGES_USED.set(sum(s.host.num_used for s in live))
        metrics.HOST_PAGES_CACHED.set(sum(s.host.num_cached for s in live))
        metrics.HOST_PAGES_FREE.set(sum(s.host.num_free for s in live))
        metrics.RUNNING.set(sum(s.num_running for s in live))
        metrics.WAITING.set(sum(s.num_waiting for s in live) + num_unplaced)
        metrics.SWAPPED.set(sum(s.num_swapped for s in live))
        metrics.UNPLACED.set(num_unplaced)
        lora = {a: e.scheduler.adapters for a, e in engines.items()
                if e.scheduler is not None and e.scheduler.adapters is not None}
        if adapters_loaded or lora:
            metrics.adapter_gauges(lora, adapters_loaded)
        if not detailed:
            return
        self._updated_at = now
        slots = used * (live[0].block_size if live else 1)
        metrics.KV_SLOT_UTILIZATION.set(sum(s.kv_slots_filled for s in live) / slots if slots else 0.0)
        everyone = [e.scheduler.snapshot(tenants=True) for e in engines.values() if e.scheduler is not None]
        tenants: dict[str, list[int]] = {}
        for snap in live:
            for tenant, u in snap.tenants.items():
                row = tenants.setdefault(tenant, [0, 0, 0])
                row[0] += u.num_running
                row[1] += u.used_pages
                row[2] += u.retained_pages
        for tenant, (n_running, pages, retained) in tenants.items():
            metrics.TENANT_PAGES.labels(tenant).set(pages)
            metrics.TENANT_RETAINED_PAGES.labels(tenant).set(retained)
            metrics.TENANT_RUNNING.labels(tenant).set(n_running)
            metrics.TENANT_WAITING.labels(tenant).set(sum(s.tenants[tenant].num_waiting for s in everyone
                                                          if tenant in s.tenants))
            metrics.TENANT_SERVICE.labels(tenant).set(service.counters.get(tenant, 0.0))
        self._count_tenant_events(everyone)

    def _set_cache_config(self, block_size: int, num_pages: int) -> None:
        """pagedkv_cache_config_info{block_size, num_gpu_blocks} = 1; the old series dropped when the pages that
        serve change (an executor joined or left)."""
        labels = (str(block_size), str(num_pages))
        if labels != self._cache_config:
            metrics.CACHE_CONFIG_INFO.clear()
            metrics.CACHE_CONFIG_INFO.labels(*labels).set(1)
            self._cache_config = labels

    def _count_tenant_events(self, snapshots: list[SchedulerSnapshot]) -> None:
        totals: dict[str, tuple[int, int]] = {}
        for snap in snapshots:
            for tenant, u in snap.tenants.items():
                a, b = totals.get(tenant, (0, 0))
                totals[tenant] = (a + u.budget_hits, b + u.fair_share_preemptions)
        last = self._tenant_counted
        for tenant, (hits, fair) in totals.items():
            prev = last.get(tenant, (0, 0))
            metrics.TENANT_BUDGET_HITS.labels(tenant).inc(max(0, hits - prev[0]))
            metrics.TENANT_FAIR_PREEMPTIONS.labels(tenant).inc(max(0, fair - prev[1]))
        self._tenant_counted = totals
