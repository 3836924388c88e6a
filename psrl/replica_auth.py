"""The shared token that guards a replica's gRPC services, for deployments that bind replicas beyond loopback.

Where it comes from, on the router, the replicas and the gateway launcher alike: the file `--replica-token-file`
names (its content, surrounding whitespace stripped), else the environment variable `PSRL_REPLICA_TOKEN`; never
a command-line value, which other users could read in the process list. No token: the services are open, as
they are on loopback by default.

How it travels: gRPC metadata `authorization: Bearer <token>` on every call (what grpcurl's `-H` and other gRPC
clients send), added by the client interceptors here; a replica given a token answers any other call with
UNAUTHENTICATED (`ReplicaTokenInterceptor`), except the services it leaves open (health and reflection).
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Awaitable, Callable, Collection, Sequence
from typing import Any

import grpc

from psrl.credentials import TOKEN_ENV, TOKEN_FILE_FLAG

logger = logging.getLogger(__name__)

AUTHORIZATION_KEY = "authorization"
# The router's `x-smg-error-code` for a replica that refused its token (or its lack of one) at registration;
# a replica registering itself gives up on it at once (retrying cannot help).
REFUSED_ERROR_CODE = "worker_unauthenticated"
_HOW_TO = f"give the caller the replicas' token ({TOKEN_ENV} or {TOKEN_FILE_FLAG})"


def bearer(token: str) -> str:
    return f"Bearer {token}"


# ---- the replica's side ----------------------------------------------------------------------------------


def _refusing(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that answers UNAUTHENTICATED. It reads no request (no
    deserializer: an unauthenticated payload is never parsed)."""

    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse)
    return grpc.unary_unary_rpc_method_handler(refuse)


class ReplicaTokenInterceptor(grpc.aio.ServerInterceptor):
    """Every call to a service outside `open_services` (full names) must carry `authorization: Bearer <token>`;
    any other call ends UNAUTHENTICATED, its message saying what was missing."""

    def __init__(self, token: str, open_services: Collection[str] = ()) -> None:
        self._expected = bearer(token).encode()
        self._open = frozenset(open_services)

    def _problem(self, metadata: Sequence[tuple[str, str | bytes]] | None) -> str | None:
        """Why the call is refused (None: it carries the token)."""
        sent = [v for k, v in metadata or () if k == AUTHORIZATION_KEY]
        if not sent:
            return f"this replica requires a token: no '{AUTHORIZATION_KEY}' metadata sent; {_HOW_TO}"
        value = sent[0].encode() if isinstance(sent[0], str) else sent[0]
        if len(sent) > 1 or not hmac.compare_digest(value, self._expected):
            return f"this replica refused the '{AUTHORIZATION_KEY}' metadata sent (wrong token); {_HOW_TO}"
        return None

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        method: str = handler_call_details.method  # type: ignore[attr-defined]  # "/package.Service/Method"
        if handler is None or method.partition("/")[2].partition("/")[0] in self._open:
            return handler  # an unknown method stays UNIMPLEMENTED
        problem = self._problem(handler_call_details.invocation_metadata)  # type: ignore[attr-defined]
        return handler if problem is None else _refusing(handler, problem)


# ---- the callers' side -----------------------------------------------------------------------------------


class _WithToken:
    def __init__(self, token: str) -> None:
        self._metadata = ((AUTHORIZATION_KEY, bearer(token)),)

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        ours = [(k, v) for k, v in details.metadata or () if k != AUTHORIZATION_KEY]
        return details._replace(metadata=grpc.aio.Metadata(*ours, *self._metadata))  # type: ignore[attr-defined]


class _UnaryUnary(_WithToken, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        return await continuation(self._details(client_call_details), request)


class _UnaryStream(_WithToken, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        return await continuation(self._details(client_call_details), request)


class _StreamUnary(_WithToken, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation: Any, client_call_details: Any, request_iterator: Any) -> Any:
        return await continuation(self._details(client_call_details), request_iterator)


class _StreamStream(_WithToken, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation: Any, client_call_details: Any, request_iterator: Any) -> Any:
        return await continuation(self._details(client_call_details), request_iterator)


def token_interceptors(token: str | None) -> list[grpc.aio.ClientInterceptor]:
    """For `grpc.aio.insecure_channel(..., interceptors=...)`: send `token` on every call of the channel (a
    channel takes one interceptor per call kind). None: nothing to add."""
    if token is None:
        return []
    return [_UnaryUnary(token), _UnaryStream(token), _StreamUnary(token), _StreamStream(token)]


def token_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """The same metadata for one call of a synchronous stub (`metadata=`)."""
    return () if token is None else ((AUTHORIZATION_KEY, bearer(token)),)
