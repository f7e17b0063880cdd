"""What every pagedkv gRPC server has: health checking, reflection (v1 and v1alpha), generous message sizes."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from grpc_reflection.v1alpha import reflection_pb2 as reflection_v1alpha_pb2

from pagedkv.reflection.v1 import reflection_pb2 as reflection_v1_pb2

MAX_MESSAGE_BYTES = 64 << 20
# The public API's refusal of a request because a queue bound was reached (RESOURCE_EXHAUSTED): its message
# starts with this, then names the bound. It is the one RESOURCE_EXHAUSTED worth retrying (HTTP 429 with
# Retry-After); gRPC's own "Received message larger than max" (a request too big) never is.
QUEUE_FULL_PREFIX = "queue full: "
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]

# ---- keepalive: one ping policy for every link (grpc's doc/keepalive.md) ------------------------------------
# Clients (the scheduler's executor links, pagedkv.client.Client) ping a connection that has been silent for
# PING_INTERVAL_MS, with or without a call in flight, and close it when no ack comes within PING_TIMEOUT_MS:
# a peer that vanished without closing its connection (host down, network cut, SIGSTOP) is noticed within
# DEAD_PEER_BOUND_S of the last bytes it sent. The scheduler then logs executor_failed and moves the requests.
# Every ping obeys that timeout, not only keepalive ones. While data flows, grpc also sends flow-control
# (BDP) pings, one at a time; an unanswered one held the keepalive ping back until grpc's own 1-minute ping
# timeout (measured: 60 s to notice a stopped executor mid-stream; 5 s with this). Pings are answered by
# grpc's threads, so a long step on a busy executor is not silence.
# Servers accept a ping every MIN_PING_INTERVAL_MS on any connection (permit_without_calls: the 2-hour rule
# for idle connections does not apply). That is half the clients' interval, so timer slack never makes a
# strike. A client pinging faster gets MAX_PING_STRIKES strikes, then GOAWAY too_many_pings. grpc then
# doubles that client's interval for good, so the two ends must agree: tests/unit/test_links_keepalive.py checks.
# Beware: grpc ignores unknown option names silently. The server's is min_ping_interval_without_data_ms
# (GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS), not "min_recv_...". Spelt that way it kept the
# 5-minute default, and every idle link died after ~30 s.
PING_INTERVAL_MS = 10_000
PING_TIMEOUT_MS = 5_000
DEAD_PEER_BOUND_S = (PING_INTERVAL_MS + PING_TIMEOUT_MS) / 1000
MIN_PING_INTERVAL_MS = PING_INTERVAL_MS // 2
MAX_PING_STRIKES = 2
KEEPALIVE_OPTIONS = [
    ("grpc.keepalive_time_ms", PING_INTERVAL_MS),
    ("grpc.keepalive_timeout_ms", PING_TIMEOUT_MS),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),  # default 2: pings would stop on a quiet stream
    ("grpc.http2.ping_timeout_ms", PING_TIMEOUT_MS),  # default 1 minute
]
SERVER_KEEPALIVE_OPTIONS = [
    ("grpc.http2.min_ping_interval_without_data_ms", MIN_PING_INTERVAL_MS),
    ("grpc.http2.max_ping_strikes", MAX_PING_STRIKES),
    ("grpc.keepalive_permit_without_calls", 1),
]


def new_server(max_receive_bytes: int = MAX_MESSAGE_BYTES, interceptors=()) -> grpc.aio.Server:
    """A server; ``max_receive_bytes`` bounds one request (gRPC refuses a larger one with RESOURCE_EXHAUSTED
    from its length prefix, before reading it)."""
    options = [*CHANNEL_OPTIONS, *SERVER_KEEPALIVE_OPTIONS]
    options = [o for o in options if o[0] != "grpc.max_receive_message_length"]
    options.append(("grpc.max_receive_message_length", max_receive_bytes))
    # NOTE: grpc binds with SO_REUSEPORT by default: a second server on a port in use then binds too, and the
    # kernel splits new connections between the two (a client of one gets answers from the other). A port in use
    # must fail the bind instead (bind() names it).
    options.append(("grpc.so_reuseport", 0))
    return grpc.aio.server(options=options, interceptors=list(interceptors))


# gRPC reflection under both names: v1alpha (grpcio-reflection's) and v1, which tools now ask for first.
# grpcio-reflection ships only v1alpha; v1's messages are the same field for field (proto/pagedkv/reflection/v1),
# so v1 is served by v1alpha's servicer, its bytes read and written as v1alpha's messages.
REFLECTION_V1_SERVICE = reflection_v1_pb2.DESCRIPTOR.services_by_name["ServerReflection"].full_name


def add_health_and_reflection(server: grpc.aio.Server, service_names: list[str]) -> health.aio.HealthServicer:
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    names = [*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME, REFLECTION_V1_SERVICE]
    reflector = reflection.aio.ReflectionServicer(names)
    reflection.enable_server_reflection(names, server)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(REFLECTION_V1_SERVICE, {
        "ServerReflectionInfo": grpc.stream_stream_rpc_method_handler(
            reflector.ServerReflectionInfo,
            request_deserializer=reflection_v1alpha_pb2.ServerReflectionRequest.FromString,
            response_serializer=reflection_v1alpha_pb2.ServerReflectionResponse.SerializeToString),
    }),))
    return servicer


async def set_serving(servicer: health.aio.HealthServicer, service_names: list[str], serving: bool) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ["", *service_names]:
        await servicer.set(name, status)


def bind(server: grpc.aio.Server, host: str, port: int, credentials: grpc.ServerCredentials | None = None) -> int:
    """Listens on host:port, with TLS when ``credentials`` are given (pagedkv.security.server_credentials)."""
    address = f"{host}:{port}"
    try:
        bound = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    except RuntimeError:  # (grpc's "Failed to bind")
        bound = 0
    if bound == 0:
        raise OSError(f"--port {port}: cannot bind {host}:{port} (in use?)")
    return bound
