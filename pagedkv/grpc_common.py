"""What every pagedkv gRPC server has: health checking, reflection, generous message sizes."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

MAX_MESSAGE_BYTES = 64 << 20
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]

# An executor that vanishes without closing its connection (host down, network cut) is noticed by pings
# within ~15 s, even while no step is in flight; servers accept pings that often.
KEEPALIVE_OPTIONS = [
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]
SERVER_KEEPALIVE_OPTIONS = [
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
]


def new_server(max_receive_bytes: int = MAX_MESSAGE_BYTES, interceptors=()) -> grpc.aio.Server:
    """A server; ``max_receive_bytes`` bounds one request (gRPC refuses a larger one with RESOURCE_EXHAUSTED
    from its length prefix, before reading it)."""
    options = [*CHANNEL_OPTIONS, *SERVER_KEEPALIVE_OPTIONS]
    options = [o for o in options if o[0] != "grpc.max_receive_message_length"]
    options.append(("grpc.max_receive_message_length", max_receive_bytes))
    return grpc.aio.server(options=options, interceptors=list(interceptors))


def add_health_and_reflection(server: grpc.aio.Server, service_names: list[str]) -> health.aio.HealthServicer:
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    reflection.enable_server_reflection(
        [*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], server
    )
    return servicer


async def set_serving(servicer: health.aio.HealthServicer, service_names: list[str], serving: bool) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ["", *service_names]:
        await servicer.set(name, status)


def bind(server: grpc.aio.Server, host: str, port: int, credentials: grpc.ServerCredentials | None = None) -> int:
    """Listens on host:port, with TLS when ``credentials`` are given (pagedkv.security.server_credentials)."""
    address = f"{host}:{port}"
    bound = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    if bound == 0:
        raise OSError(f"--port {port}: cannot bind {host}:{port} (in use?)")
    return bound
