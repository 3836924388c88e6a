"""Request messages parsed inside the method handler on our grpc.aio servers, so bytes that are not the method's
message end INVALID_ARGUMENT, saying so. grpc.aio parses a unary request before the handler runs and reports the
deserializer's DecodeError as UNKNOWN ("Unexpected <class DecodeError>"), a server error for a client's mistake.

`RequestDecodeInterceptor` hands grpc a handler of the same kind whose request is the raw bytes (a unary
request) and parses them first thing in the wrapped behavior, async or sync (a generated base class's
unimplemented methods are sync). A streamed request is parsed by grpc inside the handler already (each read),
so there the deserializer only marks its DecodeError and the behavior's wrapper answers it. Handlers are wrapped
once per method and reused: a call pays a dict lookup and one more coroutine frame (an async-generator relay
per response on a streamed reply).
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import aclosing
from typing import Any

import grpc
from google.protobuf.message import DecodeError

Deserializer = Callable[[bytes], Any]


class UndecodableRequest(DecodeError):
    """A streamed request message that does not parse (raised by the marked deserializer, inside the handler)."""


def _message_name(deserialize: Deserializer, method: str) -> str:
    """The full name of the message `deserialize` parses (a generated `Message.FromString`), else the method's
    request."""
    descriptor = getattr(getattr(deserialize, "__self__", None), "DESCRIPTOR", None)
    full_name = getattr(descriptor, "full_name", None)
    return full_name if isinstance(full_name, str) else f"request of {method}"


def _problem(name: str, e: DecodeError) -> str:
    return f"request is not a valid {name}: {e}"


def _refuse_sync(context: Any, name: str, e: DecodeError) -> None:
    # A sync behavior's context aborts through the event loop, which a wrapper that grpc calls on the loop
    # thread cannot wait for; a status set here ends the call the same way once the wrapper returns.
    context.set_code(grpc.StatusCode.INVALID_ARGUMENT)
    context.set_details(_problem(name, e))


def _unary_unary(behavior: Any, deserialize: Deserializer, name: str) -> Callable[..., Any]:
    if not inspect.iscoroutinefunction(behavior):  # sync (a generated base class's unimplemented method)

        def parse_then_call_sync(raw: bytes, context: Any) -> Any:
            try:
                request = deserialize(raw)
            except DecodeError as e:
                _refuse_sync(context, name, e)
                return None
            return behavior(request, context)

        return parse_then_call_sync

    async def parse_then_call(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
        try:
            request = deserialize(raw)
        except DecodeError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _problem(name, e))
        return await behavior(request, context)

    return parse_then_call


def _unary_stream(behavior: Any, deserialize: Deserializer, name: str) -> Callable[..., Any]:
    if inspect.iscoroutinefunction(behavior):  # grpc's reader/writer API: it writes, returns None

        async def parse_then_write(raw: bytes, context: grpc.aio.ServicerContext) -> None:
            try:
                request = deserialize(raw)
            except DecodeError as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _problem(name, e))
            await behavior(request, context)

        return parse_then_write

    if not inspect.isasyncgenfunction(behavior):  # sync: grpc calls it on the loop and iterates it in a thread

        def parse_then_iterate_sync(raw: bytes, context: Any) -> Iterator[Any]:
            try:
                request = deserialize(raw)
            except DecodeError as e:
                _refuse_sync(context, name, e)
                return iter(())
            return behavior(request, context)

        return parse_then_iterate_sync

    async def parse_then_relay(raw: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        try:
            request = deserialize(raw)
        except DecodeError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _problem(name, e))
        # aclosing: when grpc drops this generator (client gone), the behavior's own cleanup runs as it would have
        async with aclosing(behavior(request, context)) as responses:
            async for response in responses:
                yield response

    return parse_then_relay


def _marked(deserialize: Deserializer, name: str) -> Deserializer:
    def parse(raw: bytes) -> Any:
        try:
            return deserialize(raw)
        except DecodeError as e:
            raise UndecodableRequest(_problem(name, e)) from None

    return parse


def _stream_unary(behavior: Any) -> Callable[..., Awaitable[Any]]:
    async def call(requests: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await behavior(requests, context)
        except UndecodableRequest as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    return call


def _stream_stream(behavior: Any) -> Callable[..., Any]:
    if inspect.iscoroutinefunction(behavior):
        return _stream_unary(behavior)  # reader/writer API: the same shape, returning None

    async def relay(requests: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        try:
            async with aclosing(behavior(requests, context)) as responses:
                async for response in responses:
                    yield response
        except UndecodableRequest as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    return relay


def decoding_handler(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
    """`handler` (of `method`, "/package.Service/Method") with its request parsed inside the handler; as it is
    when it takes raw bytes, or for a streamed request read by a sync behavior (none of ours)."""
    deserialize = handler.request_deserializer
    serialize = handler.response_serializer
    if deserialize is None:
        return handler
    name = _message_name(deserialize, method)
    if handler.request_streaming:
        streaming = handler.stream_stream if handler.response_streaming else handler.stream_unary
        if not (inspect.iscoroutinefunction(streaming) or inspect.isasyncgenfunction(streaming)):
            return handler
        if handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(
                _stream_stream(streaming), _marked(deserialize, name), serialize
            )
        return grpc.stream_unary_rpc_method_handler(_stream_unary(streaming), _marked(deserialize, name), serialize)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(
            _unary_stream(handler.unary_stream, deserialize, name), None, serialize
        )
    return grpc.unary_unary_rpc_method_handler(_unary_unary(handler.unary_unary, deserialize, name), None, serialize)


class RequestDecodeInterceptor(grpc.aio.ServerInterceptor):
    """Every method's request parsed inside its handler (`decoding_handler`): a DecodeError answers
    INVALID_ARGUMENT "request is not a valid <Message>: ...". Put it after the token check
    (psrl.replica_auth.ReplicaTokenInterceptor) in the server's interceptors: a refused call is then answered by
    a handler that reads no request, so an unauthenticated payload is never parsed."""

    def __init__(self) -> None:
        # method -> (the handler grpc resolved, its wrapper); a registered method resolves to the same handler
        # every call, so the wrapper is built once. Bounded by the methods served (unknown ones resolve to None).
        self._wrapped: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None  # an unknown method stays UNIMPLEMENTED
        method: str = handler_call_details.method  # type: ignore[attr-defined]
        known = self._wrapped.get(method)
        if known is not None and known[0] is handler:
            return known[1]
        wrapped = decoding_handler(handler, method)
        self._wrapped[method] = (handler, wrapped)
        return wrapped
