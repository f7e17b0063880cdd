"""Ports: a port in use fails a server's bind, naming the port, instead of being shared (grpc binds with
SO_REUSEPORT unless told not to, and the kernel then splits connections between the two servers: a client of the
scheduler got an executor's answers); `pagedkv serve` picks its executor's port outside the ones its other
children are about to bind."""

from __future__ import annotations

import asyncio

import pytest

from pagedkv import grpc_common
from pagedkv.cli import free_port

pytestmark = pytest.mark.e2e


def test_a_second_server_on_a_port_in_use_fails_naming_the_port():
    async def main():
        port = free_port()
        first = grpc_common.new_server()
        grpc_common.bind(first, "127.0.0.1", port)
        await first.start()
        try:
            with pytest.raises(OSError, match=f"--port {port}: cannot bind 127.0.0.1:{port} \\(in use\\?\\)"):
                grpc_common.bind(grpc_common.new_server(), "127.0.0.1", port)
        finally:
            await first.stop(None)
    asyncio.run(main())


def test_free_port_avoids_the_ports_it_is_given():
    seen = {free_port() for _ in range(20)}
    assert all(free_port(avoid=seen) not in seen for _ in range(20))
