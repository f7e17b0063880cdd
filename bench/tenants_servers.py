"""tenants.py's servers: their flags (and the tenants file of each noisy-neighbour configuration), a scheduler
driving several executors (``--executors``), and the set of servers by name, started together or one by one."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common import Server
from tenants_client import FLOOD, KEYS, QUIET

from pagedkv.tenancy import hash_key


def tenants_toml(config: str, args: argparse.Namespace) -> str:
    limits = []
    if config in ("fair+quota", "fair+quota+budget"):
        quota = repr(float(args.flood_quota)) if args.flood_quota <= 1 else str(int(args.flood_quota))  # pages
        limits += [f"page_quota = {quota}", f"max_concurrent_requests = {args.flood_concurrency}"]
    if config == "fair+quota+budget":
        limits += [f"page_budget = {args.flood_page_budget}", 'overflow = "window"']
    # admin: the bench reads the server's own counts (running, pages, preemptions), which a tenant does not see
    return "\n".join([f"[tenants.{FLOOD}]", f'keys = ["{hash_key(KEYS[FLOOD])}"]', "admin = true", *limits, "",
                      f"[tenants.{QUIET}]", f'keys = ["{hash_key(KEYS[QUIET])}"]', "admin = true", ""])


def common_args(args: argparse.Namespace, model: str, num_pages: int) -> list[str]:
    out = ["--model", model, "--dtype", "float32", "--block-size", str(args.block_size), "--num-pages",
           str(num_pages), "--max-num-seqs", str(args.max_num_seqs),
           "--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    if args.check_integrity:
        out.append("--check-integrity")
    return out


@dataclass(frozen=True, slots=True)
class ClusterSpec:
    """A scheduler driving ``executors`` executor processes, instead of one ``pagedkv serve``."""

    executors: int
    executor_args: tuple[str, ...]
    scheduler_args: tuple[str, ...]


def noisy_server_args(args: argparse.Namespace, model: str, config: str,
                      tenants_file: Path) -> list[str] | ClusterSpec:
    fairness = ["--no-fairness"] if config == "fcfs" else []
    if args.executors > 1:
        integrity = ["--check-integrity"] if args.check_integrity else []
        return ClusterSpec(args.executors, (
            "--model", model, "--dtype", "float32", "--block-size", str(args.block_size), "--num-pages",
            str(args.num_pages), "--threads", "1"), (
            "--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
            "--tenants-file", str(tenants_file), *fairness, *integrity))
    return [*common_args(args, model, args.num_pages), "--tenants-file", str(tenants_file), *fairness]


class ClusterServer:
    """``spec.executors`` executors (``pagedkv executor``, one torch thread each) and a scheduler driving them
    all, on free loopback ports; the same interface as ``Server``."""

    def __init__(self, spec: ClusterSpec, timeout: float = 600.0) -> None:
        from pagedkv.local_server import ServiceProcess

        self.procs = []
        try:
            self.procs += [ServiceProcess("executor", *spec.executor_args, timeout=timeout, wait=False)
                           for _ in range(spec.executors)]
            for p in self.procs:
                p.wait_ready(timeout)
            targets = [a for p in self.procs for a in ("--executor", p.address)]
            self.scheduler = ServiceProcess("scheduler", *targets, *spec.scheduler_args, timeout=timeout)
            self.procs.append(self.scheduler)
        except BaseException:
            self.stop()
            raise

    @property
    def address(self) -> str:
        return self.scheduler.address

    def log(self) -> str:
        return "\n".join(p.log() for p in self.procs)

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.stop()


def long_server_args(args: argparse.Namespace, model: str, run: str) -> list[str]:
    out = common_args(args, model, args.long_num_pages)
    if run == "window":
        out += ["--sliding-window", str(args.window), "--sink-tokens", str(args.sink)]
    return out


class Servers:
    """The bench's servers by name: started together up front, or each when first asked for."""

    def __init__(self, specs: dict[str, list[str] | ClusterSpec], together: bool) -> None:
        self.specs = specs
        self.started: dict[str, Server] = {}
        self.startup_s: dict[str, float] = {}
        if together and specs:
            t0 = time.perf_counter()
            with ThreadPoolExecutor(max_workers=len(specs)) as pool:
                futures = {name: pool.submit(self._start, name) for name in specs}
                errors = []
                for name, fut in futures.items():
                    try:
                        fut.result()
                    except Exception as err:  # noqa: BLE001  (stop the others, then report)
                        errors.append(f"{name}: {err}")
            if errors:
                self.stop_all()
                raise RuntimeError("server start-up failed:\n" + "\n".join(errors))
            print(f"started {len(specs)} servers together in {time.perf_counter() - t0:.1f}s", flush=True)

    def _start(self, name: str) -> Server:
        t0 = time.perf_counter()
        spec = self.specs[name]
        server = ClusterServer(spec) if isinstance(spec, ClusterSpec) else Server(spec)
        self.startup_s[name] = time.perf_counter() - t0
        self.started[name] = server
        return server

    def get(self, name: str) -> Server:
        return self.started[name] if name in self.started else self._start(name)

    def stop(self, name: str) -> None:
        server = self.started.pop(name, None)
        if server is not None:
            server.stop()

    def stop_all(self) -> None:
        for name in list(self.started):
            self.stop(name)


def run_on(servers: Servers, name: str, coro_fn) -> dict[str, Any]:
    """Runs one measured workload against the named server, then stops that server."""
    server = servers.get(name)
    try:
        return asyncio.run(coro_fn(server.address))
    except BaseException:
        print(server.log(), file=sys.stderr)
        raise
    finally:
        servers.stop(name)
