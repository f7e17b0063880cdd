"""What ``pagedkv serve`` waits on and hands its children: the readiness probes (a port that accepts connections, a
grpc health service that answers SERVING) and the per-run executor secret file."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import tempfile
from collections.abc import Iterator


@contextlib.contextmanager
def executor_secret_file() -> Iterator[str]:
    """A fresh secret for this run in a 0600 file inside a private (0700) temporary directory, removed at
    exit. (A SIGKILLed ``serve`` leaves the directory behind; the secret in it is never used again.)"""
    folder = tempfile.mkdtemp(prefix="pagedkv-serve-")
    try:
        path = os.path.join(folder, "executor-secret")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
        yield path
    finally:
        shutil.rmtree(folder, ignore_errors=True)


class ListeningProbe:
    """``probe()`` is True once something accepts TCP connections at ``address`` (HOST:PORT)."""

    def __init__(self, address: str) -> None:
        host, _, port = address.rpartition(":")
        self.target = (host.strip("[]"), int(port))

    def __call__(self) -> bool:
        import socket

        try:
            with socket.create_connection(self.target, timeout=1.0):
                return True
        except OSError:
            return False

    def close(self) -> None:
        pass


class HealthProbe:
    """``probe()`` is True once the grpc health service at ``address`` answers SERVING."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.channel = None

    def __call__(self) -> bool:
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        if self.channel is None:  # reconnect quickly: a server that is still loading is not yet listening
            self.channel = grpc.insecure_channel(self.address, options=[
                ("grpc.initial_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 200)])
        try:
            reply = health_pb2_grpc.HealthStub(self.channel).Check(health_pb2.HealthCheckRequest(), timeout=1.0)
        except grpc.RpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    def close(self) -> None:
        if self.channel is not None:
            self.channel.close()
            self.channel = None
