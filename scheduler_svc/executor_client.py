"""The scheduler's connection to one executor: Describe, then one Run stream of plans."""

from __future__ import annotations

import asyncio
import secrets
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedkv.executor.v1 import executor_pb2 as pb
from pagedkv.executor.v1 import executor_pb2_grpc as pb_grpc
from pagedkv.grpc_common import CHANNEL_OPTIONS, KEEPALIVE_OPTIONS
from pagedkv.security import SECRET_FILE_FLAG, bearer_metadata, open_channel
from pagedkv.wire import PAGES_HEADER, PAGES_KEPT, SESSION_HEADER


class ExecutorUnavailable(Exception):
    pass


class ExecutorAuthFailed(ExecutorUnavailable):
    """The executor refused this scheduler's secret (UNAUTHENTICATED): retrying will not help."""


@dataclass(frozen=True, slots=True)
class ExecutorLink:
    """How the scheduler reaches its executors: the shared secret it presents, and TLS (the CA that signed the
    executors' certificates, and the name to check them against when it is not the address's host)."""

    secret: str = ""
    tls_ca: str = ""
    tls_server_name: str = ""


SERVICE = pb.DESCRIPTOR.services_by_name["Executor"].full_name
ATTACH_TIMEOUT = 10.0  # seconds to wait for that answer (an executor waits up to 5 s for its previous stream)
# NOTE: grpc's default reconnect backoff (1 s, x1.6 per try, up to 2 min) would see an executor that is still loading
# (pagedkv serve starts both at once) or restarting seconds after it listens: try every 0.1 s, backing off to 0.5 s.
RECONNECT_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 500)]


class ExecutorClient:
    def __init__(self, address: str, step_timeout: float, link: ExecutorLink | None = None) -> None:
        self._address = address
        self.step_timeout = step_timeout
        self.link = link or ExecutorLink()
        self.metadata = bearer_metadata(self.link.secret)  # on every RPC: Describe, Run and health
        self.channel = open_channel(address, [*CHANNEL_OPTIONS, *KEEPALIVE_OPTIONS, *RECONNECT_OPTIONS],
                                    self.link.tls_ca, self.link.tls_server_name, ca_flag="--executor-tls-ca")
        self.stub = pb_grpc.ExecutorStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)
        # The Run stream's session id (SESSION_HEADER): one per scheduler process and executor link, so that a
        # reconnect finds the pages it left.
        self.session_id = secrets.token_hex(16)
        self._pages_kept = False  # the executor's answer on the current Run stream
        self._call = None
        self._read: asyncio.Future | None = None  # a read of the Run stream started by result_within, not taken yet
        self.describe: pb.DescribeResponse | None = None

    @property
    def address(self) -> str:
        return self._address

    @property
    def pages_kept(self) -> bool:
        """The executor kept this session's pages as they were (its answer on the current Run stream)."""
        return self._pages_kept

    @property
    def has_stream(self) -> bool:
        """A Run stream was opened and not dropped (it may have ended)."""
        return self._call is not None

    @property
    def stream_ended(self) -> bool:
        """No Run stream, or it ended."""
        return self._call is None or self._call.done()

    def on_stream_end(self, callback) -> None:
        """Calls ``callback()`` when the current Run stream ends."""
        self._call.add_done_callback(lambda _call: callback())

    async def connect(self, timeout: float) -> pb.DescribeResponse:
        """Waits up to ``timeout`` seconds for the executor, reads its description, opens the Run stream and
        reads whether the executor kept this session's pages (``pages_kept``)."""
        await self.probe(timeout)
        self._call = self.stub.Run(metadata=(*self.metadata, (SESSION_HEADER, self.session_id)))
        try:
            answer = await asyncio.wait_for(asyncio.shield(self._call.initial_metadata()), ATTACH_TIMEOUT)
        except (asyncio.TimeoutError, grpc.aio.AioRpcError):
            answer = None  # refused, or no answer: a failed stream is noticed by the engine
        # (anything but PAGES_KEPT counts as fresh: forgetting the prefix cache is always safe)
        self._pages_kept = answer is not None and dict(answer).get(PAGES_HEADER) == PAGES_KEPT
        return self.describe

    async def probe(self, timeout: float) -> pb.DescribeResponse:
        """Waits up to ``timeout`` seconds for a serving executor and reads its description."""
        try:
            await asyncio.wait_for(self.channel.channel_ready(), timeout)
        except asyncio.TimeoutError:
            raise ExecutorUnavailable(f"executor {self.address} not reachable within {timeout:.0f}s"
                                      f"{await self._why_not_ready()}") from None
        try:
            health = await self.health.Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=timeout,
                                             metadata=self.metadata)
            self.describe = await self.stub.Describe(pb.DescribeRequest(), timeout=timeout, metadata=self.metadata)
        except grpc.aio.AioRpcError as err:
            if err.code() == grpc.StatusCode.UNAUTHENTICATED:
                raise ExecutorAuthFailed(self._auth_failure(err)) from err
            raise ExecutorUnavailable(f"executor {self.address} not reachable within {timeout:.0f}s: {err}") from err
        if health.status != health_pb2.HealthCheckResponse.SERVING:  # starting up or draining
            raise ExecutorUnavailable(f"executor {self.address} is not serving (health: "
                                      f"{health_pb2.HealthCheckResponse.ServingStatus.Name(health.status)})")
        return self.describe

    def _auth_failure(self, err: grpc.aio.AioRpcError) -> str:
        mine = ("this scheduler sent the secret from its --executor-secret-file / $PAGEDKV_EXECUTOR_SECRET, and the "
                "executor's differs" if self.link.secret else
                f"this scheduler has no executor secret: give it {SECRET_FILE_FLAG} with the executor's")
        return f"executor {self.address} refused this scheduler: authentication failed ({mine}): {err.details()}"

    async def _why_not_ready(self) -> str:
        """The channel's last connection error (refused, TLS handshake or certificate name), if it has one."""
        try:
            await self.health.Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=0.5,
                                    metadata=self.metadata)
        except grpc.aio.AioRpcError as err:
            if err.code() == grpc.StatusCode.UNAVAILABLE:
                return f": {err.details()}"
        return ""

    async def step(self, plan: pb.StepPlan) -> pb.StepResult:
        """Sends a plan and reads its result (one plan in flight)."""
        await self.send(plan)
        return await self.receive(plan.step_id)

    async def send(self, plan: pb.StepPlan) -> None:
        """Writes a plan on the Run stream. With async scheduling the next goes before the last result is read:
        the executor finds it waiting when it ends a step."""
        if self._call is None:
            raise ExecutorUnavailable(f"executor {self.address}: no open Run stream")
        try:
            # NOTE: the write has a deadline too: a hung executor that stops reading blocks it on flow control.
            await asyncio.wait_for(self._call.write(plan), self.step_timeout)
        except (asyncio.TimeoutError, grpc.aio.AioRpcError, grpc.aio.UsageError) as err:
            self.drop()
            raise ExecutorUnavailable(f"executor {self.address} failed during step {plan.step_id}: "
                                      f"{type(err).__name__}: {err}") from err

    async def result_within(self, timeout: float) -> bool:
        """Whether the next result arrives within ``timeout`` seconds. It stays unread: ``receive`` takes it."""
        if self._call is None:
            return True  # (receive says why)
        if self._read is None:
            self._read = asyncio.ensure_future(self._call.read())
        done, _ = await asyncio.wait({self._read}, timeout=timeout)
        return bool(done)

    async def receive(self, step_id: int) -> pb.StepResult:
        """Reads the result of the oldest plan sent (``step_id``): results come back in order."""
        if self._call is None:
            raise ExecutorUnavailable(f"executor {self.address}: no open Run stream")
        read, self._read = self._read, None
        try:
            result = await asyncio.wait_for(read if read is not None else self._call.read(), self.step_timeout)
        except (asyncio.TimeoutError, grpc.aio.AioRpcError, grpc.aio.UsageError) as err:
            self.drop()
            raise ExecutorUnavailable(f"executor {self.address} failed during step {step_id}: "
                                      f"{type(err).__name__}: {err}") from err
        if result is grpc.aio.EOF:
            self.drop()
            raise ExecutorUnavailable(f"executor {self.address} closed its Run stream")
        if result.step_id != step_id:
            self.drop()
            raise ExecutorUnavailable(f"executor {self.address} answered step {result.step_id} to plan {step_id}")
        return result

    def drop(self) -> None:
        if self._read is not None:
            self._read.cancel()
            self._read = None
        if self._call is not None:
            self._call.cancel()
        self._call = None

    async def close(self) -> None:
        self.drop()
        await self.channel.close()
