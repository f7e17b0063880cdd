"""The executor process: its port's security, start-up (startup.build), health, and the drain on SIGTERM.

The Run stream itself is service.py's (ExecutorService); the flags are args.py's.
"""

from __future__ import annotations

import asyncio
import os
import signal

import grpc

from executor_svc import metrics
from executor_svc.service import ExecutorService
from executor_svc.startup import build
from pagedkv import grpc_common, logs, runtime, security
from pagedkv.executor.v1 import executor_pb2 as pb
from pagedkv.executor.v1 import executor_pb2_grpc as pb_grpc

SERVICE = pb.DESCRIPTOR.services_by_name["Executor"].full_name


def link_security(args, log) -> tuple[list, grpc.ServerCredentials | None]:
    """The interceptors (the secret check) and TLS credentials of the executor's port, checked before the
    model loads: an executor with no secret refuses to start unless --insecure."""
    secret = security.load_executor_secret(args.executor_secret_file)
    credentials = security.server_credentials(args.tls_cert, args.tls_key)
    if secret:
        return [security.SecretInterceptor(secret, log)], credentials
    if not args.insecure:
        raise ValueError(f"no executor secret: give {security.SECRET_FILE_FLAG} PATH (or set "
                         f"${security.EXECUTOR_SECRET_ENV}) with the secret your scheduler holds, so that only it "
                         "can drive this executor; --insecure runs without one (development only)")
    exposed = not security.is_loopback(args.host)
    (log.error if exposed else log.warning)(
        "executor_unauthenticated", address=f"{args.host}:{args.port}", exposed_beyond_loopback=exposed,
        risk="--insecure: any process that reaches this port can drive this executor and read what its pages "
        "hold" + (", from other machines too" if exposed else " (local processes)"),
        hint=f"development only; give {security.SECRET_FILE_FLAG} in production")
    return [], credentials


async def serve(args) -> None:
    log = logs.configure("executor", json=logs.wants_json(args.log_format), level=args.log_level)
    interceptors, credentials = link_security(args, log)
    runner, describe = build(args, log)
    server = grpc_common.new_server(interceptors=interceptors)
    service = ExecutorService(runner, describe, log)
    metrics.DEVICE_PAGES.set(describe.num_device_pages)
    metrics.HOST_PAGES.set(describe.num_host_pages)
    for adapter in describe.adapters:
        metrics.ADAPTER_PAGES.labels(adapter.name).set(adapter.num_pages)
    pb_grpc.add_ExecutorServicer_to_server(service, server)
    health = grpc_common.add_health_and_reflection(server, [SERVICE])
    port = grpc_common.bind(server, args.host, args.port, credentials)
    security.warn_if_exposed(log, "executor", args.host, port, tls=credentials is not None)
    if args.metrics_port:
        import prometheus_client

        prometheus_client.start_http_server(args.metrics_port, addr=args.metrics_host or args.host)
    runtime.settle_gc()  # (the model's modules and parameters, frozen; young collections less often: as the scheduler)
    await server.start()
    await grpc_common.set_serving(health, [SERVICE], True)
    log.info("executor_ready", address=f"{args.host}:{port}", pid=os.getpid(), tls=credentials is not None,
             authenticated=bool(interceptors))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    # Drain: the scheduler moves this executor's requests to others (or lets them finish), then closes the
    # stream; past --drain-timeout the executor exits anyway and the scheduler recomputes what was left.
    await grpc_common.set_serving(health, [SERVICE], False)
    service.start_drain()
    stop.clear()  # a second signal: exit now
    log.info("executor_draining", requests=len(runner.requests), drain_timeout_s=args.drain_timeout)
    waits = [asyncio.ensure_future(service.detached.wait()), asyncio.ensure_future(stop.wait())]
    done, _ = await asyncio.wait(waits, timeout=args.drain_timeout, return_when=asyncio.FIRST_COMPLETED)
    for w in waits:
        w.cancel()
    drained = service.detached.is_set()
    await server.stop(grace=1.0)
    if runner.mirror.grammars is not None:
        runner.mirror.grammars.close()  # (its compile workers end with it)
    log.info("executor_stopped", drained=drained, requests_left=len(runner.requests))
