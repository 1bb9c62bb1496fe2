"""The server side of sidecar.stamp: an interceptor that sends the sidecar's identity as the initial
metadata of every call, before the handler runs (so a refusal carries it too), and again in its
trailing metadata: a stream that ends without a message may go out as trailers only, and under
load grpc then sent no initial metadata at all."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc

from sidecar.stamp import KEY

Req = TypeVar("Req")
Resp = TypeVar("Resp")


class Stamp(grpc.aio.ServerInterceptor):
    """Sends the identity before anything else on every call the server handles."""

    def __init__(self, identity: str) -> None:
        self._md = ((KEY, identity),)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Req, Resp] | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Req, Resp] | None:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        md = self._md
        # The aio server calls coroutines and async generators here (the stubs know only the sync
        # server's plain callables).
        inner: Any = handler.unary_unary or handler.unary_stream
        if handler.unary_unary is not None:

            async def unary(request: Any, context: Any) -> Any:
                context.set_trailing_metadata(md)
                await context.send_initial_metadata(md)
                return await inner(request, context)

            made: Any = grpc.unary_unary_rpc_method_handler(
                unary,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
            return made  # type: ignore[no-any-return]
        if handler.unary_stream is not None:

            async def stream(request: Any, context: Any) -> AsyncIterator[Any]:
                context.set_trailing_metadata(md)
                await context.send_initial_metadata(md)
                async for item in inner(request, context):
                    yield item

            made = grpc.unary_stream_rpc_method_handler(
                stream,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
            return made  # type: ignore[no-any-return]
        return handler  # no client-streaming calls in the contract
