"""The scheduler's connection to one executor: Describe, then one Run stream of plans."""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedkv.executor.v1 import executor_pb2 as pb
from pagedkv.executor.v1 import executor_pb2_grpc as pb_grpc
from pagedkv.grpc_common import CHANNEL_OPTIONS, KEEPALIVE_OPTIONS


class ExecutorUnavailable(Exception):
    pass


SERVICE = pb.DESCRIPTOR.services_by_name["Executor"].full_name


class ExecutorClient:
    def __init__(self, address: str, step_timeout: float) -> None:
        self.address = address
        self.step_timeout = step_timeout
        self.channel = grpc.aio.insecure_channel(address, options=[*CHANNEL_OPTIONS, *KEEPALIVE_OPTIONS])
        self.stub = pb_grpc.ExecutorStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)
        self.call = None
        self.describe: pb.DescribeResponse | None = None

    async def connect(self, timeout: float) -> pb.DescribeResponse:
        """Waits up to ``timeout`` seconds for the executor, reads its description, opens the Run stream."""
        await self.probe(timeout)
        self.call = self.stub.Run()
        return self.describe

    async def probe(self, timeout: float) -> pb.DescribeResponse:
        """Waits up to ``timeout`` seconds for a serving executor and reads its description."""
        try:
            await asyncio.wait_for(self.channel.channel_ready(), timeout)
            health = await self.health.Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=timeout)
            self.describe = await self.stub.Describe(pb.DescribeRequest(), timeout=timeout)
        except (asyncio.TimeoutError, grpc.aio.AioRpcError) as err:
            raise ExecutorUnavailable(f"executor {self.address} not reachable within {timeout:.0f}s: {err}") from err
        if health.status != health_pb2.HealthCheckResponse.SERVING:  # starting up or draining
            raise ExecutorUnavailable(f"executor {self.address} is not serving (health: "
                                      f"{health_pb2.HealthCheckResponse.ServingStatus.Name(health.status)})")
        return self.describe

    async def step(self, plan: pb.StepPlan) -> pb.StepResult:
        if self.call is None:
            raise ExecutorUnavailable(f"executor {self.address}: no open Run stream")
        try:
            # NOTE: the write has a deadline too: a hung executor that stops reading blocks it on flow control.
            await asyncio.wait_for(self.call.write(plan), self.step_timeout)
            result = await asyncio.wait_for(self.call.read(), self.step_timeout)
        except (asyncio.TimeoutError, grpc.aio.AioRpcError, grpc.aio.UsageError) as err:
            self.drop()
            raise ExecutorUnavailable(f"executor {self.address} failed during step {plan.step_id}: "
                                      f"{type(err).__name__}: {err}") from err
        if result is grpc.aio.EOF:
            self.drop()
            raise ExecutorUnavailable(f"executor {self.address} closed its Run stream")
        if result.step_id != plan.step_id:
            self.drop()
            raise ExecutorUnavailable(f"executor {self.address} answered step {result.step_id} "
                                      f"to plan {plan.step_id}")
        return result

    def drop(self) -> None:
        if self.call is not None:
            self.call.cancel()
        self.call = None

    async def close(self) -> None:
        self.drop()
        await self.channel.close()
