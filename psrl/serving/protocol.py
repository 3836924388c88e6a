"""The uvicorn HTTP protocol both servers run: httptools' parser, plus bounds on what one connection can hold.

- A request head must arrive whole within `header_timeout_s` of the connection opening (or of its first byte,
  on a kept-alive connection); a connection that never sends one is closed.
- A body is counted as it arrives: a Content-Length over `max_body_bytes` is refused before any of it is
  read, a chunked body as soon as it passes the limit (413).
- A body that stalls (no bytes for `body_timeout_s` while the app waits for them) is refused (408).
- Framing errors get the server's JSON error (400 `invalid_http_request`) instead of uvicorn's text/plain.

Nothing here runs once the request is read: a long generation or a stream is never cut. Idle kept-alive
connections stay bounded by uvicorn's `timeout_keep_alive`.

The timeouts (these and the keep-alive one) are deadlines, not timers armed and cancelled per request: arming
one only records when it is due, and each connection keeps a single loop timer, set for the earliest deadline.
When it fires, what is due runs and it is set again for what is left. A request costs no timer operations:
a loop timer armed and cancelled per timeout (4 a request, the keep-alive one included) cost about 10 us of
CPU a request, a third of what uvicorn's own HTTP handling costs.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from asyncio import TimerHandle
from collections.abc import Callable
from typing import Any, cast

from uvicorn.config import Config
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


class GuardedHttpToolsProtocol(HttpToolsProtocol):
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
        self.limits = limits
        self.render_error = render_error
        # Deadlines (loop time) of what is awaited; None: not awaited. `_timer` fires at `_timer_at`, no later
        # than the earliest of them (see the module's docstring).
        self._head_deadline: float | None = None  # the request head being received
        self._body_deadline: float | None = None  # the next bytes of the request body
        self._idle_deadline: float | None = None  # uvicorn's keep-alive: the next request
        self._timer: TimerHandle | None = None
        self._timer_at = 0.0
        self._linger_timer: TimerHandle | None = None
        self._head_started = False  # a request head is being received
        self._body_bytes = 0  # of the request being received
        self._rejected = False  # answered with an error: the connection only drains and closes
        self._deferred_error: tuple[int, str, str] | None = None  # to answer once the earlier request is answered

    # ---- connection ------------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timers()
        self._idle_deadline = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._linger_timer is not None:
            self._linger_timer.cancel()
            self._linger_timer = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._rejected:
            return  # the rest of an upload we already answered: dropped
        super().data_received(data)
        if (
            self._head_deadline is None
            and self._idle_deadline is None
            and self._idle()
            and not self._rejected
            and not self.transport.is_closing()
        ):
            self._arm_head_timer()  # bytes that began no request (stray line breaks) restart the wait for one

    def send_400_response(self, msg: str) -> None:
        # uvicorn calls this on a parser error; answer it in the server's JSON shape.
        self._reject(400, "invalid_http_request", "malformed HTTP request (the parser rejected it)")

    # ---- parser callbacks ------------------------------------------------------------------------------

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_started = True
        self._body_bytes = 0
        if self._head_deadline is None:
            self._arm_head_timer()

    def on_headers_complete(self) -> None:
        self._cancel_head_timer()
        self._head_started = False
        declared = self._declared_length()
        limit = self.limits.max_body_bytes
        if declared is not None and declared > limit:
            self._reject(413, "payload_too_large", f"request body is {declared} bytes; the limit is {limit}")
            return
        super().on_headers_complete()
        self._arm_body_timer()

    def on_body(self, body: bytes) -> None:
        if self._rejected:
            return
        self._body_bytes += len(body)
        limit = self.limits.max_body_bytes
        if self._body_bytes > limit:
            self._reject(413, "payload_too_large", f"request body is over the limit of {limit} bytes")
            return
        super().on_body(body)
        self._arm_body_timer()  # the timeout bounds a silence, not the whole upload

    def on_message_complete(self) -> None:
        if self._rejected:
            return
        self._cancel_body_timer()
        super().on_message_complete()

    # ---- timers ----------------------------------------------------------------------------------------

    def _idle(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _arm_head_timer(self) -> None:
        self._head_deadline = self._due(self.limits.header_timeout_s)

    def _cancel_head_timer(self) -> None:
        self._head_deadline = None

    def _arm_body_timer(self) -> None:
        self._body_deadline = self._due(self.limits.body_timeout_s)

    def _cancel_body_timer(self) -> None:
        self._body_deadline = None

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
                self.timeout_keep_alive_handler()
        at = min(at for at, _ in pending)
        if self._timer is None or at < self._timer_at:
            self._schedule(at)

    # uvicorn's keep-alive timeout, as a deadline: uvicorn arms it once a response is complete and clears it
    # when bytes arrive (or the connection is lost).

    def _unset_keepalive_if_required(self) -> None:
        self._idle_deadline = None

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
            self._arm_body_timer()  # the app has not taken what arrived yet: the client is not stalling
            return
        t = self.limits.body_timeout_s
        self._reject(408, "request_timeout", f"the request body stalled: no data for {t:g} s")

    # ---- ending a connection with an error ---------------------------------------------------------------

    def _declared_length(self) -> int | None:
        for name, value in self.headers:
            if name == b"content-length":
                try:
                    return int(value)
                except ValueError:
                    return None  # the parser validates it; nothing to compare
        return None

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
                self._idle_deadline = self._due(self.timeout_keep_alive)
            return
        if not self.transport.is_closing():
            self._answer_error(*self._deferred_error)
        self._deferred_error = None

    def _answer_error(self, status: int, code: str, message: str) -> None:
        logger.info("%s: %s %s: %s", self.client, status, code, message)
        self._write_error(status, code, message)
        self._linger()

    def _write_error(self, status: int, code: str, message: str) -> None:
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

    def _linger(self) -> None:
        self.flow.resume_reading()
        if self.transport.can_write_eof():
            self.transport.write_eof()  # the answer is complete: the client reads it, then closes
        self._linger_timer = self.loop.call_later(LINGER_S, self.transport.close)


def guarded_protocol(limits: HttpLimits, render_error: RenderError) -> type[asyncio.Protocol]:
    """What to give uvicorn as `http=`: it builds one protocol per connection from it."""
    factory = functools.partial(GuardedHttpToolsProtocol, limits=limits, render_error=render_error)
    return cast(type[asyncio.Protocol], factory)
