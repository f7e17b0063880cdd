"""An engine's (re)connection to its executor (engine.py): wait until it answers (Describe, then a new Run stream),
check it may join the cluster, and adopt its pools: the planner to use from then on, a new one or the old one.

It owns no state: the engine passes what it has (its client, planner and figures: the executor id it last saw) and
applies the ``Joined`` it gets back (the planner, the figures, its state).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from pagedkv.executor.v1 import executor_pb2 as pb
from pagedkv.wire import PAGES_FRESH, PAGES_KEPT
from scheduler_svc.adapter_slots import AdapterSlots
from scheduler_svc.engine_types import EngineHooks, EngineInfo, State
from scheduler_svc.executor_client import ExecutorClient, ExecutorUnavailable
from scheduler_svc.policy import PreemptionCosts
from scheduler_svc.scheduler import Scheduler

RECONNECT_LOG_EVERY = 60.0


@dataclass(frozen=True, slots=True)
class Joined:
    """The executor answered and may serve: its description, the planner for it (the engine's own unless new) and
    the engine's figures naming it."""

    describe: pb.DescribeResponse
    planner: Scheduler
    info: EngineInfo


async def join(client: ExecutorClient, hooks: EngineHooks, log, planner: Scheduler | None, info: EngineInfo,
               state: State, give_up: Callable[[], bool], poll: float,
               on_stream_end: Callable[[], None]) -> Joined | None:
    """Until the executor answers (or ``give_up()``): Describe, then a new Run stream; then checks it may join
    (``hooks.check_compatible``) and adopts it (``adopt``); ``on_stream_end()`` is called when that stream ends
    (noticed even when idle). None when given up, or when it was refused: then the stream is dropped, after
    ``poll`` seconds (the engine tries again)."""
    first_failure = last_log = 0.0
    while not give_up():
        try:
            describe = await client.connect(poll)
            break
        except ExecutorUnavailable as err:
            now = time.monotonic()
            first_failure = first_failure or now
            if now - last_log >= RECONNECT_LOG_EVERY:
                log.warning("executor_unreachable", error=str(err), state=state.value,
                            down_for_s=round(now - first_failure, 1))
                last_log = now
            await asyncio.sleep(0.2)
    else:
        return None
    problem = hooks.check_compatible(describe)
    if not problem and hooks.sync_adapters is not None:
        problem = await hooks.sync_adapters(client, describe)
    if not problem:
        try:
            planner = adopt(describe, planner, info.executor_id, client.pages_kept, hooks, log)
        except Exception as err:  # noqa: BLE001 - e.g. a pool geometry the scheduler cannot account for
            problem = f"cannot account for its pools: {err}"
    if problem:
        log.error("executor_refused", reason=problem, hint="retried every few seconds")
        client.drop()
        await asyncio.sleep(poll)
        return None
    client.on_stream_end(on_stream_end)
    log.info("executor_up", executor_id=describe.executor_id, num_pages=describe.num_device_pages,
             num_host_pages=describe.num_host_pages, pages=PAGES_KEPT if client.pages_kept else PAGES_FRESH,
             cached_pages=planner.snapshot().pool.num_cached,
             adapter_pages={a.name: a.num_pages for a in describe.adapters} or None)
    info = replace(info, executor_id=describe.executor_id, kv_dtype=describe.kv_dtype,
                   kv_bytes_per_token=describe.kv_bytes_per_token)
    return Joined(describe, planner, info)


def adopt(describe: pb.DescribeResponse, planner: Scheduler | None, executor_id: str, pages_kept: bool,
          hooks: EngineHooks, log) -> Scheduler:
    """A new planner, or the old one (a new one if the pool geometry changed: Scheduler.reconnected). Another
    executor id (than ``executor_id``, the one last connected) is another process: its pools are empty, so the
    prefix cache forgets every page. The same id is the same process after a dropped Run stream: it kept its pages
    for this link's session (x-pagedkv-session), so the prefix cache keeps them too, unless the executor says it
    zeroed them (``pages_kept`` False: another session attached meanwhile, a desync)."""
    if planner is None:
        planner = hooks.make_scheduler(describe)
        planner.use_adapters(AdapterSlots.of(describe, hooks.owner_of))
        return planner
    snap = planner.snapshot()
    if (describe.num_device_pages, describe.num_host_pages, describe.block_size) != (
            snap.pool.num_pages, snap.host.num_pages, snap.block_size):
        log.warning("executor_pool_changed", num_pages=describe.num_device_pages,
                    num_host_pages=describe.num_host_pages, block_size=describe.block_size)
    kept = describe.executor_id == executor_id and pages_kept
    planner = planner.reconnected(describe.num_device_pages, describe.block_size, describe.num_host_pages,
                                  PreemptionCosts.of(describe), kept)
    planner.use_adapters(AdapterSlots.of(describe, hooks.owner_of))  # (what its slots hold now)
    return planner
