"""gRPC server reflection v1 (``grpc.reflection.v1.ServerReflection``) beside v1alpha on every pagedkv server
(grpc_common.add_health_and_reflection, which the scheduler and the executor both call): a raw v1 stub lists the
services and gets the file that declares the public API, as grpcurl and other v1-only tools ask. A real gRPC
server on loopback, in this process."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from google.protobuf import descriptor_pb2
from grpc_reflection.v1alpha import reflection_pb2 as alpha_pb2
from grpc_reflection.v1alpha import reflection_pb2_grpc as alpha_grpc

from pagedkv import grpc_common
from pagedkv.api.v1 import api_pb2
from pagedkv.reflection.v1 import reflection_pb2 as v1_pb2
from pagedkv.reflection.v1 import reflection_pb2_grpc as v1_grpc

pytestmark = pytest.mark.e2e

API_SERVICE = api_pb2.DESCRIPTOR.services_by_name["Generation"].full_name


async def _ask(port: int, requests: list) -> tuple[list, list]:
    """v1's answers and v1alpha's to the same requests."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        v1 = [r async for r in v1_grpc.ServerReflectionStub(channel).ServerReflectionInfo(iter(requests))]
        alpha_requests = [alpha_pb2.ServerReflectionRequest.FromString(r.SerializeToString()) for r in requests]
        alpha = [r async for r in alpha_grpc.ServerReflectionStub(channel).ServerReflectionInfo(iter(alpha_requests))]
    return v1, alpha


def test_v1_reflection_lists_services_and_describes_the_api():
    async def scenario():
        server = grpc_common.new_server()
        grpc_common.add_health_and_reflection(server, [API_SERVICE])
        port = grpc_common.bind(server, "127.0.0.1", 0)
        await server.start()
        try:
            return await _ask(port, [v1_pb2.ServerReflectionRequest(list_services=""),
                                     v1_pb2.ServerReflectionRequest(file_containing_symbol=API_SERVICE),
                                     v1_pb2.ServerReflectionRequest(file_containing_symbol="no.such.Symbol")])
        finally:
            await server.stop(0)

    (listed, described, missing), alpha = asyncio.run(scenario())
    names = {s.name for s in listed.list_services_response.service}
    assert {API_SERVICE, "grpc.health.v1.Health", "grpc.reflection.v1.ServerReflection",
            "grpc.reflection.v1alpha.ServerReflection"} <= names
    files = [descriptor_pb2.FileDescriptorProto.FromString(b)
             for b in described.file_descriptor_response.file_descriptor_proto]
    assert any(f.package == "pagedkv.api.v1" and any(s.name == "Generation" for s in f.service) for f in files)
    assert missing.error_response.error_code == grpc.StatusCode.NOT_FOUND.value[0]
    assert [a.SerializeToString() for a in alpha] == [v.SerializeToString() for v in (listed, described, missing)]
