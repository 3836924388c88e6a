"""A bare HTTP/1.1 server for an app of plain handlers (a request in, a response out): httptools' parser on the
event loop's transport, with no ASGI between them. The router runs on it; its CPU per request is what bounds
how many replicas one gateway feeds, and uvicorn's ASGI cycle (a scope, message dicts, an event and a watcher
task per request) cost more than the rest of its HTTP edge.

What a connection does:
- Requests are read whole (bounded by the limits of `ConnectionGuard`: head and body timeouts, the body size)
  before their handler runs, one task per request. `Expect: 100-continue` is answered when the head is whole.
- Keep-alive (HTTP/1.1, or `Connection: keep-alive`), until the keep-alive timeout of the server's config.
- Pipelined requests are answered in order: one that arrives while another is answered waits, and reading
  pauses until its turn.
- A `Response` goes out in one write (head and body); a `StreamingResponse` in chunked encoding, each chunk as
  its iterator yields it. Both wait while the transport's buffer is over its high-water mark: a client that does
  not read holds back its stream, or its next pipelined answer, not the process's memory.
- A client that leaves cancels its request's task: the handler's (or the stream's) `finally` blocks run at once
  (releasing the instance, cancelling the upstream call), and the cancellation ends there, quietly.
- A handler that raises costs its request a 500 (or, once the answer began, the connection), never the process.
- It runs inside uvicorn's `Server` (`uvicorn.Config(http=http1_protocol(...))`): sockets, signals, the date
  header, the lifespan and the graceful shutdown stay uvicorn's. The app still speaks ASGI for the lifespan.

Not supported, since the router needs none of them: protocol upgrades (WebSocket, h2c; the request is answered
over HTTP/1.1, then the connection closes) and uvicorn's `limit_concurrency` (ignored).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import re
import time
import urllib.parse
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, cast

import httptools
from uvicorn.config import Config
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import STATUS_LINE
from uvicorn.protocols.utils import get_remote_addr
from uvicorn.server import ServerState

from psrl.serving.limits import HttpLimits
from psrl.serving.protocol import ConnectionGuard, RenderError

logger = logging.getLogger("psrl.serving")

_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_CRLF = b"\r\n"
# What a response header value may not hold (CR and LF above all: they would split the response).
_BAD_VALUE = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")


class Request:
    """One request, read whole. `path_params` is the app's routing's to fill."""

    __slots__ = (
        "arrived",
        "body",
        "head_sent",
        "headers",
        "keep_alive",
        "left",
        "method",
        "path",
        "path_params",
        "query",
        "task",
    )

    def __init__(self, method: str, path: str, query: bytes, headers: dict[str, str], keep_alive: bool) -> None:
        self.arrived = time.perf_counter()  # once the head was whole: for latency and time-to-first-token metrics
        self.method = method
        self.path = path
        self.query = query
        self.headers = headers  # lower-case names; a repeated header keeps its last value
        self.keep_alive = keep_alive
        self.body = b""
        self.path_params: dict[str, str] = {}
        self.left = False  # the client went away before its answer was complete
        self.head_sent = False  # the answer began: an error now can only cut the connection
        self.task: asyncio.Task[None] | None = None


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
        self.headers = headers  # besides content-type and the framing ones, which the server writes


class StreamingResponse:
    """Sent in chunked encoding as the iterator yields. However the request ends (the stream is whole, the
    client left, the server is cancelling it), the iterator's `finally` blocks run, even for an iterator that
    was never pulled."""

    __slots__ = ("chunks", "headers", "media_type", "status_code")

    def __init__(
        self,
        chunks: AsyncIterator[bytes],
        status_code: int = 200,
        media_type: str = "text/event-stream",
        headers: dict[str, str] | None = None,
    ) -> None:
        self.chunks = chunks
        self.status_code = status_code
        self.media_type = media_type
        self.headers = headers


AnyResponse = Response | StreamingResponse
Handler = Callable[[Request], Awaitable[AnyResponse]]


async def close_chunks(chunks: AsyncIterator[bytes], pulled: bool) -> None:
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


class Http1Protocol(ConnectionGuard, asyncio.Protocol):
    """One connection (see the module's docstring)."""

    def __init__(
        self,
        config: Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
        *,
        handler: Handler,
        limits: HttpLimits,
        render_error: RenderError,
    ) -> None:
        self.loop = _loop or asyncio.get_event_loop()
        self.server_state = server_state
        self.handler = handler
        self.keep_alive_s = float(config.timeout_keep_alive)
        self.parser = httptools.HttpRequestParser(self)
        # Answer the first of pipelined requests even when the client closed its side after sending them all.
        self.parser.set_dangerous_leniencies(lenient_data_after_close=True)
        self.transport: asyncio.Transport = cast(asyncio.Transport, None)
        self.flow: FlowControl = cast(FlowControl, None)  # reading paused while requests wait; writes wait
        self.client: tuple[str, int] | None = None
        self._current: Request | None = None  # being answered
        self._pipeline: deque[Request] = deque()  # received whole, waiting for their turn
        self._continue_owed = False  # a 100 Continue to send once the answer in progress is complete
        self._closing = False  # graceful shutdown: no request after the one being answered
        # The request being received.
        self._incoming: Request | None = None
        self._url = b""
        self._headers: dict[str, str] = {}
        self._chunks: list[bytes] = []
        # The server's default headers (the date), encoded: they change once a second.
        self._defaults_of: object = None
        self._defaults = b""
        self._init_guard(limits, render_error)

    # ---- connection ------------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        self.flow = FlowControl(self.transport)
        self.client = get_remote_addr(self.transport)
        self.server_state.connections.add(self)  # type: ignore[arg-type]  # uvicorn's set takes any protocol
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self.server_state.connections.discard(self)  # type: ignore[arg-type]
        self._guard_lost()
        self._pipeline.clear()
        request = self._current
        if request is not None and not request.left:
            request.left = True
            if request.task is not None:
                request.task.cancel()
        self.flow.resume_writing()  # a write waiting for the buffer to drain goes on (to a closed transport)

    def data_received(self, data: bytes) -> None:
        if self._rejected:
            return  # the rest of an upload we already answered: dropped
        self._idle_deadline = None
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._on_upgrade()
        except httptools.HttpParserError:
            self._reject(400, "invalid_http_request", "malformed HTTP request (the parser rejected it)")
        self._guard_stray_bytes()

    def _on_upgrade(self) -> None:
        """A request asked to switch protocols. Whole, it is answered as plain HTTP/1.1 (the Upgrade header
        ignored) and the connection closes after it: what the client sends next is not HTTP/1.1."""
        last = self._pipeline[-1] if self._pipeline else self._current
        if self._incoming is not None or last is None:
            self._reject(400, "invalid_http_request", "protocol upgrades are not supported")
            return
        last.keep_alive = False
        self._rejected = True  # nothing more is read
        self._cancel_timers()

    def pause_writing(self) -> None:
        self.flow.pause_writing()

    def resume_writing(self) -> None:
        self.flow.resume_writing()

    def shutdown(self) -> None:
        """uvicorn's graceful shutdown: an idle connection closes now, a busy one once its answer is out."""
        self._closing = True
        self._pipeline.clear()
        if self._current is None:
            self.transport.close()

    # ---- parser callbacks ------------------------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._url = b""
        self._headers = {}
        self._chunks = []
        self._guard_begin()

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers[name.lower().decode("latin-1")] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        headers = self._headers
        declared = headers.get("content-length")
        if not self._guard_head_done(int(declared) if declared is not None else None):
            return  # the parser validated the number
        try:
            url = httptools.parse_url(self._url)
        except httptools.HttpParserInvalidURLError:
            self._reject(400, "invalid_http_request", "malformed request target")
            return
        path = url.path.decode("latin-1")
        if "%" in path:
            path = urllib.parse.unquote(path)
        parser = self.parser
        self._incoming = Request(
            parser.get_method().decode("ascii"), path, url.query or b"", headers, parser.should_keep_alive()
        )
        if headers.get("expect", "").lower() == "100-continue":
            if self._current is None:
                self.transport.write(_CONTINUE)
            else:
                self._continue_owed = True

    def on_body(self, body: bytes) -> None:
        if not self._rejected and self._guard_body(len(body)):
            self._chunks.append(body)

    def on_message_complete(self) -> None:
        request = self._incoming
        if self._rejected or request is None:
            return
        self._incoming = None
        self._guard_end()
        chunks = self._chunks
        if chunks:
            request.body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        if self._current is None and not self._closing:
            self._start(request)
        elif not self._closing:
            self._pipeline.append(request)
            self.flow.pause_reading()

    # ---- answering -------------------------------------------------------------------------------------

    def _start(self, request: Request) -> None:
        self._current = request
        task = self.loop.create_task(self._serve(request))
        request.task = task
        self.server_state.tasks.add(task)

    async def _serve(self, request: Request) -> None:
        complete = False
        try:
            response = await self.handler(request)
            if isinstance(response, StreamingResponse):
                complete = await self._stream(request, response)
            else:
                if self.flow.write_paused:
                    await self.flow.drain()  # the client has not read the answers before: hold this one back
                if not request.left:
                    self._write_whole(request, response)
                    complete = True
        except asyncio.CancelledError:
            if not request.left:
                raise  # the server is cancelling it
            assert request.task is not None
            request.task.uncancel()  # the client left: its cancellation ends here
        except Exception:
            logger.exception("unhandled error answering %s %s", request.method, request.path)
            if not request.left and not request.head_sent and not self.transport.is_closing():
                request.left = True  # the error answer ends the connection
                self._answer_error(500, "internal_error", "internal server error")
        finally:
            self.server_state.tasks.discard(request.task)  # type: ignore[arg-type]
            if complete:
                self._answered(request)
            elif not request.left:
                self.transport.close()  # cancelled, or failed once the answer began: the client sees it cut

    def _head(self, request: Request, status: int, media_type: str, headers: dict[str, str] | None) -> list[bytes]:
        defaults = self.server_state.default_headers
        if defaults is not self._defaults_of:
            self._defaults_of = defaults
            self._defaults = b"".join(name + b": " + value + _CRLF for name, value in defaults)
        head = [STATUS_LINE[status], self._defaults, b"content-type: ", media_type.encode("latin-1"), _CRLF]
        if headers:
            for name, value in headers.items():
                if not value.isprintable() and _BAD_VALUE.search(value) is not None:  # the common case: one C call
                    raise ValueError(f"response header {name!r} holds a control character")
                head += (name.encode("latin-1"), b": ", value.encode("latin-1"), _CRLF)
        if not request.keep_alive or self._closing:
            head.append(b"connection: close\r\n")
        return head

    def _write_whole(self, request: Request, response: Response) -> None:
        head = self._head(request, response.status_code, response.media_type, response.headers)
        body = response.body
        if response.status_code in (204, 304):
            body = b""  # no body, and no length, may go with these
            head.append(_CRLF)
        else:
            head.append(b"content-length: %d\r\n\r\n" % len(body))
        if request.method != "HEAD":
            head.append(body)
        self.transport.write(b"".join(head))

    async def _stream(self, request: Request, response: StreamingResponse) -> bool:
        """Send the stream; whether it went out whole (not: the client left)."""
        chunks = response.chunks
        pulled = False
        try:
            if request.left:
                return False
            head = self._head(request, response.status_code, response.media_type, response.headers)
            head.append(b"transfer-encoding: chunked\r\n\r\n")
            write = self.transport.write
            write(b"".join(head))
            request.head_sent = pulled = True
            async for chunk in chunks:
                if request.left:
                    return False
                if chunk:
                    if self.flow.write_paused:
                        await self.flow.drain()
                    write(b"%x\r\n%b\r\n" % (len(chunk), chunk))
            if request.left:
                return False
            write(b"0\r\n\r\n")
            return True
        finally:
            await close_chunks(chunks, pulled)

    def _answered(self, request: Request) -> None:
        """The answer is out: the next request's turn, or the connection's end."""
        self._current = None
        self.server_state.total_requests += 1
        if self.transport.is_closing():
            return
        if not request.keep_alive or self._closing:
            self.transport.close()
            return
        if self._deferred_error is not None:
            self._answer_error(*self._deferred_error)
            self._deferred_error = None
            return
        if self._continue_owed:
            self._continue_owed = False
            self.transport.write(_CONTINUE)
        if self._pipeline:
            self._start(self._pipeline.popleft())
            if self._pipeline:
                return
        self.flow.resume_reading()
        if self._current is None:
            self._arm_idle_timer(self.keep_alive_s)

    # ---- the guard's hooks -----------------------------------------------------------------------------

    def _idle(self) -> bool:
        return self._current is None and self._incoming is None

    def _reject(self, status: int, code: str, message: str) -> None:
        """Answer the request being received with an error and end the connection; one being answered (an
        earlier request: requests run once received whole) gets its answer first."""
        self._rejected = True
        self._cancel_timers()
        self._pipeline.clear()
        self._incoming = None
        if self._current is not None:
            self._deferred_error = (status, code, message)
            return
        self._answer_error(status, code, message)


def http1_protocol(handler: Handler, limits: HttpLimits, render_error: RenderError) -> type[asyncio.Protocol]:
    """What to give uvicorn as `http=`: it builds one `Http1Protocol` per connection from it."""

    def factory(
        config: Config, server_state: ServerState, app_state: dict[str, Any], _loop: Any = None
    ) -> Http1Protocol:
        return Http1Protocol(
            config, server_state, app_state, _loop, handler=handler, limits=limits, render_error=render_error
        )

    return cast(type[asyncio.Protocol], factory)
