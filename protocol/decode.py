"""Undecodable request bytes get INVALID_ARGUMENT, not grpc's UNKNOWN.

grpc parses each request with the method's ``request_deserializer`` before any handler runs, and
answers a parse failure with ``UNKNOWN`` ("Exception deserializing request"), which tells the
sender nothing and looks like a server bug. ``StrictDecodeInterceptor`` moves the parsing into
the handler: requests arrive as raw bytes and a message that is not a valid protobuf of the
method's type is refused with ``INVALID_ARGUMENT`` naming the method. It must be the innermost
interceptor (the last in the server's list) so that the others see the same parsed messages.
"""

from __future__ import annotations

from typing import Any, AsyncIterator, Awaitable, Callable

import grpc

_KINDS = (  # (attribute, builder, streaming request)
    ("unary_unary", grpc.unary_unary_rpc_method_handler, False),
    ("unary_stream", grpc.unary_stream_rpc_method_handler, False),
    ("stream_unary", grpc.stream_unary_rpc_method_handler, True),
    ("stream_stream", grpc.stream_stream_rpc_method_handler, True),
)


class StrictDecodeInterceptor(grpc.aio.ServerInterceptor):
    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or handler.request_deserializer is None:
            return handler
        for attr, build, stream_request in _KINDS:
            behavior = getattr(handler, attr)
            if behavior:
                wrapped = _wrap(behavior, handler.request_deserializer, details.method, stream_request,
                                attr.endswith("_stream"))
                return build(wrapped, request_deserializer=None, response_serializer=handler.response_serializer)
        return handler


def _wrap(behavior: Any, parse: Callable[[bytes], Any], method: str, stream_request: bool,
          stream_response: bool) -> Any:
    async def decode(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
        try:
            return parse(raw)
        except Exception as err:  # protobuf's DecodeError, or anything a custom parser raises
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"request to {method} is not a valid protobuf message ({len(raw)} bytes): {err}")

    async def requests(raw_iterator: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        async for raw in raw_iterator:
            yield await decode(raw, context)

    async def parsed(request: Any, context: grpc.aio.ServicerContext) -> Any:
        return requests(request, context) if stream_request else await decode(request, context)

    if stream_response:  # grpc.aio wants an async generator for a streaming response
        async def gen(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            async for response in behavior(await parsed(request, context), context):
                yield response
        return gen

    async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
        return await behavior(await parsed(request, context), context)
    return call
