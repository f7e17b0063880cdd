"""Many executors behind one scheduler: membership, placement, migration.

Each executor has an ``Engine`` (engine.py) with its own ``Scheduler`` and page accounting. The cluster:

- keeps the set of executors in line with the configured addresses (``--executor`` entries, DNS names
  re-resolved periodically, and an optional executors file): new addresses get an engine, vanished ones
  are drained and dropped;
- places each new request on the executor with the longest prefix-cache hit for its tenant, then the
  least loaded one (pages in use, requests queued and running);
- re-places the requests of an executor that failed or drains: the prompt and the tokens already streamed
  are recomputed there, the sampler continues at the same draw (draws are numbered by output position),
  and the client stream goes on with no token lost or repeated;
- holds requests when no executor is up, for up to ``unplaced_timeout`` seconds, then ends them with an
  error;
- owns the tenants (``TenantLedger``): quotas, concurrency limits, reserves, fair shares and weighted service
  hold for the sum over its executors, and the API authenticates callers here, not through an executor.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable, Iterable
from functools import partial

from pagedkv.executor.v1 import executor_pb2 as pb
from pagedkv.tenancy import Tenants
from pagedkv.wire import EXECUTOR_PROTOCOL
from scheduler_svc import adapters, metrics
from scheduler_svc.adapter_api import sync_adapters
from scheduler_svc.adapter_registry import AdapterRegistry
from scheduler_svc.cluster_reports import ClusterReports
from scheduler_svc.engine import Engine
from scheduler_svc.engine_types import EngineHooks
from scheduler_svc.executor_client import ExecutorClient, ExecutorLink
from scheduler_svc.fit import FitLimits, limits_for
from scheduler_svc.grammar_gate import DEFAULT_COMPILES_PER_TENANT, GrammarGate
from scheduler_svc.outputs import Ending, deliver, final
from scheduler_svc.request import Finish, Request
from scheduler_svc.scheduler import Scheduler, SchedulerConfig
from scheduler_svc.tenant_ledger import TenantLedger
from scheduler_svc.unplaced import UnplacedQueue

# a DescribeResponse and the cluster's tenant ledger -> a planner for that executor, in that ledger
MakeScheduler = Callable[[object, TenantLedger], Scheduler]


def parse_address(entry: str, what: str = "--executor") -> tuple[str, int]:
    host, sep, port = entry.strip().rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{what} {entry!r}: expected HOST:PORT (port 1-65535)")
    return host, int(port)


def resolve(entries: Iterable[str]) -> set[str]:
    """HOST:PORT entries -> the set of IP:PORT addresses they name now (a DNS name may name several; IPv4
    when the name has any, else IPv6). Raises OSError when a name does not resolve."""
    out = set()
    for entry in entries:
        host, port = parse_address(entry)
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        v4 = [i[4][0] for i in infos if i[0] == socket.AF_INET]
        ips = v4 or [i[4][0] for i in infos if i[0] == socket.AF_INET6]
        out.update(f"{ip}:{port}" if ":" not in ip else f"[{ip}]:{port}" for ip in ips)
    return out


def read_executors_file(path: str) -> list[str]:
    """One HOST:PORT per line; blank lines and # comments ignored."""
    with open(path, encoding="utf-8") as f:
        lines = [line.split("#", 1)[0].strip() for line in f]
    entries = [line for line in lines if line]
    for line in entries:
        parse_address(line, f"executors file {path}:")
    return entries


class Cluster:
    def __init__(self, reference, make_scheduler: MakeScheduler, log, *,
                 step_timeout: float, check_every_step: bool = False, drain_timeout: float = 30.0,
                 unplaced_timeout: float = 30.0, link: ExecutorLink | None = None,
                 tenants: Tenants | None = None, async_scheduling: bool = True,
                 compiles_per_tenant: int = DEFAULT_COMPILES_PER_TENANT) -> None:
        self._reference = reference  # the first executor's DescribeResponse: every other must serve the same
        self._make_scheduler = make_scheduler
        self.ledger = TenantLedger(tenants)  # every executor's scheduler joins it
        self.log = log
        self.step_timeout = step_timeout
        self.check_every_step = check_every_step
        self.drain_timeout = drain_timeout
        self.async_scheduling = async_scheduling
        self.link = link or ExecutorLink()  # the secret and TLS of every executor connection
        self.engines: dict[str, Engine] = {}
        self.grammars = GrammarGate(compiles_per_tenant, self._charge_compile)  # constraints' compiles, who holds which
        self._clients: dict[str, ExecutorClient] = {}  # each engine's connection (by address, as engines)
        self._unplaced = UnplacedQueue(unplaced_timeout, log)  # requests no executor that is up can hold
        self.arrivals = 0
        self.any_up = asyncio.Event()
        self._reports = ClusterReports(self.engines, self.ledger, lambda: len(self._unplaced),
                                       lambda: self._adapters.loaded())
        self._largest: Engine | None = None  # the engine whose limits the API validates by
        self._expiry: asyncio.Task | None = None
        self._adapters = AdapterRegistry(reference)  # the LoRA adapters served (adapter_api.py loads more)
        self._hooks = EngineHooks(make_scheduler=lambda d: make_scheduler(d, self.ledger),
                                  check_compatible=self.check_compatible,
                                  up=self.engine_up, down=self.engine_down, relocate=self.relocate,
                                  gauges=self._reports.update_gauges, owner_of=self._adapters.owner_of,
                                  sync_adapters=partial(sync_adapters, self._adapters))

    # ---- membership ----------------------------------------------------------------------------
    def start(self) -> None:
        self._expiry = asyncio.create_task(self._expire(), name="unplaced expiry")

    def set_addresses(self, addresses: set[str]) -> None:
        """Adds an engine per new address; drains and drops those no longer listed."""
        for address in sorted(addresses - self.engines.keys()):
            client = self._clients[address] = ExecutorClient(address, self.step_timeout, self.link)
            engine = Engine(self._hooks, client, self.log,
                            check_every_step=self.check_every_step, drain_timeout=self.drain_timeout,
                            async_scheduling=self.async_scheduling, grammars=self.grammars)
            self.engines[address] = engine
            engine.start()
            self.log.info("executor_added", executor=address)
        for address in sorted(self.engines.keys() - addresses):
            engine = self.engines[address]
            if not engine.removed:
                self.log.info("executor_removed", executor=address, state=engine.state.value)
                engine.begin_removal()
        for address, engine in list(self.engines.items()):  # drained and stopped for good
            if engine.removed and engine.stopped:
                del self.engines[address]
                self._clients.pop(address, None)
                if engine.scheduler is not None:
                    engine.scheduler.serving(False)
                asyncio.ensure_future(engine.stop())
                self._reports.forget(address)
        self._reports.update_gauges(force=True)

    async def stop(self) -> None:
        if self._expiry is not None:
            self._expiry.cancel()
        await asyncio.gather(*(e.stop() for e in self.engines.values()), return_exceptions=True)

    def check_compatible(self, describe) -> str:
        """Why an executor cannot join (another model, vocabulary or block size, other LoRA adapters), or ''.

        Another KV cache dtype (--kv-cache-dtype) is no reason: pages never move between executors (a moved
        request is recomputed on its new executor, whose page count already reflects its bytes per token),
        so executors with fp8, int8 and full-precision pages serve side by side."""
        if describe.protocol != EXECUTOR_PROTOCOL:
            return (f"protocol {describe.protocol} is not this scheduler's {EXECUTOR_PROTOCOL} (the executor "
                    f"runs another pagedkv version: run the same version on both sides)")
        ref = self._reference
        for field in ("model", "vocab_size", "block_size", "max_position_embeddings"):
            if getattr(describe, field) != getattr(ref, field):
                return (f"{field} {getattr(describe, field)!r} differs from the other executors' "
                        f"{getattr(ref, field)!r}")
        return adapters.mismatch(describe, ref)

    def engine_down(self, engine: Engine) -> None:
        """Its requests have left (moved or ended): until it is up again its pages count for no tenant, so the
        quotas, reserves and fair shares are of the executors that serve."""
        engine.scheduler.serving(False)
        self.apply_limits()

    def apply_limits(self) -> int:
        """The tenants' settings or the executors that serve changed: every live request gets its limits again
        (``Scheduler.set_tenants``), as at admission; those that no longer fit end with an error. Returns how
        many ended."""
        ended = 0
        for engine in self.engines.values():
            if engine.scheduler is None:
                continue
            outputs = engine.scheduler.set_tenants()
            deliver(outputs)
            ended += len(outputs)
            engine.wake_up()
        return ended

    def engine_up(self, engine: Engine) -> None:
        engine.scheduler.serving(True)  # (again, after it was down; a new one is in the ledger already)
        self.apply_limits()
        self.any_up.set()
        self._pick_largest()
        for req, deadline in reversed(self._unplaced.take_all()):  # each goes to the front: the oldest ends up first
            self._place(req, front=True, deadline=deadline)
        self._reports.update_gauges(force=True)

    # ---- what the API uses -----------------------------------------------------------------------
    def _pick_largest(self) -> Engine | None:
        """The engine whose limits the API validates against: the largest executor that takes work (every
        executor serves the same model; a request too long for a small one goes to a larger). With none
        connected right now, the last one seen (its settings still hold)."""
        candidates = [e for e in self.engines.values() if e.scheduler is not None]
        up = [e for e in candidates if e.accepts] or candidates
        if up:
            self._largest = max(up, key=lambda e: e.scheduler.snapshot().pool.num_pages)
        return self._largest

    @property
    def reference(self) -> pb.DescribeResponse:
        """The first executor's DescribeResponse (the model, vocabulary and block size every executor serves)."""
        return self._reference

    @property
    def adapters(self) -> AdapterRegistry:
        """The LoRA adapters served: start-up and run-time ones (adapter_registry.py)."""
        return self._adapters

    @property
    def reports(self) -> ClusterReports:
        """Snapshots, the executors' rows of ModelInfo, peak resets, gauges (cluster_reports.py)."""
        return self._reports

    @property
    def tenants(self) -> Tenants:
        return self.ledger.tenants

    @property
    def block_size(self) -> int:
        return self._reference.block_size

    def fit_limits(self, tenant_id: str) -> FitLimits:
        """What one request of the tenant may hold, for the API to shape and check it: the largest executor's
        (capacity 0 before any joined)."""
        engine = self._pick_largest()
        if engine is not None:
            return engine.scheduler.fit_limits(tenant_id)
        return limits_for(tenant_id, 0, self._reference.block_size, SchedulerConfig())

    @property
    def available(self) -> bool:
        return any(e.accepts for e in self.engines.values())

    def grammar_targets(self) -> list[tuple[ExecutorClient, str]]:
        """The connections to the executors that take work, with their executor ids (structured outputs asks them to
        compile first: GrammarGate)."""
        return [(c, e.executor_id) for address, e in self.engines.items()
                if e.accepts and (c := self._clients.get(address))]

    async def compile_constraint(self, tenant_id: str, constraint, source: str = "") -> None:
        """Has the executors that take work compile a request's constraint before it is placed (GrammarGate.compile);
        InvalidRequest naming the field when one refuses it."""
        await self.grammars.compile(tenant_id, constraint, self.grammar_targets(), source)

    def compiling(self, tenant_id: str) -> int:
        """The tenant's requests waiting for or in their constraint's compile."""
        return self.grammars.compiling(tenant_id)

    def _charge_compile(self, tenant_id: str, cpu_s: float) -> None:
        self.ledger.charge_compile(tenant_id, cpu_s)
        metrics.GRAMMAR_CPU_SECONDS.labels(tenant_id, "compile").inc(cpu_s)

    def next_arrival(self) -> int:
        self.arrivals += 1
        return self.arrivals

    def queued(self, tenant_id: str) -> tuple[int, int]:
        """Requests waiting to start (in an executor's wait queue, waiting for or in their constraint's compile, or
        held while no executor can take them): the tenant's and everyone's (the queue bounds, ``queue_bounds.py``)."""
        mine, total = self.ledger.queued(tenant_id)
        mine, total = mine + self.grammars.compiling(tenant_id), total + self.grammars.compiling_total
        held_mine, held = self._unplaced.queued(tenant_id)
        return mine + held_mine, total + held

    def add_request(self, req: Request, count_prompt: bool = True) -> None:
        """A new request (``count_prompt`` False: another fork of a resumed one, whose prompt was counted)."""
        if count_prompt:
            metrics.PROMPT_TOKENS.inc(len(req.prompt_ids))
        self._place(req)

    def abort(self, group: str) -> None:
        for engine in self.engines.values():
            engine.abort(group)
        self._unplaced.abort(group)

    def relocate(self, reqs: list[Request], exclude: Engine) -> None:
        """Requests taken from an executor (failed or draining): each goes to another, ahead of new work."""
        for req in reversed(reqs):  # each goes to the front: the oldest ends up first
            self._place(req, front=True, exclude=exclude)

    def fail_all(self, error: str) -> None:
        """Ends every live request's stream with an error; only once the engines are stopped (shutdown)."""
        for e in self._reports.reporting(live=False):
            deliver([(r, final(r, Finish.ABORT, error=error, ending=Ending.CUT)) for r in e.scheduler.live_requests()])
        self._unplaced.fail(lambda _deadline: True, error)

    def set_tenants(self, path: str) -> int:
        """Reloads the tenants file, checked against the pages of every executor not removed, up or down (an
        executor down for a while does not make a file for the whole cluster wrong; one never up yet counts as
        big as the first, as at start-up), then fitted to those of the executors that serve
        (``TenantLedger.resize``); returns how many live requests no longer fit and ended. Raises InvalidTenant."""
        ref = self._reference.num_device_pages
        pages = sum(e.scheduler.snapshot().pool.num_pages if e.scheduler is not None else ref
                    for e in self.engines.values() if not e.removed)
        self.ledger.set_tenants(Tenants.load(path, pages or ref))
        self.ledger.resize()
        return self.apply_limits()

    # ---- placement -----------------------------------------------------------------------------
    def _place(self, req: Request, front: bool = False, exclude: Engine | None = None,
               deadline: float | None = None) -> None:
        engine = self._best(req, exclude)
        if engine is None:
            self._unplaced.hold(req, front, deadline)
            return
        engine.add_request(req, front=front)

    def _best(self, req: Request, exclude: Engine | None) -> Engine | None:
        """Among the executors that can hold the request: the longest prefix-cache hit for its tenant first,
        then the least loaded."""
        best, best_key = None, None
        for engine in self.engines.values():
            if engine is exclude or not engine.accepts:
                continue
            hit = engine.scheduler.placement(req)
            if hit is None:
                continue
            key = (hit, -engine.scheduler.snapshot().load, -engine.info().steps)
            if best_key is None or key > best_key:
                best, best_key = engine, key
        return best

    async def _expire(self) -> None:
        """Every quarter second: idle engines with a retention due are woken up; held requests past their deadline
        end (``UnplacedQueue.expire``)."""
        while True:
            await asyncio.sleep(0.25)
            now = time.monotonic()
            for e in [e for e in self.engines.values() if e.scheduler is not None and e.scheduler.kv_expiry_due(now)]:
                e.wake_up()  # (idle: its next plan ends the retentions and zeroes their pages)
            self._unplaced.expire(now)
