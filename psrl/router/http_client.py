"""A lean HTTP/1.1 client for the proxy hot path: keep-alive connection pools over asyncio protocols, responses
parsed by httptools (the parser uvicorn uses). It POSTs a body and reads the answer (whole or streamed), and GETs
(the health checks of HTTP workers), at a fraction of a general-purpose client's CPU per request.
"""

from __future__ import annotations

import asyncio
import collections
import typing
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field

import httptools

_EOF = None


class HttpConnectionError(ConnectionError):
    """The request could not be sent (refused, reset before any response byte)."""


class HttpResponseError(ConnectionError):
    """The connection failed after the response started."""


@dataclass
class HttpResponse:
    status: int
    headers: dict[str, str]
    body: bytes = b""


@dataclass(slots=True)
class _Pending:
    """The response being read on one connection: a stream's body chunks are queued as they come, a whole
    response's body is collected until `done`."""

    head: asyncio.Future
    chunks: asyncio.Queue | None = None  # a stream
    body: list[bytes] = field(default_factory=list)
    done: asyncio.Future | None = None  # a whole response


class _Connection(asyncio.Protocol):
    def __init__(self, pool: _HostPool, loop: asyncio.AbstractEventLoop) -> None:
        self._pool = pool
        self._loop = loop  # asyncio.get_running_loop() costs a getpid() call per request (Python 3.11)
        self._transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self._pending: _Pending | None = None
        self._headers: dict[str, str] = {}
        self._got_bytes = False
        self._until_close = False  # the response's body runs to the connection's end (no length, not chunked)
        self.closed = False
        self.reusable = True

    # ---- asyncio.Protocol -------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = typing.cast(asyncio.Transport, transport)  # uvloop's are not asyncio.Transport subclasses

    def data_received(self, data: bytes) -> None:
        self._got_bytes = True
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as e:
            self._fail(HttpResponseError(f"malformed HTTP response: {e}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._pool.forget(self)
        p = self._pending
        if p is not None and exc is None and self._until_close and p.head.done():
            self.on_message_complete()  # a body without a length or chunks ends with the connection
            return
        if p is not None:
            if self._got_bytes:
                self._fail(HttpResponseError(f"connection closed mid-response: {exc or 'EOF'}"))
            else:
                self._fail(HttpConnectionError(f"connection closed before a response: {exc or 'EOF'}"))

    # ---- httptools callbacks ------------------------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        p = self._pending
        if p is not None and not p.head.done():
            status = self._parser.get_status_code()
            p.head.set_result(HttpResponse(status, self._headers))
        if not self._parser.should_keep_alive():
            self.reusable = False
        encoding = self._headers.get("transfer-encoding", "")
        self._until_close = "content-length" not in self._headers and "chunked" not in encoding.lower()

    def on_body(self, body: bytes) -> None:
        p = self._pending
        if p is None:
            return
        if p.chunks is not None:
            p.chunks.put_nowait(body)
        else:
            p.body.append(body)

    def on_message_complete(self) -> None:
        p, self._pending = self._pending, None
        self._headers = {}
        if p is None:
            return
        if p.chunks is not None:
            p.chunks.put_nowait(_EOF)
        elif p.done is not None and not p.done.done():
            p.done.set_result(b"".join(p.body))
        self._pool.release(self)

    # ---- requests -----------------------------------------------------------------------------------------

    def _fail(self, exc: Exception) -> None:
        p, self._pending = self._pending, None
        self.reusable = False
        if self._transport is not None:
            self._transport.close()
        if p is None:
            return
        if not p.head.done():
            p.head.set_exception(exc)
        if p.done is not None and not p.done.done():
            p.done.set_exception(exc)
        if p.chunks is not None:
            p.chunks.put_nowait(exc)

    def send(self, head: bytes, body: bytes, stream: bool) -> _Pending:
        assert self._transport is not None and self._pending is None
        loop = self._loop
        if stream:
            pending = _Pending(loop.create_future(), chunks=asyncio.Queue())
        else:  # no queue: a whole response's body is only collected
            pending = _Pending(loop.create_future(), done=loop.create_future())
        self._pending = pending
        self._got_bytes = False
        self._transport.writelines((head, body))
        return pending

    def abort(self, pending: _Pending | None = None) -> None:
        """Drop a connection whose response will not be read to the end. Given the request's `pending`, only while
        it is still the connection's: a response that ended already gave the connection back to the pool, where
        another request may have taken it (a caller cancelled just after its response ended)."""
        if pending is not None and self._pending is not pending:
            return
        self._pending = None
        self.reusable = False
        if self._transport is not None:
            self._transport.close()


class _HostPool:
    def __init__(self, host: str, port: int, max_idle: int) -> None:
        self.host, self.port = host, port
        self._idle: collections.deque[_Connection] = collections.deque()
        self._max_idle = max_idle

    async def acquire(self) -> tuple[_Connection, bool]:
        """An idle keep-alive connection (reused=True) or a new one."""
        while self._idle:
            conn = self._idle.pop()
            if not conn.closed:
                return conn, True
        loop = asyncio.get_running_loop()
        try:
            _, conn = await loop.create_connection(lambda: _Connection(self, loop), self.host, self.port)
        except OSError as e:
            raise HttpConnectionError(f"cannot connect to {self.host}:{self.port}: {e}") from e
        return conn, False

    def release(self, conn: _Connection) -> None:
        if conn.reusable and not conn.closed and len(self._idle) < self._max_idle:
            self._idle.append(conn)
        elif not conn.closed:
            conn.abort()

    def forget(self, conn: _Connection) -> None:
        try:
            self._idle.remove(conn)
        except ValueError:
            pass

    def close(self) -> None:
        while self._idle:
            self._idle.pop().abort()


class HttpClient:
    def __init__(self, max_idle_per_host: int = 256) -> None:
        self._pools: dict[tuple[str, int], _HostPool] = {}
        self._max_idle = max_idle_per_host

    def _pool(self, host: str, port: int) -> _HostPool:
        pool = self._pools.get((host, port))
        if pool is None:
            pool = self._pools[(host, port)] = _HostPool(host, port, self._max_idle)
        return pool

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()

    async def _send(
        self, method: str, host: str, port: int, path: str, body: bytes, headers: dict[str, str], stream: bool
    ) -> tuple[_Connection, _Pending, HttpResponse]:
        pool = self._pool(host, port)
        extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        length = f"Content-Length: {len(body)}\r\n" if body or method == "POST" else ""
        head = f"{method} {path} HTTP/1.1\r\nHost: {host}:{port}\r\n{length}{extra}\r\n".encode("latin-1")
        for attempt in (0, 1):
            conn, reused = await pool.acquire()
            pending = conn.send(head, body, stream)
            try:
                return conn, pending, await pending.head
            except HttpConnectionError:
                # A reused keep-alive connection the server closed meanwhile: nothing was processed, so one
                # retry on a fresh connection is safe.
                if not reused or attempt:
                    raise
            except BaseException:
                conn.abort(pending)
                raise
        raise AssertionError("unreachable")

    def post(self, host: str, port: int, path: str, body: bytes, headers: dict[str, str]) -> Awaitable[HttpResponse]:
        return self._whole("POST", host, port, path, body, headers)

    def get(self, host: str, port: int, path: str) -> Awaitable[HttpResponse]:
        return self._whole("GET", host, port, path, b"", {})

    async def _whole(
        self, method: str, host: str, port: int, path: str, body: bytes, headers: dict[str, str]
    ) -> HttpResponse:
        """The response, its body read whole."""
        conn, pending, resp = await self._send(method, host, port, path, body, headers, stream=False)
        assert pending.done is not None
        try:
            resp.body = await pending.done
        except BaseException:
            conn.abort(pending)
            raise
        return resp

    async def post_stream(
        self, host: str, port: int, path: str, body: bytes, headers: dict[str, str]
    ) -> tuple[HttpResponse, AsyncIterator[bytes]]:
        conn, pending, resp = await self._send("POST", host, port, path, body, headers, stream=True)
        queue = pending.chunks
        assert queue is not None

        async def chunks() -> AsyncIterator[bytes]:
            finished = False
            try:
                while True:
                    item = await queue.get()
                    if item is _EOF:
                        finished = True
                        return
                    if isinstance(item, Exception):
                        raise item
                    yield item
            finally:
                if not finished:
                    conn.abort(pending)  # the reader went away early: the rest of the response is unread

        return resp, chunks()
