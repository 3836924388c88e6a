"""The router's routes: exact (method, path) routes and `prefix{param}` routes to plain handlers, with JSON
404/405 errors, for `psrl.serving.http1` to serve. A general framework's middleware stack, routing regexes and
response objects cost more CPU per request than the proxying itself; this keeps the hot path to what it needs.
The app speaks ASGI for one thing, the lifespan that uvicorn's server runs at start-up and shutdown."""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

import msgspec

from psrl.serving.http1 import AnyResponse, Handler, Request, Response

logger = logging.getLogger(__name__)

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


_MSGSPEC = msgspec.json.Encoder().encode
_COMPACT = json.JSONEncoder(separators=(",", ":")).encode  # made once: json.dumps with options makes one per call


def encode_json(payload: Any, *, finite: bool = False) -> bytes:
    """`payload` as compact JSON. With `finite` (the caller knows every float in it is finite, or that it has
    none), msgspec writes it, in a tenth of json's time. Not otherwise: msgspec writes an infinite or NaN float
    as null, where json writes `-Infinity`, as vLLM's server does for a -inf logprob. A string msgspec cannot
    write (a lone surrogate a request echoed) goes to json too. The two differ in bytes (msgspec writes UTF-8,
    json `\\u` escapes), not in the value."""
    if finite:
        try:
            return _MSGSPEC(payload)
        except ValueError:  # UnicodeEncodeError
            pass
    return _COMPACT(payload).encode()


def json_response(
    payload: Any, status: int = 200, headers: dict[str, str] | None = None, *, finite: bool = False
) -> Response:
    """`payload` as a JSON answer (`finite`: see `encode_json`)."""
    return Response(encode_json(payload, finite=finite), status, "application/json", headers)


async def _not_routed(request: Request, known_path: bool) -> Response:
    status = 405 if known_path else 404
    error = "method not allowed" if known_path else "not found"
    body = {
        "error": {
            "message": f"{error}: {request.method} {request.path}",
            "type": "invalid_request_error",
            "param": None,
            "code": error.replace(" ", "_"),
        }
    }
    return json_response(body, status, {"x-smg-error-code": error.replace(" ", "_")})


class App:
    """The routes, and `handle` (the server's handler) to answer a request by them."""

    def __init__(self, lifespan: Callable[[], AbstractAsyncContextManager[None]]) -> None:
        self._exact: dict[tuple[str, str], Handler] = {}
        self._prefixed: list[tuple[str, str, str, Handler]] = []  # method, prefix, param name, handler
        self._paths: set[str] = set()
        self._lifespan = lifespan

    def route(self, method: str, path: str, handler: Handler) -> None:
        if "{" in path:
            prefix, _, rest = path.partition("{")
            self._prefixed.append((method, prefix, rest.rstrip("}"), handler))
        else:
            self._exact[(method, path)] = handler
            self._paths.add(path)

    def handle(self, request: Request) -> Awaitable[AnyResponse]:
        method, path = request.method, request.path
        handler = self._exact.get((method, path))
        if handler is not None:
            return handler(request)
        known = path in self._paths
        for m, prefix, name, h in self._prefixed:
            if path.startswith(prefix) and "/" not in path[len(prefix) :] and len(path) > len(prefix):
                if m == method:
                    request.path_params = {name: path[len(prefix) :]}
                    return h(request)
                known = True
        return _not_routed(request, known)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """ASGI, for the lifespan only: requests reach `handle` through `psrl.serving.http1`."""
        if scope["type"] != "lifespan":
            raise RuntimeError(f"the router's app serves ASGI {scope['type']!r} through psrl.serving.http1 only")
        await receive()  # lifespan.startup
        context = self._lifespan()
        try:
            await context.__aenter__()
        except BaseException as e:
            logger.exception("start-up failed")
            await send({"type": "lifespan.startup.failed", "message": str(e)})
            return
        await send({"type": "lifespan.startup.complete"})
        await receive()  # lifespan.shutdown
        await context.__aexit__(None, None, None)
        await send({"type": "lifespan.shutdown.complete"})
