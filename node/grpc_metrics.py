"""A grpc.aio server interceptor that counts finished RPCs by method and status code.

It exports the series the gRPC ecosystem uses (``grpc_server_handled_total`` with
``grpc_service``, ``grpc_method`` and ``grpc_code`` labels) so that stock dashboards and alerts
for gRPC servers work on lowcomm nodes too.
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable

import grpc
from prometheus_client import Counter


def _code_name(context: grpc.aio.ServicerContext, default: grpc.StatusCode) -> str:
    code = context.code()
    if isinstance(code, grpc.StatusCode):
        return code.name
    if isinstance(code, int):  # some grpc versions report the raw integer
        for status in grpc.StatusCode:
            if status.value[0] == code:
                return status.name
    return default.name


class HandledCounter(grpc.aio.ServerInterceptor):
    def __init__(self, counter: Counter) -> None:
        self.counter = counter

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None:
            return handler
        service, _, method = details.method.lstrip("/").rpartition("/")

        def count(code: str) -> None:
            self.counter.labels(grpc_service=service, grpc_method=method, grpc_code=code).inc()

        def wrap_unary(behavior: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
            async def wrapped(request_or_iterator: Any, context: grpc.aio.ServicerContext) -> Any:
                try:
                    response = await behavior(request_or_iterator, context)
                except grpc.aio.AbortError:
                    count(_code_name(context, grpc.StatusCode.UNKNOWN))
                    raise
                except Exception:
                    count(grpc.StatusCode.UNKNOWN.name)
                    raise
                count(_code_name(context, grpc.StatusCode.OK))
                return response

            return wrapped

        def wrap_stream(behavior: Callable[..., Any]) -> Callable[..., Any]:
            async def wrapped(request_or_iterator: Any, context: grpc.aio.ServicerContext) -> Any:
                try:
                    async for item in behavior(request_or_iterator, context):
                        yield item
                except grpc.aio.AbortError:
                    count(_code_name(context, grpc.StatusCode.UNKNOWN))
                    raise
                except Exception:
                    count(grpc.StatusCode.UNKNOWN.name)
                    raise
                count(_code_name(context, grpc.StatusCode.OK))

            return wrapped

        kwargs = {"request_deserializer": handler.request_deserializer,
                  "response_serializer": handler.response_serializer}
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(wrap_unary(handler.unary_unary), **kwargs)
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(wrap_unary(handler.stream_unary), **kwargs)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(wrap_stream(handler.unary_stream), **kwargs)
        return grpc.stream_stream_rpc_method_handler(wrap_stream(handler.stream_stream), **kwargs)
