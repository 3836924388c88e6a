"""The router's Generate calls, the one RPC on its hot path, over libcurl (pycurl) instead of grpc.aio.

One curl multi handle, driven by the router's event loop (curl's sockets sit in an epoll of the client's own,
whose fd the loop watches; curl's timer is a `call_at`), carries every Generate, multiplexed as HTTP/2 streams
over curl's connections to each replica (prior knowledge, cleartext). libcurl and its nghttp2 do HTTP/2 and
HPACK; this module frames gRPC messages (a flag byte and a 4-byte length before each) and reads the status from
the trailers. No thread is involved: grpc.aio's core polls on threads of its own and wakes the loop for each
event, which is most of what one call costs it (bench/router_overhead.py prints both).

`StreamCall` behaves as grpc.aio's unary-stream call does where the router uses one: `read()` returns each
message and then None (grpc.aio: `EOF`), a failure is a `grpc.aio.AioRpcError` with the status gRPC would give (so
the router maps errors one way for both clients), `cancel()` resets the stream (the replica sees a cancelled
RPC and aborts the request), `initial_metadata()`, `wait_for_connection()` and `done()`. `release()` is
ours: a caller with what it needs leaves the call to end on its own (no reset). Deadlines go out as
`grpc-timeout` and are enforced here too. A call that fails on a reused connection before any answer is sent
again once, on a new connection, as a grpc.aio channel reconnects under its next call: curl reuses a connection
that closed while idle without a GOAWAY (a replica killed, by the OOM killer say, and restarted on its port).
The background loops' periodic calls (HealthCheck, GetLoads) use it too (`WorkerClients._unary`): through grpc.aio
each woke its core's threads. The rest of the control plane (registration, aborts, KV events, the tokenizer)
stays on grpc.aio: it is not per request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import select
import socket
from collections import deque
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar
from urllib.parse import unquote

import grpc
import pycurl
from google.protobuf.message import DecodeError, Message

logger = logging.getLogger(__name__)

M = TypeVar("M", bound=Message)

MAX_MESSAGE_BYTES = 64 << 20  # as the router's grpc.aio channels allow
CONNECT_TIMEOUT_MS = 10_000
# A replica host that vanishes without closing its connections (node loss, a partition) is noticed within
# about 40 s, as the grpc.aio channels' HTTP/2 keepalive (30 s, 10 s timeout) noticed it: TCP keepalive probes
# on an idle connection, and a bound on unacknowledged data on a busy one.
KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_PROBES = 30, 10, 1
TCP_USER_TIMEOUT_MS = 40_000
MAX_IDLE_HANDLES = 256  # easy handles kept for reuse (~55 KB each); a burst beyond it closes the rest
_PREFIX = 5  # gRPC message framing: compressed flag, big-endian length
_REQUEST_HEADERS = ["content-type: application/grpc", "te: trailers", "accept:", "expect:"]  # drop curl's own
# Transport failures: the replica is gone or unreachable, or its connection broke.
_UNAVAILABLE = frozenset(
    (
        pycurl.E_COULDNT_CONNECT,
        pycurl.E_COULDNT_RESOLVE_HOST,
        pycurl.E_GOT_NOTHING,
        pycurl.E_SEND_ERROR,
        pycurl.E_RECV_ERROR,
        pycurl.E_PARTIAL_FILE,
        pycurl.E_HTTP2,
        pycurl.E_SEND_FAIL_REWIND,
        92,  # CURLE_HTTP2_STREAM: the stream was reset (pycurl has no name for it)
    )
)
# How a call fails on a connection the replica closed while it was idle (a broken pipe, a reset, or nothing).
_DEAD_CONNECTION = frozenset((pycurl.E_SEND_ERROR, pycurl.E_RECV_ERROR, pycurl.E_GOT_NOTHING))
# gRPC's mapping of an HTTP status that is not 200 (doc/http-grpc-status-mapping.md).
_HTTP_STATUS = {
    400: grpc.StatusCode.INTERNAL,
    401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED,
    404: grpc.StatusCode.UNIMPLEMENTED,
    429: grpc.StatusCode.UNAVAILABLE,
    502: grpc.StatusCode.UNAVAILABLE,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.UNAVAILABLE,
}
_STATUS_BY_VALUE = {c.value[0]: c for c in grpc.StatusCode}
_OK_LINE = b"grpc-status: 0\r\n"  # as curl writes a header (nghttp2 gives names in lower case)
# curl's wishes for a socket as epoll events, and epoll's answer as curl's. An error or a hang-up comes whatever
# was asked; as with the loop's readers and writers, it makes the socket ready for what curl asked (and an error
# is passed on as CSELECT_ERR too), and curl finds the cause when it reads or writes.
_EPOLL_EVENTS = {
    pycurl.POLL_IN: select.EPOLLIN,
    pycurl.POLL_OUT: select.EPOLLOUT,
    pycurl.POLL_INOUT: select.EPOLLIN | select.EPOLLOUT,
}  # anything else (POLL_REMOVE, POLL_NONE): not watched
_EPOLL_BROKEN = select.EPOLLERR | select.EPOLLHUP
_CSELECT = [
    (pycurl.CSELECT_IN if e & select.EPOLLIN else 0)
    | (pycurl.CSELECT_OUT if e & select.EPOLLOUT else 0)
    | (pycurl.CSELECT_ERR if e & select.EPOLLERR else 0)
    for e in range((select.EPOLLIN | select.EPOLLOUT | select.EPOLLERR) + 1)
]
_READY_BATCH = 256  # sockets handled per wake of the loop


def _bound_socket(fd: int, purpose: int) -> int:
    """curl's new sockets: keepalive gives up after one unanswered probe, and unacknowledged data after
    TCP_USER_TIMEOUT_MS (Linux; elsewhere curl's keepalive alone)."""
    if hasattr(socket, "TCP_USER_TIMEOUT"):
        with socket.socket(fileno=os.dup(fd)) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, KEEPALIVE_PROBES)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, TCP_USER_TIMEOUT_MS)
    return pycurl.SOCKOPT_OK


def _with_deadline(curl: pycurl.Curl, headers: list[str], ms: int) -> None:
    """Give a transfer `ms` milliseconds: curl's own timeout, and `grpc-timeout` beside `headers` for the replica."""
    curl.setopt(pycurl.TIMEOUT_MS, ms)
    curl.setopt(pycurl.HTTPHEADER, [*headers, f"grpc-timeout: {ms}m"])


class StreamCall(Generic[M]):
    """One unary-stream call (see the module docstring). Made by `CurlGrpc.unary_stream`."""

    __slots__ = (
        "_body",
        "_buf",
        "_curl",
        "_deadline",
        "_deserialize",
        "_done",
        "_error",
        "_headers",
        "_lines",
        "_messages",
        "_offset",
        "_owner",
        "_reaper",
        "_resent",
        "_waiter",
        "method",
        "target",
    )

    def __init__(
        self,
        owner: CurlGrpc,
        target: str,
        method: str,
        body: bytes,
        deserialize: Callable[[bytes], M],
        deadline: float | None,
        headers: list[str],
    ) -> None:
        self._owner = owner
        self.target = target
        self.method = method
        self._body = body
        self._offset = 0  # how much of the body curl has taken
        self._deadline = deadline  # on the loop's clock
        self._headers = headers  # as sent but for `grpc-timeout`, which a deadline adds (`_with_deadline`)
        self._deserialize = deserialize
        self._buf = bytearray()
        self._messages: deque[bytes] = deque()
        self._lines: list[bytes] = []  # header lines as curl gives them: the headers, a blank line, the trailers
        self._done = False
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._curl: pycurl.Curl | None = None
        self._reaper: asyncio.TimerHandle | None = None  # set by `release`
        self._resent = False

    # ---- the caller's side -------------------------------------------------------------------------

    async def read(self) -> M | None:
        """The next message, None after the last one of a call that ended OK; the call's error after the
        messages that came before it. A message that cannot be parsed ends the call as INTERNAL (the stream
        is reset if it is still open), for this read and every later one."""
        while not self._messages:
            if self._done:
                if self._error is not None:
                    raise self._error
                return None
            await self._wait()
        try:
            return self._deserialize(self._messages.popleft())
        except DecodeError as e:
            error = self._rpc_error(grpc.StatusCode.INTERNAL, f"the replica sent a message that cannot be read: {e}")
            if not self._done:
                self._owner.remove(self)
            self._messages.clear()
            self._end(error)
            raise error from e

    async def initial_metadata(self) -> grpc.aio.Metadata:
        """The response headers, once they are in: at the latest with the first message, or at the end."""
        while not (self._done or self._messages or b"\r\n" in self._lines):  # headers come before messages
            await self._wait()
        return grpc.aio.Metadata(*self._parsed_headers()[0])

    async def wait_for_connection(self) -> None:
        """Return once the request has been handed to the connection; the call's error if it ended first."""
        while not (self._sent() or self._done):
            await self._wait()
        if self._done and self._error is not None and not self._sent():
            raise self._error

    def done(self) -> bool:
        return self._done

    def cancel(self) -> bool:
        """Reset the stream if the call is still running; a finished call is left alone (False)."""
        if self._done:
            return False
        self._owner.remove(self)
        self._messages.clear()  # as grpc.aio: nothing is read from a cancelled call
        self._end(asyncio.CancelledError())
        return True

    def release(self, grace_s: float) -> None:
        """The caller needs nothing more: the call ends on its own, without the reset `cancel` sends (which
        would cost the replica an abort of what it already finished). One still running after `grace_s`, from
        a replica that never ends it, is cancelled then."""
        if not self._done and self._reaper is None:
            loop = self._owner._loop
            assert loop is not None
            self._reaper = loop.call_later(grace_s, self.cancel)

    async def _wait(self) -> None:
        """Until the call's state changes (the caller checks it again). Waiters share one future: a waiting
        task that is cancelled cancels it, and the others then wait on a new one."""
        waiter = self._waiter
        if waiter is None or waiter.done():
            loop = self._owner._loop  # set when the call was made; asyncio.get_running_loop() makes a getpid() call
            assert loop is not None
            waiter = self._waiter = loop.create_future()
        try:
            await waiter
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is None or task.cancelling():
                raise  # this task was cancelled

    def _wake(self) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # ---- curl's side (its callbacks, on the loop) ----------------------------------------------------

    def _read_body(self, size: int) -> bytes:
        start = self._offset
        chunk = self._body[start : start + size]
        self._offset = start + len(chunk)
        if self._sent():
            self._wake()
        return chunk

    def _sent(self) -> bool:
        return self._offset == len(self._body)

    def _seek_body(self, offset: int, origin: int) -> int:
        """curl sends the request again (a stream the replica refused, or one a GOAWAY left unprocessed)."""
        if origin != 0 or not 0 <= offset <= len(self._body):
            return pycurl.SEEKFUNC_CANTSEEK
        self._offset = offset
        return pycurl.SEEKFUNC_OK

    def _on_data(self, data: bytes) -> int | None:
        buf = self._buf
        buf += data
        start = 0
        while len(buf) - start >= _PREFIX:
            length = int.from_bytes(buf[start + 1 : start + _PREFIX], "big")
            if buf[start] != 0 or length > MAX_MESSAGE_BYTES:
                why = "a compressed message (none was asked for)" if buf[start] else f"a message of {length} bytes"
                self._error = self._rpc_error(grpc.StatusCode.INTERNAL, f"the replica sent {why}")
                return 0  # curl ends the transfer (CURLE_WRITE_ERROR); the error above is the call's
            end = start + _PREFIX + length
            if len(buf) < end:
                break
            self._messages.append(bytes(buf[start + _PREFIX : end]))
            start = end
        if start:
            del buf[:start]
            self._wake()
        return None

    def _resend(self, errno: int) -> bool:
        """Whether curl should send the call again, rewound: once, when it failed on a connection that curl
        reused and found dead (see the module docstring), with nothing back. Mostly the replica never read it (its
        socket was closed before). One that read it and died before answering is gone: the new connection finds
        it so (UNAVAILABLE), or finds it restarted, and running the request there is what a retry would do. The
        call's deadline stays: the new attempt gets what is left of it, in curl's timeout and in `grpc-timeout`,
        and a call with none left is not sent again."""
        if self._resent or errno not in _DEAD_CONNECTION or self._lines or self._buf or self._messages:
            return False
        curl = self._curl
        assert curl is not None
        if curl.getinfo(pycurl.NUM_CONNECTS):  # it went out on a connection of its own: not a reused one
            return False
        if self._deadline is not None:
            loop = self._owner._loop
            assert loop is not None
            ms = int((self._deadline - loop.time()) * 1000)
            if ms < 1:
                return False
            _with_deadline(curl, self._headers, ms)
        self._resent = True
        self._offset = 0
        return True

    def _finished(self, errno: int, message: str) -> None:
        """curl ended the transfer: errno 0 when the HTTP/2 stream ended, whatever its gRPC status."""
        if self._error is not None:  # set while reading (a malformed message)
            self._end(self._error)
            return
        if errno:
            if errno == pycurl.E_OPERATION_TIMEDOUT and self._past_deadline():
                code = grpc.StatusCode.DEADLINE_EXCEEDED
            elif errno in _UNAVAILABLE or errno == pycurl.E_OPERATION_TIMEDOUT:  # that one: connecting timed out
                code = grpc.StatusCode.UNAVAILABLE
            else:
                code = grpc.StatusCode.UNKNOWN
            self._end(self._rpc_error(code, f"{message} (curl error {errno})"))
            return
        if _OK_LINE in self._lines and not self._buf:  # the common case, without parsing the headers
            self._end(None)
            return
        status = self._field("grpc-status")
        if status is None:
            assert self._curl is not None
            http = self._curl.getinfo(pycurl.RESPONSE_CODE)
            code = grpc.StatusCode.INTERNAL if http == 200 else _HTTP_STATUS.get(http, grpc.StatusCode.UNKNOWN)
            self._end(self._rpc_error(code, f"the replica answered HTTP {http} without a gRPC status"))
            return
        value = int(status) if status.isascii() and status.isdigit() else -1
        code = _STATUS_BY_VALUE.get(value, grpc.StatusCode.UNKNOWN)
        if code is grpc.StatusCode.OK:
            if self._buf:
                why = f"the stream ended inside a message ({len(self._buf)} bytes)"
                self._end(self._rpc_error(grpc.StatusCode.INTERNAL, why))
            else:
                self._end(None)
            return
        self._end(self._rpc_error(code, unquote(self._field("grpc-message") or "")))

    def _past_deadline(self) -> bool:
        """Whether curl's timeout was the call's deadline (and not its connect timeout)."""
        if self._deadline is None:
            return False
        loop = self._owner._loop
        assert loop is not None
        return loop.time() >= self._deadline - 0.01

    def _parsed_headers(self) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
        """The headers and the trailers, parsed."""
        headers: list[tuple[str, str]] = []
        trailers: list[tuple[str, str]] = []
        into = headers
        for raw in self._lines:
            text = raw.decode("latin-1").rstrip("\r\n")
            if not text:
                into = trailers
                continue
            name, sep, value = text.partition(":")
            if sep:  # not the status line ("HTTP/2 200")
                into.append((name.strip().lower(), value.strip()))
        return headers, trailers

    def _field(self, name: str) -> str | None:
        """A trailer; or, in a trailers-only answer (an error before any message), the same header."""
        headers, trailers = self._parsed_headers()
        for key, value in trailers or headers:
            if key == name:
                return value
        return None

    def _rpc_error(self, code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
        headers, trailers = self._parsed_headers()
        return grpc.aio.AioRpcError(code, grpc.aio.Metadata(*headers), grpc.aio.Metadata(*trailers), details)

    def _end(self, error: BaseException | None) -> None:
        self._done = True
        self._error = error
        if self._reaper is not None:
            self._reaper.cancel()
        self._wake()


class CurlGrpc:
    """The curl multi handle and its integration with the running event loop (made on first use, so
    one loop owns it); idle easy handles are kept for the next call."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._multi: pycurl.CurlMulti | None = None
        self._calls: dict[pycurl.Curl, StreamCall] = {}
        self._idle: list[pycurl.Curl] = []
        self._poller: select.epoll | None = None  # curl's sockets; the loop watches this one fd
        self._fds: dict[int, int] = {}  # fd -> the epoll events it is watched for
        self._timer: asyncio.Handle | None = None  # call_at gives a plain Handle for a time already past
        self._due = 0.0  # when it fires (loop time)

    def unary_stream(
        self,
        target: str,
        method: str,
        request: bytes,
        deserialize: Callable[[bytes], M],
        *,
        timeout_s: float | None = None,
        metadata: Sequence[tuple[str, str]] = (),
    ) -> StreamCall[M]:
        """Start `method` ("/package.Service/Method") on `target` (host:port) with `request`, the serialized
        request message. curl sends it on the loop's next turn, on its 0 ms timer, with every other call started
        in this turn: one pass of curl over its transfers for all of them. Started one at a time, each call cost
        a pass of its own, and the router spent 12-20% more CPU per request at 64 connections, and the replicas
        about 10% more."""
        multi = self._multi or self._open()
        body = len(request).to_bytes(_PREFIX, "big") + request
        curl = self._idle.pop() if self._idle else self._new_handle()
        headers = [*_REQUEST_HEADERS, *(f"{k}: {v}" for k, v in metadata)]
        deadline = None
        if timeout_s is not None:
            ms = max(1, int(timeout_s * 1000))
            _with_deadline(curl, headers, ms)
            assert self._loop is not None
            deadline = self._loop.time() + ms / 1000
        else:
            curl.setopt(pycurl.TIMEOUT_MS, 0)
            curl.setopt(pycurl.HTTPHEADER, headers)
        call: StreamCall[M] = StreamCall(self, target, method, body, deserialize, deadline, headers)
        curl.setopt(pycurl.URL, f"http://{target}{method}")
        curl.setopt(pycurl.POSTFIELDSIZE, len(call._body))
        curl.setopt(pycurl.READFUNCTION, call._read_body)
        curl.setopt(pycurl.SEEKFUNCTION, call._seek_body)
        curl.setopt(pycurl.HEADERFUNCTION, call._lines.append)  # parsed only when read
        curl.setopt(pycurl.WRITEFUNCTION, call._on_data)
        call._curl = curl
        self._calls[curl] = call
        multi.add_handle(curl)  # curl asks for a 0 ms timer: the loop's next turn
        return call

    def fail_target(self, target: str, details: str) -> None:
        """End every running call to `target` as CANCELLED (a worker taken out of the registry): their
        streams are reset, and the router treats them as it does any call the replica's loss ended."""
        for call in [c for c in self._calls.values() if c.target == target]:
            self.remove(call)
            call._end(call._rpc_error(grpc.StatusCode.CANCELLED, details))

    def remove(self, call: StreamCall) -> None:
        """Take a running call off the multi handle (curl resets its stream)."""
        curl = call._curl
        if curl is not None and self._calls.pop(curl, None) is call:
            assert self._multi is not None
            self._multi.remove_handle(curl)
            self._recycle(curl)

    def close(self) -> None:
        for call in list(self._calls.values()):
            call.cancel()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for curl in self._idle:
            curl.close()
        self._idle.clear()
        if self._multi is not None:
            self._multi.close()  # closes its connections
            self._multi = None
        if self._poller is not None:
            if self._loop is not None and not self._loop.is_closed():
                self._loop.remove_reader(self._poller.fileno())
            self._poller.close()
            self._poller = None
        self._fds.clear()

    # ---- curl <-> the event loop ----------------------------------------------------------------------

    def _open(self) -> pycurl.CurlMulti:
        """The multi handle, and the epoll instance its sockets are watched in.

        curl asks to watch a socket when a call starts on an idle connection and to forget it when the last
        call on it ends; at one request at a time, that is every request, for the connection and for the
        eventfd curl watches beside it. Each `add_reader` makes the loop a poll handle (an fd check of two
        `epoll_ctl`, a non-blocking `ioctl`, an `epoll_ctl` to add it, later three to remove it), 15 system calls
        a request in all. In an epoll of our own each change is one `epoll_ctl`, and the loop watches only that
        epoll's fd, which is readable while any socket in it is ready."""
        self._loop = asyncio.get_running_loop()
        self._poller = select.epoll()
        self._loop.add_reader(self._poller.fileno(), self._on_ready)
        multi = pycurl.CurlMulti()
        multi.setopt(pycurl.M_PIPELINING, pycurl.PIPE_MULTIPLEX)
        multi.setopt(pycurl.M_SOCKETFUNCTION, self._on_socket)
        multi.setopt(pycurl.M_TIMERFUNCTION, self._on_timer)
        self._multi = multi
        return multi

    @staticmethod
    def _new_handle() -> pycurl.Curl:
        curl = pycurl.Curl()
        curl.setopt(pycurl.HTTP_VERSION, pycurl.CURL_HTTP_VERSION_2_PRIOR_KNOWLEDGE)
        curl.setopt(pycurl.POST, 1)
        curl.setopt(pycurl.PIPEWAIT, 1)  # wait to share the replica's connection rather than open another
        curl.setopt(pycurl.NOSIGNAL, 1)
        curl.setopt(pycurl.CONNECTTIMEOUT_MS, CONNECT_TIMEOUT_MS)
        curl.setopt(pycurl.TCP_NODELAY, 1)
        curl.setopt(pycurl.TCP_KEEPALIVE, 1)
        curl.setopt(pycurl.TCP_KEEPIDLE, KEEPALIVE_IDLE_S)
        curl.setopt(pycurl.TCP_KEEPINTVL, KEEPALIVE_INTERVAL_S)
        curl.setopt(pycurl.SOCKOPTFUNCTION, _bound_socket)
        return curl

    def _recycle(self, curl: pycurl.Curl) -> None:
        if len(self._idle) >= MAX_IDLE_HANDLES:
            curl.close()
            return
        for option in (pycurl.READFUNCTION, pycurl.SEEKFUNCTION, pycurl.HEADERFUNCTION, pycurl.WRITEFUNCTION):
            curl.unsetopt(option)  # the finished call is not kept alive by its handle
        self._idle.append(curl)

    def _on_socket(self, what: int, fd: int, multi: object, socketp: object) -> None:
        poller = self._poller
        if poller is None:
            return
        new = _EPOLL_EVENTS.get(what, 0)
        old = self._fds.pop(fd, 0)
        try:
            if not new:
                poller.unregister(fd)
            elif old:
                poller.modify(fd, new)
            else:
                poller.register(fd, new)
        except FileNotFoundError:  # closed, so the epoll dropped it (and its number may be a new socket's now)
            if new:
                poller.register(fd, new)
        except FileExistsError:
            poller.modify(fd, new)
        except OSError:  # a REMOVE after curl closed it
            if new:
                raise
        if new:
            self._fds[fd] = new

    def _on_ready(self) -> None:
        """The epoll has ready sockets: curl reads and writes them (level-triggered: what is left is reported
        again, so a batch cut at `_READY_BATCH` loses nothing)."""
        poller = self._poller
        if poller is None:
            return
        for fd, events in poller.poll(0, _READY_BATCH):
            asked = self._fds.get(fd)
            if asked is None:
                # Not curl's (any more): an earlier socket's action in this batch made curl forget it, or the
                # epoll kept a socket curl stopped watching. Left in, it would wake the loop forever.
                with contextlib.suppress(OSError):
                    poller.unregister(fd)
                continue
            if events & _EPOLL_BROKEN:
                events |= asked
            self._act(fd, _CSELECT[events & (asked | select.EPOLLERR)])  # only what curl asked for

    def _on_timer(self, ms: int) -> None:
        """curl's next timeout moved. A timer already due sooner is kept: firing early only makes curl
        check its timeouts and name the next one (cheaper than a new timer on every call, as curl asks)."""
        loop = self._loop
        assert loop is not None
        if ms < 0:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            return
        due = loop.time() + ms / 1000
        if self._timer is not None:
            if self._due <= due:
                return
            self._timer.cancel()
        self._timer, self._due = loop.call_at(due, self._on_timeout), due

    def _on_timeout(self) -> None:
        self._timer = None
        self._act(pycurl.SOCKET_TIMEOUT, 0)

    def _act(self, fd: int, events: int) -> None:
        multi = self._multi
        if multi is None:
            return
        while True:
            ret, running = multi.socket_action(fd, events)
            if ret != pycurl.E_CALL_MULTI_PERFORM:
                break
        if running < len(self._calls):  # some ended: collect them
            self._collect(multi)

    def _collect(self, multi: pycurl.CurlMulti) -> None:
        while True:
            queued, ok, failed = multi.info_read()
            for curl in ok:
                self._complete(multi, curl, 0, "")
            for curl, errno, message in failed:
                self._complete(multi, curl, errno, message)
            if not queued:
                break

    def _complete(self, multi: pycurl.CurlMulti, curl: pycurl.Curl, errno: int, message: str) -> None:
        call = self._calls.pop(curl, None)
        multi.remove_handle(curl)
        if call is not None and errno and call._resend(errno):
            logger.info(
                "%s to %s: its connection had closed (%s); sent again on a new one", call.method, call.target, message
            )
            self._calls[curl] = call
            multi.add_handle(curl)
            return
        try:
            if call is not None:
                call._finished(errno, message)
        except Exception as e:  # whatever a peer sent, the call ends (a hang would hold its request forever)
            logger.exception(
                "%s: its answer could not be read", f"{call.method} to {call.target}" if call else "a call"
            )
            if call is not None and not call._done:
                call._end(grpc.aio.AioRpcError(grpc.StatusCode.INTERNAL, details=f"unreadable answer: {e!r}"))
        finally:
            self._recycle(curl)
