"""The executor starts writing a step's result and runs the next plan without waiting for the write to be
confirmed (executor_svc/service.py, Run). That only pays if the result's bytes leave when the write starts: were
they held until the handler next yields to its event loop, a result would reach the scheduler a whole step late
and async scheduling would lose its overlap. Here the scheduler side reads on its own thread while the executor's
second step blocks its event loop (as a forward does) until the first result has arrived: it must arrive during
that step. No clock decides: step 2 waits on that arrival (up to HOLD_S, which only catches the failure)."""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest
import structlog

from executor_svc.service import ExecutorService
from pagedkv import grpc_common
from pagedkv.executor.v1 import executor_pb2 as pb
from pagedkv.executor.v1 import executor_pb2_grpc as pb_grpc

pytestmark = pytest.mark.e2e

HOLD_S = 20.0  # the longest step 2 waits for result 1 to arrive (it arrives in milliseconds)


class SlowRunner:
    """What ExecutorService asks of a ModelRunner; step 2 holds the event loop's thread until ``arrived`` is set
    (result 1 reached the client) or HOLD_S passed; ``released`` says which."""

    def __init__(self, arrived: threading.Event) -> None:
        self.requests = {"r": object()}  # (requests in progress: the idle gap is measured)
        self.exact_tail = None  # (no 8-bit pool: no exact tail's slots to export)
        self.arrived = arrived
        self.released: bool | None = None

    def step(self, plan: pb.StepPlan) -> pb.StepResult:
        if plan.step_id == 2:
            self.released = self.arrived.wait(HOLD_S)
        result = pb.StepResult(step_id=plan.step_id, num_computed_tokens=1)
        result.sampled_rows.append(0)
        result.sampled_token_ids.append(plan.step_id)
        result.sampled_logprobs.append(0.0)
        return result

    def reset(self) -> None:
        pass

    def wipe_pages(self) -> bool:
        return False


def test_a_result_leaves_while_the_next_step_runs():
    arrived: list[int] = []
    first = threading.Event()
    runner = SlowRunner(first)
    ready = threading.Event()
    port: list[int] = []

    async def serve(stop: asyncio.Event) -> None:
        server = grpc_common.new_server()
        pb_grpc.add_ExecutorServicer_to_server(ExecutorService(runner, pb.DescribeResponse(),
                                                               structlog.get_logger()), server)
        port.append(grpc_common.bind(server, "127.0.0.1", 0))
        await server.start()
        ready.set()
        await stop.wait()
        await server.stop(None)

    loop = asyncio.new_event_loop()
    stop = asyncio.Event()
    thread = threading.Thread(target=loop.run_until_complete, args=(serve(stop),), daemon=True)
    thread.start()
    assert ready.wait(10)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port[0]}") as channel:
            stub = pb_grpc.ExecutorStub(channel)
            plans = [pb.StepPlan(step_id=1, decodes=["r"]), pb.StepPlan(step_id=2, decodes=["r"])]
            for result in stub.Run(iter(plans), timeout=2 * HOLD_S):  # (both plans go at once: async scheduling)
                arrived.append(result.step_id)
                first.set()
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(10)
    assert arrived == [1, 2]
    assert runner.released, f"result 1 arrived only after step 2 had waited {HOLD_S:g} s for it"
