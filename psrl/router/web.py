"""The router's own minimal ASGI layer: exact-path routing, a request with its headers and body, plain and
streaming responses, lifespan. A general framework's middleware stack, routing regexes and response objects
cost more CPU per request than the proxying itself; this keeps the hot path to what it needs.

A client that leaves is noticed once, for the whole request: after its body is read, one task waits for
`http.disconnect`, and its arrival cancels the handler (a non-streamed generation) or the stream being sent,
so the pipeline aborts the replica's work and releases the instance at once. Both run in the server's task
for the request, which that arrival cancels (and the cancellation is then absorbed): a request costs one task
of ours, not one per handler and stream besides.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

logger = logging.getLogger(__name__)

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


class ClientDisconnected(ConnectionError):
    """The client left before its request body was whole (or the server refused the body)."""


class Request:
    __slots__ = ("_body", "_left", "_receive", "arrived", "headers", "method", "path", "path_params", "query")

    def __init__(self, scope: Scope, receive: Receive, path_params: dict[str, str]) -> None:
        self._receive = receive
        self._body: bytes | None = None
        self._left: asyncio.Future[None] | None = None
        self.arrived = time.perf_counter()  # for latency and time-to-first-token metrics
        self.method: str = scope["method"]
        self.path: str = scope["path"]
        self.query: bytes = scope.get("query_string", b"")
        self.path_params = path_params
        # ASGI servers give lower-case names; a plain dict keeps look-ups in C.
        self.headers: dict[str, str] = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}

    async def body(self) -> bytes:
        if self._body is None:
            parts = []
            more = True
            while more:
                message = await self._receive()
                if message["type"] == "http.disconnect":
                    raise ClientDisconnected("client disconnected while sending the body")
                parts.append(message.get("body", b""))
                more = message.get("more_body", False)
            self._body = b"".join(parts)
        return self._body

    def client_left(self) -> asyncio.Future[None]:
        """Done when the client disconnects (or its answer is complete): the request's one watcher of
        `receive()`, so nothing else reads it concurrently. Only once the body is read, which it consumes."""
        if self._left is None:
            if self._body is None:
                raise RuntimeError("the body must be read before watching for a disconnect")
            self._left = asyncio.get_running_loop().create_task(self._wait_disconnect())
        return self._left

    async def _wait_disconnect(self) -> None:
        while (await self._receive())["type"] != "http.disconnect":
            pass

    def close(self, answered: bool = False) -> None:
        """The request is over: `answered`, its answer is complete (or the client left). Then the watcher ends
        by itself (receive() answers `http.disconnect` once a response is complete, and the server wakes it):
        it is cancelled only when there is no answer (cancelling costs more CPU than the rest of it)."""
        if self._left is not None and not answered:
            self._left.cancel()


class _CancelOnLeave:
    """The done-callback of `Request.client_left()` while `task` answers the request: the client leaving
    cancels it. `fired` tells that cancellation (to absorb) from any other. Disarmed once the work is over:
    a callback the loop has already scheduled cannot be removed, and must then do nothing."""

    __slots__ = ("armed", "fired", "task")

    def __init__(self, task: asyncio.Task[Any]) -> None:
        self.task = task
        self.armed = True
        self.fired = False

    def __call__(self, left: asyncio.Future[None]) -> None:
        if self.armed:
            self.fired = True
            self.task.cancel()


async def _unless_left(request: Request, work: Awaitable[Any]) -> tuple[bool, Any]:
    """Await `work` in this task, cancelled if the client leaves first: (True, its result), or (False, None)
    once that cancellation has ended it. Any other cancellation, or an error of `work`, propagates."""
    task = asyncio.current_task()
    assert task is not None
    left = request.client_left()
    leave = _CancelOnLeave(task)
    left.add_done_callback(leave)
    try:
        result = await work
    except asyncio.CancelledError:
        if leave.fired and task.uncancel() == 0:
            return False, None  # the client left: `work` is cancelled, nothing else is
        raise
    except BaseException:
        if leave.fired:
            task.uncancel()  # `work` turned the cancellation into an error: it propagates, as it did
        raise
    finally:
        leave.armed = False
        left.remove_done_callback(leave)
    if leave.fired:
        task.uncancel()  # `work` absorbed the cancellation and finished
    return True, result


# Encoded content-type headers of the media types seen (a few: ours, and those upstreams answer with).
_CONTENT_TYPES: dict[str, tuple[bytes, bytes]] = {}
_CONTENT_TYPES_MAX = 64


def _raw_headers(media_type: str, headers: dict[str, str] | None, length: int | None) -> list[tuple[bytes, bytes]]:
    content_type = _CONTENT_TYPES.get(media_type)
    if content_type is None:
        content_type = (b"content-type", media_type.encode("latin-1"))
        if len(_CONTENT_TYPES) < _CONTENT_TYPES_MAX:
            _CONTENT_TYPES[media_type] = content_type
    raw = [content_type]
    if length is not None:
        raw.append((b"content-length", b"%d" % length))
    if headers:
        raw.extend((k.encode("latin-1"), v.encode("latin-1")) for k, v in headers.items())
    return raw


class Response:
    __slots__ = ("body", "headers", "media_type", "status_code")

    def __init__(
        self,
        body: bytes | str = b"",
        status_code: int = 200,
        media_type: str = "application/json",
        headers: dict[str, str] | None = None,
    ) -> None:
        self.body = body.encode() if isinstance(body, str) else body
        self.status_code = status_code
        self.media_type = media_type
        self.headers = headers

    async def __call__(self, request: Request, send: Send) -> None:
        await send(
            {
                "type": "http.response.start",
                "status": self.status_code,
                "headers": _raw_headers(self.media_type, self.headers, len(self.body)),
            }
        )
        await send({"type": "http.response.body", "body": self.body})


def json_response(payload: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(json.dumps(payload), status, "application/json", headers)


class StreamingResponse:
    """Sends chunks as the iterator yields them; a client that disconnects cancels the iterator, so its
    `finally` blocks (releasing the instance, cancelling the upstream call) run at once."""

    __slots__ = ("_pulled", "chunks", "headers", "media_type", "status_code")

    def __init__(
        self,
        chunks: AsyncIterator[bytes],
        status_code: int = 200,
        media_type: str = "text/event-stream",
        headers: dict[str, str] | None = None,
    ) -> None:
        self.chunks = chunks
        self._pulled = False  # whether iterating began (the iterator's body runs from then on)
        self.status_code = status_code
        self.media_type = media_type
        self.headers = headers

    async def _stream(self, send: Send) -> None:
        await send(
            {
                "type": "http.response.start",
                "status": self.status_code,
                "headers": _raw_headers(self.media_type, self.headers, None),
            }
        )
        self._pulled = True
        async for chunk in self.chunks:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def __call__(self, request: Request, send: Send) -> None:
        try:
            await _unless_left(request, self._stream(send))
        finally:  # the stream ended, failed, or was cancelled (the client left, or we are being cancelled)
            await _close(self.chunks, self._pulled)


async def _close(chunks: AsyncIterator[bytes], pulled: bool) -> None:
    """Run the iterator's `finally` blocks, whether it is parked at a `yield` or was never started. Closing an
    async generator before its first step skips its body, and with it the release of what its source holds (a
    ticket, an upstream call): so one that was never pulled is started, then cancelled at its first wait (or
    closed at its first yield)."""
    if not pulled and inspect.isasyncgen(chunks):
        first = asyncio.ensure_future(anext(chunks))
        await asyncio.sleep(0)  # the task takes its first step before this returns
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
    aclose = getattr(chunks, "aclose", None)
    if aclose is not None:
        await aclose()


AnyResponse = Response | StreamingResponse
Handler = Callable[[Request], Awaitable[AnyResponse]]


def _not_routed(scope: Scope, known_path: bool) -> Response:
    status = 405 if known_path else 404
    error = "method not allowed" if known_path else "not found"
    body = {
        "error": {
            "message": f"{error}: {scope['method']} {scope['path']}",
            "type": "invalid_request_error",
            "param": None,
            "code": error.replace(" ", "_"),
        }
    }
    return json_response(body, status, {"x-smg-error-code": error.replace(" ", "_")})


class App:
    """Exact (method, path) routes plus `prefix{param}` routes; 404/405 as JSON errors."""

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

    def _resolve(self, method: str, path: str) -> tuple[Handler | None, dict[str, str], bool]:
        handler = self._exact.get((method, path))
        if handler is not None:
            return handler, {}, True
        known = path in self._paths
        for m, prefix, name, h in self._prefixed:
            if path.startswith(prefix) and "/" not in path[len(prefix) :] and len(path) > len(prefix):
                if m == method:
                    return h, {name: path[len(prefix) :]}, True
                known = True
        return None, {}, known

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            handler, params, known = self._resolve(scope["method"], scope["path"])
            request = Request(scope, receive, params)
            if handler is None:
                await _not_routed(scope, known)(request, send)
                return
            try:
                await request.body()
            except ClientDisconnected:
                return  # nothing to answer: the client is gone
            answered = False
            try:
                await self._respond(handler, request, send)
                answered = True  # or the client left
            finally:
                request.close(answered)
        elif kind == "lifespan":
            await self._run_lifespan(receive, send)

    @staticmethod
    async def _respond(handler: Handler, request: Request, send: Send) -> None:
        """Run the handler while watching the client: if it leaves first, the handler is cancelled (its
        `finally` blocks release the instance and cancel the upstream call) and nothing is sent."""
        answered, response = await _unless_left(request, handler(request))
        if answered:
            await response(request, send)

    async def _run_lifespan(self, receive: Receive, send: Send) -> None:
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
