"""Constraint compiles asked of the executors, bounded per tenant, and which executor holds which grammar.

The scheduler loads no grammar library: an executor compiles a constraint (``CheckConstraint``, in a worker process
under its CPU and memory limits) and then holds it for the scheduler's queued requests. ``GrammarGate``:

- asks only once a request has passed its queue bounds, at most ``per_tenant`` compiles of one tenant at a time
  (its other requests wait their turn; those in this phase count as queued for the queue bounds), one call per
  constraint however many requests bring it;
- remembers which executor (address and executor id: a restarted executor holds nothing) confirmed which
  constraint, for ``TRUST_S`` (executors hold a checked grammar longer, 30 minutes after its last check or use), so
  a request placed there goes straight to its planner; elsewhere it is held until that executor answers
  (``constraint_hold.py``): nothing compiles on an executor's step loop;
- charges the compiles' CPU to their tenants (``charge``).

Constraints carry their tenant's scope (``grammar_scope``): executors cache, compile and budget per scope.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Callable

import grpc

from pagedkv.bounds import InvalidRequest
from pagedkv.executor.v1 import executor_pb2 as pb

CHECK_TIMEOUT_S = 120.0  # the RPC's deadline (a compile is bounded by the executor's own limits well before it)
TRUST_S = 900.0  # an executor's confirmation is trusted this long (it holds the grammar 1,800 s: executor_svc.grammar)
DEFAULT_COMPILES_PER_TENANT = 2


def grammar_scope(tenant_id: str) -> str:
    """The opaque tag of a tenant's constraints on the executors (never its name)."""
    return hashlib.sha256(b"pagedkv grammar scope\x00" + tenant_id.encode()).hexdigest()[:32]


def grammar_key(c: pb.Constraint) -> bytes:
    """What the executors' cache keys a constraint on: all of it but its end tokens (each request's matcher's)."""
    key = pb.Constraint()
    key.CopyFrom(c)
    del key.end_token_ids[:]
    return key.SerializeToString(deterministic=True)


class GrammarGate:
    def __init__(self, per_tenant: int = DEFAULT_COMPILES_PER_TENANT,
                 charge: Callable[[str, float], None] = lambda _tenant, _cpu_s: None) -> None:
        self.per_tenant = max(1, per_tenant)
        self.charge = charge  # (tenant id, CPU seconds of a compile)
        self._ready: dict[str, tuple[str, dict[bytes, float]]] = {}  # address -> (executor id, key -> trusted until)
        self._inflight: dict[bytes, asyncio.Future] = {}
        self._slots: dict[str, asyncio.Semaphore] = {}
        self._compiling: dict[str, int] = {}

    def compiling(self, tenant_id: str) -> int:
        """The tenant's requests waiting for or in a compile (they count as queued)."""
        return self._compiling.get(tenant_id, 0)

    @property
    def compiling_total(self) -> int:
        return sum(self._compiling.values())

    def ready(self, address: str, executor_id: str, c: pb.Constraint) -> bool:
        """Whether the executor at ``address`` (the process ``executor_id``) holds ``c``'s grammar."""
        known = self._ready.get(address)
        return known is not None and known[0] == executor_id and known[1].get(grammar_key(c), 0.0) > time.monotonic()

    def _confirmed(self, address: str, executor_id: str, key: bytes) -> None:
        known = self._ready.get(address)
        if known is None or known[0] != executor_id:
            known = self._ready[address] = (executor_id, {})
        now = time.monotonic()
        if len(known[1]) > 4096:  # (drop what is no longer trusted)
            for k in [k for k, until in known[1].items() if until <= now]:
                del known[1][k]
        known[1][key] = now + TRUST_S

    async def compile(self, tenant_id: str, c: pb.Constraint, targets: list[tuple[object, str]],
                      source: str = "") -> None:
        """Has every executor of ``targets`` ((ExecutorClient, executor id) of those that take work) compile ``c``,
        unless it holds it; InvalidRequest with the first refusal (``source``: the request's field the constraint came
        from, named before it). An executor that cannot be asked (down) is skipped: a request placed there waits
        for its answer (``constraint_hold``)."""
        self._compiling[tenant_id] = self._compiling.get(tenant_id, 0) + 1
        try:
            key = grammar_key(c)
            while needed := [t for t in targets if not self.ready(t[0].address, t[1], c)]:
                running = self._inflight.get(key)
                if running is not None:  # (another request asked for it: its answer is this one's)
                    await asyncio.shield(running)
                    continue
                done = self._inflight[key] = asyncio.get_running_loop().create_future()
                done.add_done_callback(lambda f: f.cancelled() or f.exception())
                try:
                    async with self._slot(tenant_id):
                        await self._ask(tenant_id, c, key, needed, source)
                    done.set_result(None)
                    return  # (an executor that could not be asked is not asked again here)
                except InvalidRequest as err:
                    done.set_exception(err)
                    raise
                finally:
                    if not done.done():  # (cancelled: the client went away; a waiter asks again)
                        done.set_result(None)
                    del self._inflight[key]
        finally:
            self._compiling[tenant_id] -= 1
            if not self._compiling[tenant_id]:
                del self._compiling[tenant_id]

    def _slot(self, tenant_id: str) -> asyncio.Semaphore:
        slot = self._slots.get(tenant_id)
        if slot is None:
            slot = self._slots[tenant_id] = asyncio.Semaphore(self.per_tenant)
        return slot

    async def _ask(self, tenant_id: str, c: pb.Constraint, key: bytes, targets: list[tuple[object, str]],
                   source: str) -> None:
        calls = [client.stub.CheckConstraint(c, timeout=CHECK_TIMEOUT_S, metadata=client.metadata)
                 for client, _ in targets]
        answers = await asyncio.gather(*calls, return_exceptions=True)
        refusal = None
        for (client, executor_id), answer in zip(targets, answers):
            if isinstance(answer, pb.CheckConstraintResponse):
                if answer.compile_cpu_ms:
                    self.charge(tenant_id, answer.compile_cpu_ms / 1e3)
                if answer.error:
                    refusal = refusal or answer.error
                else:
                    self._confirmed(client.address, executor_id, key)
            elif not isinstance(answer, grpc.aio.AioRpcError):
                raise answer
        if refusal:
            raise InvalidRequest(f"{source}: {refusal}" if source else refusal)

    async def check(self, tenant_id: str, client, executor_id: str, c: pb.Constraint) -> str:
        """Has one executor hold ``c``: '' once it does, else its refusal. Raises grpc.aio.AioRpcError when it
        cannot be asked."""
        answer = await client.stub.CheckConstraint(c, timeout=CHECK_TIMEOUT_S, metadata=client.metadata)
        if answer.compile_cpu_ms:
            self.charge(tenant_id, answer.compile_cpu_ms / 1e3)
        if not answer.error:
            self._confirmed(client.address, executor_id, grammar_key(c))
        return answer.error
