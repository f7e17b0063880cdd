"""A request that does not decode gets INVALID_ARGUMENT, not UNKNOWN with a server-side traceback.

gRPC Python calls a method's ``request_deserializer`` (the generated ``FromString``) before the servicer
runs; a ``DecodeError`` there (corrupt wire format, a string field that is not UTF-8) would surface as
UNKNOWN. ``DecodeGuard`` is a server interceptor: it swaps in a deserializer that returns an
``Undecodable`` marker instead of raising, and a behaviour that answers the marker with INVALID_ARGUMENT.
The generated stubs stay as generated. Client-streaming methods (reflection) are left as they are.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

import grpc


@dataclass(frozen=True, slots=True)
class Undecodable:
    reason: str


def _tolerant(deserializer: Callable[[bytes], object]) -> Callable[[bytes], object]:
    def deserialize(raw: bytes) -> object:
        try:
            return deserializer(raw)
        except Exception as err:  # noqa: BLE001 - any parse failure is the client's
            return Undecodable(str(err))
    return deserialize


class DecodeGuard(grpc.aio.ServerInterceptor):
    """``on_undecodable(method, peer, reason)`` is called for each refused request (logs, metrics)."""

    def __init__(self, on_undecodable: Callable[[str, str, str], None] | None = None) -> None:
        self.on_undecodable = on_undecodable

    async def _refuse(self, method: str, request: Undecodable, context) -> None:
        if self.on_undecodable is not None:
            self.on_undecodable(method, context.peer(), request.reason)
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                            f"request: not a valid protobuf message for {method} ({request.reason}); "
                            "string fields must be UTF-8")

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        method = handler_call_details.method
        deserializer = _tolerant(handler.request_deserializer)
        if handler.unary_unary is not None:
            behaviour = handler.unary_unary

            async def unary(request, context):
                if isinstance(request, Undecodable):
                    await self._refuse(method, request, context)
                result = behaviour(request, context)
                return await result if inspect.isawaitable(result) else result
            return grpc.unary_unary_rpc_method_handler(unary, deserializer, handler.response_serializer)
        behaviour = handler.unary_stream

        async def stream(request, context):
            if isinstance(request, Undecodable):
                await self._refuse(method, request, context)
            result = behaviour(request, context)
            if inspect.isasyncgen(result):
                async for message in result:
                    yield message
            else:  # a behaviour that writes with context.write
                await result
        return grpc.unary_stream_rpc_method_handler(stream, deserializer, handler.response_serializer)
