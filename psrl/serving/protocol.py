"""The bounds on what one connection to our HTTP servers can hold, and the uvicorn protocol that applies them.

- A request head must arrive whole within `header_timeout_s` of the connection opening (or of its first byte,
  on a kept-alive connection); a connection that never sends one is closed.
- A body is counted as it arrives: a Content-Length over `max_body_bytes` is refused before any of it is
  read, a chunked body as soon as it passes the limit (413).
- A body that stalls (no bytes for `body_timeout_s` while the server waits for them) is refused (408).
- Framing errors get the server's JSON error (400 `invalid_http_request`) instead of a text/plain one.

Nothing here runs once the request is read: a long generation or a stream is never cut. Idle kept-alive
connections stay bounded by the keep-alive timeout.

The timeouts (these and the keep-alive one) are deadlines, not timers armed and cancelled per request: arming
one only records when it is due, and each connection keeps a single loop timer, set for the earliest deadline.
When it fires, what is due runs and it is set again for what is left. A request costs no timer operations:
a loop timer armed and cancelled per timeout (4 a request, the keep-alive one included) cost about 10 us of
CPU a request, a third of what uvicorn's own HTTP handling costs.

`ConnectionGuard` holds that part, shared by both of our server protocols: `GuardedHttpToolsProtocol` here
(uvicorn's httptools protocol, for ASGI apps: the SessionRouter) and `psrl.serving.http1` (the router's).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from asyncio import TimerHandle
from collections.abc import Callable
from typing import Any, cast

from uvicorn.config import Config
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol
from uvicorn.server import ServerState

from psrl.serving.limits import HttpLimits

logger = logging.getLogger("psrl.serving")

# After an error answer, how long the rest of the client's upload is read (and dropped) before the connection
# closes: closing a socket with unread data resets it, and a client still sending would lose the answer.
LINGER_S = 2.0

# A deadline this close is due: loop timers round to the millisecond and may fire that much early.
_DUE_S = 0.001

# (code, message) -> the error body in the server's own JSON shape.
RenderError = Callable[[str, str], bytes]


class ConnectionGuard:
    """The limits of one connection, for a protocol that sets `loop`, `transport`, `flow` (uvicorn's flow
    control: reading is paused while the server is not taking what arrives), `server_state` and `client`, and
    implements the hooks below.

    The protocol calls `_guard_begin` when a request head begins, `_guard_head_done` when it is whole (a false
    answer: refused), `_guard_body` for each body part (the same), and `_guard_end` once the body is whole."""

    loop: asyncio.AbstractEventLoop
    transport: asyncio.Transport
    flow: FlowControl
    server_state: ServerState
    client: tuple[str, int] | None

    def _init_guard(self, limits: HttpLimits, render_error: RenderError) -> None:
        self.limits = limits
        self.render_error = render_error
        # Deadlines (loop time) of what is awaited; None: not awaited. `_timer` fires at `_timer_at`, no later
        # than the earliest of them (see the module's docstring).
        self._head_deadline: float | None = None  # the request head being received
        self._body_deadline: float | None = None  # the next bytes of the request body
        self._idle_deadline: float | None = None  # keep-alive: the next request
        self._timer: TimerHandle | None = None
        self._timer_at = 0.0
        self._linger_timer: TimerHandle | None = None
        self._head_started = False  # a request head is being received
        self._body_bytes = 0  # of the request being received
        self._rejected = False  # answered with an error: the connection only drains and closes
        self._deferred_error: tuple[int, str, str] | None = None  # to answer once the earlier request is answered

    # ---- what the protocol implements ------------------------------------------------------------------

    def _idle(self) -> bool:
        """No request is being received past its head, or answered."""
        raise NotImplementedError

    def _reject(self, status: int, code: str, message: str) -> None:
        """Answer the request being received with an error and end the connection (see `_answer_error`)."""
        raise NotImplementedError

    def _on_idle_timeout(self) -> None:
        """Keep-alive: no next request came in time."""
        if not self.transport.is_closing():
            self.transport.close()

    # ---- the request being received --------------------------------------------------------------------

    def _guard_begin(self) -> None:
        self._head_started = True
        self._body_bytes = 0
        if self._head_deadline is None:
            self._arm_head_timer()

    def _guard_head_done(self, declared_length: int | None) -> bool:
        self._head_deadline = None
        self._head_started = False
        limit = self.limits.max_body_bytes
        if declared_length is not None and declared_length > limit:
            self._reject(413, "payload_too_large", f"request body is {declared_length} bytes; the limit is {limit}")
            return False
        self._arm_body_timer()
        return True

    def _guard_body(self, size: int) -> bool:
        self._body_bytes += size
        limit = self.limits.max_body_bytes
        if self._body_bytes > limit:
            self._reject(413, "payload_too_large", f"request body is over the limit of {limit} bytes")
            return False
        self._arm_body_timer()  # the timeout bounds a silence, not the whole upload
        return True

    def _guard_end(self) -> None:
        self._body_deadline = None

    def _guard_stray_bytes(self) -> None:
        """After bytes were parsed: bytes that began no request (stray line breaks) restart the wait for one."""
        if (
            self._head_deadline is None
            and self._idle_deadline is None
            and self._idle()
            and not self._rejected
            and not self.transport.is_closing()
        ):
            self._arm_head_timer()

    def _guard_lost(self) -> None:
        self._head_deadline = self._body_deadline = self._idle_deadline = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._linger_timer is not None:
            self._linger_timer.cancel()
            self._linger_timer = None

    # ---- timers ----------------------------------------------------------------------------------------

    def _arm_head_timer(self) -> None:
        self._head_deadline = self._due(self.limits.header_timeout_s)

    def _arm_body_timer(self) -> None:
        self._body_deadline = self._due(self.limits.body_timeout_s)

    def _arm_idle_timer(self, timeout: float) -> None:
        self._idle_deadline = self._due(timeout)

    def _cancel_timers(self) -> None:
        self._head_deadline = None
        self._body_deadline = None

    def _due(self, delay: float) -> float:
        """The deadline `delay` from now, with the connection's timer set to fire by then."""
        at = self.loop.time() + delay
        if self._timer is None or at < self._timer_at:
            self._schedule(at)
        return at

    def _schedule(self, at: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = at
        self._timer = self.loop.call_at(at, self._on_timer)

    def _on_timer(self) -> None:
        """Run what is due, earliest first (each at most once: a handler may set its deadline again), then set
        the timer for what is left."""
        self._timer = None
        now = self.loop.time() + _DUE_S
        fired = [False, False, False]
        while True:
            pending = [
                (at, kind)
                for kind, at in enumerate((self._head_deadline, self._body_deadline, self._idle_deadline))
                if at is not None
            ]
            if not pending:
                return
            at, kind = min(pending)
            if at > now or fired[kind]:
                break
            fired[kind] = True
            if kind == 0:
                self._head_deadline = None
                self._on_head_timeout()
            elif kind == 1:
                self._body_deadline = None
                self._on_body_timeout()
            else:
                self._idle_deadline = None
                self._on_idle_timeout()
        at = min(at for at, _ in pending)
        if self._timer is None or at < self._timer_at:
            self._schedule(at)

    def _on_head_timeout(self) -> None:
        if self.transport.is_closing():
            return
        if not self._idle():
            self._arm_head_timer()  # a pipelined head waits while the request before it is answered
        elif self._head_started:
            t = self.limits.header_timeout_s
            self._reject(408, "request_timeout", f"the request head did not arrive within {t:g} s")
        else:
            self.transport.close()  # nothing was asked: nothing to answer

    def _on_body_timeout(self) -> None:
        if self.transport.is_closing():
            return
        if self.flow.read_paused:
            self._arm_body_timer()  # the server has not taken what arrived yet: the client is not stalling
            return
        t = self.limits.body_timeout_s
        self._reject(408, "request_timeout", f"the request body stalled: no data for {t:g} s")

    # ---- ending a connection with an error ---------------------------------------------------------------

    def _answer_error(self, status: int, code: str, message: str) -> None:
        """Write the error, then read (and drop) what the client still sends for a while before closing."""
        logger.info("%s: %s %s: %s", self.client, status, code, message)
        body = self.render_error(code, message)
        head = [STATUS_LINE[status]]
        for name, value in self.server_state.default_headers:
            head += [name, b": ", value, b"\r\n"]
        head += [
            b"content-type: application/json\r\n",
            b"content-length: %d\r\n" % len(body),
            b"x-smg-error-code: " + code.encode("ascii") + b"\r\n",
            b"connection: close\r\n\r\n",
        ]
        self.transport.write(b"".join(head) + body)
        self.flow.resume_reading()
        if self.transport.can_write_eof():
            self.transport.write_eof()  # the answer is complete: the client reads it, then closes
        self._linger_timer = self.loop.call_later(LINGER_S, self.transport.close)


class GuardedHttpToolsProtocol(ConnectionGuard, HttpToolsProtocol):
    """One connection: uvicorn's httptools protocol with the limits above."""

    def __init__(
        self,
        config: Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
        *,
        limits: HttpLimits,
        render_error: RenderError,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self._init_guard(limits, render_error)

    # ---- connection ------------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._guard_lost()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._rejected:
            return  # the rest of an upload we already answered: dropped
        super().data_received(data)
        self._guard_stray_bytes()

    def send_400_response(self, msg: str) -> None:
        # uvicorn calls this on a parser error; answer it in the server's JSON shape.
        self._reject(400, "invalid_http_request", "malformed HTTP request (the parser rejected it)")

    # ---- parser callbacks ------------------------------------------------------------------------------

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._guard_begin()

    def on_headers_complete(self) -> None:
        if self._guard_head_done(self._declared_length()):
            super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        if not self._rejected and self._guard_body(len(body)):
            super().on_body(body)

    def on_message_complete(self) -> None:
        if self._rejected:
            return
        self._guard_end()
        super().on_message_complete()

    def _declared_length(self) -> int | None:
        for name, value in self.headers:
            if name == b"content-length":
                try:
                    return int(value)
                except ValueError:
                    return None  # the parser validates it; nothing to compare
        return None

    # ---- the guard's hooks -----------------------------------------------------------------------------

    def _idle(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    # uvicorn's keep-alive timeout, as a deadline: uvicorn arms it once a response is complete and clears it
    # when bytes arrive (or the connection is lost).

    def _unset_keepalive_if_required(self) -> None:
        self._idle_deadline = None

    def _reject(self, status: int, code: str, message: str) -> None:
        """Answer the request being received with an error and end the connection. If the app already runs
        that request it sees the client leave (its receive() answers http.disconnect, its send() is a no-op).
        An earlier request still being answered on this connection (pipelining) gets its answer first."""
        self._rejected = True
        self._cancel_timers()
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            if self._head_started or not cycle.more_body:
                # `cycle` is an earlier request, received whole: the error follows its answer.
                self._deferred_error = (status, code, message)
                return
            cycle.disconnected = True  # the app runs the request being received: it sees the client leave
            cycle.message_event.set()
            if cycle.response_started:  # a second answer would corrupt the one begun: only close
                self.transport.close()
                return
        self._answer_error(status, code, message)

    def on_response_complete(self) -> None:
        self.server_state.total_requests += 1
        if self._deferred_error is None:
            # uvicorn's, with its keep-alive timer as a deadline.
            if self.transport.is_closing():
                return
            self._idle_deadline = None
            self.flow.resume_reading()  # reading paused while the app was busy, if it was
            if self.pipeline:  # a pipelined request waits: start it
                cycle, app = self.pipeline.pop()
                self._start_asgi_task(cycle, app)
            else:
                self._arm_idle_timer(self.timeout_keep_alive)
            return
        if not self.transport.is_closing():
            self._answer_error(*self._deferred_error)
        self._deferred_error = None


def guarded_protocol(limits: HttpLimits, render_error: RenderError) -> type[asyncio.Protocol]:
    """What to give uvicorn as `http=`: it builds one protocol per connection from it."""
    factory = functools.partial(GuardedHttpToolsProtocol, limits=limits, render_error=render_error)
    return cast(type[asyncio.Protocol], factory)
