"""The scheduler's loop: plan a step, send it, apply the result, stream outputs to clients."""

from __future__ import annotations

import asyncio
import time

from scheduler_svc import metrics
from scheduler_svc.executor_client import ExecutorClient, ExecutorUnavailable
from scheduler_svc.policy import Costs
from scheduler_svc.request import Output, Request
from scheduler_svc.scheduler import Scheduler


class Engine:
    def __init__(self, scheduler: Scheduler, executor: ExecutorClient, log,
                 check_every_step: bool = False, reconnect_timeout: float = 30.0) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.log = log
        self.check_every_step = check_every_step
        self.reconnect_timeout = reconnect_timeout
        self.wake = asyncio.Event()
        self.arrivals = 0
        self._task: asyncio.Task | None = None
        self.steps = 0
        self._counted: dict[str, int] = {}
        self._tenant_counted: dict[str, tuple[int, int]] = {}

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="engine")

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        await self.executor.close()

    def next_arrival(self) -> int:
        self.arrivals += 1
        return self.arrivals

    def add_request(self, req: Request) -> None:
        self.scheduler.add(req)
        metrics.PROMPT_TOKENS.inc(len(req.prompt_ids))
        self.wake.set()

    def abort(self, request_id: str) -> None:
        self.scheduler.abort(request_id)
        self.wake.set()

    @staticmethod
    def deliver(outputs: list[tuple[Request, Output]]) -> None:
        for req, out in outputs:
            req.queue.put_nowait(out)
            if out.token_ids:
                metrics.GENERATED_TOKENS.inc(len(out.token_ids))
            if out.finish is not None:
                metrics.FINISHED.labels(out.finish.value).inc()

    def _count(self) -> None:
        """Moves the scheduler's cumulative counters into the Prometheus counters."""
        s = self.scheduler
        now = {"swap": s.num_swap_preemptions, "recompute": s.num_recompute_preemptions,
               "out": s.kv.swaps.pages_out, "in": s.kv.swaps.pages_in, "spilled": s.kv.swaps.spilled,
               "spill_hits": s.kv.swaps.spill_hits}
        last = self._counted
        if any(now[k] < last.get(k, 0) for k in now):  # counters never go back; if they did, start over
            last = {}
        for kind in ("swap", "recompute"):
            metrics.PREEMPTIONS.labels(kind).inc(now[kind] - last.get(kind, 0))
        page_bytes = s.policy.costs.page_bytes
        for direction in ("out", "in"):
            metrics.SWAP_PAGES.labels(direction).inc(now[direction] - last.get(direction, 0))
            metrics.SWAP_BYTES.labels(direction).inc((now[direction] - last.get(direction, 0)) * page_bytes)
        metrics.SPILLED_PAGES.inc(now["spilled"] - last.get("spilled", 0))
        metrics.SPILL_HITS.inc(now["spill_hits"] - last.get("spill_hits", 0))
        self._counted = now

    def _update_gauges(self) -> None:
        s = self.scheduler
        if s.host is not None:
            metrics.HOST_PAGES_USED.set(s.host.num_used)
            metrics.HOST_PAGES_CACHED.set(s.host.num_cached)
        metrics.SWAPPED.set(len(s.swapped))
        running: dict[str, int] = {}
        for r in s.running:
            running[r.tenant] = running.get(r.tenant, 0) + 1
        for tenant, st in s.tenant_stats.items():
            metrics.TENANT_PAGES.labels(tenant).set(s.pool.used_by[tenant])
            metrics.TENANT_RUNNING.labels(tenant).set(running.get(tenant, 0))
            metrics.TENANT_WAITING.labels(tenant).set(s.waiting.tenant_len(tenant))
            metrics.TENANT_SERVICE.labels(tenant).set(s.waiting.service(tenant))
            last = self._tenant_counted.get(tenant, (0, 0))
            metrics.TENANT_BUDGET_HITS.labels(tenant).inc(max(0, st.budget_hits - last[0]))
            metrics.TENANT_FAIR_PREEMPTIONS.labels(tenant).inc(max(0, st.fair_share_preemptions - last[1]))
            self._tenant_counted[tenant] = (st.budget_hits, st.fair_share_preemptions)
        metrics.PAGES_USED.set(s.pool.num_used)
        metrics.PAGES_FREE.set(s.pool.num_free)
        metrics.RUNNING.set(len(s.running))
        metrics.WAITING.set(len(s.waiting))
        slots = s.pool.num_used * s.pool.block_size
        metrics.KV_SLOT_UTILIZATION.set(sum(r.num_computed for r in s.running) / slots if slots else 0.0)

    async def _loop(self) -> None:
        while True:
            try:
                await self._iteration()
            except asyncio.CancelledError:
                raise
            except Exception as err:  # noqa: BLE001 - a bug must not leave every client stream hanging
                self.log.exception("engine_error")
                self.executor.drop()  # the executor's request state goes with the stream
                await self._executor_failed(f"internal error in the scheduler: {err!r}")

    async def _iteration(self) -> None:
        await self.wake.wait()
        t0 = time.perf_counter()
        plan, outputs = self.scheduler.schedule()
        self.deliver(outputs)
        self._count()
        if plan is None:
            if not self.scheduler.has_work:
                self.wake.clear()
                self.scheduler.check_integrity()  # idle: every page must be accounted for
                self._update_gauges()
            else:
                await asyncio.sleep(0.001)
            return
        t1 = time.perf_counter()
        try:
            result = await self.executor.step(plan)
        except ExecutorUnavailable as err:
            await self._executor_failed(str(err))
            return
        t2 = time.perf_counter()
        self.deliver(self.scheduler.process(result))
        if self.check_every_step:
            self.scheduler.check_integrity()
        self.steps += 1
        self._update_gauges()
        metrics.STEP_SECONDS.labels("plan").observe(t1 - t0)
        metrics.STEP_SECONDS.labels("executor").observe(t2 - t1)
        metrics.STEP_SECONDS.labels("forward").observe(result.timings.forward_ms / 1e3)

    async def _executor_failed(self, error: str) -> None:
        self.log.error("executor_failed", error=error)
        self.deliver(self.scheduler.fail_all(error))
        try:
            self.scheduler.check_integrity()
        except AssertionError:
            self.log.exception("integrity_after_failure")
        while True:
            try:
                describe = await self.executor.connect(self.reconnect_timeout)
                break
            except ExecutorUnavailable as err:
                self.log.warning("executor_reconnect_failed", error=str(err))
        pool = self.scheduler.pool
        host_pages = self.scheduler.host.num_pages if self.scheduler.host is not None else 0
        if (describe.num_device_pages, describe.num_host_pages, describe.block_size) != (
                pool.num_pages, host_pages, pool.block_size):
            self.log.warning("executor_pool_changed", num_pages=describe.num_device_pages,
                             num_host_pages=describe.num_host_pages, block_size=describe.block_size)
            self.scheduler.reset_pool(describe.num_device_pages, describe.block_size, describe.num_host_pages)
        self.scheduler.set_costs(Costs.of(describe))
        self.log.info("executor_reconnected", executor_id=describe.executor_id)
