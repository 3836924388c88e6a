"""The SessionRouter's HTTP surface: thin FastAPI handlers over `SessionState` and one shared httpx client."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import quote

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Gauge, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from psrl.apis import chat_sse_events, message_sse_events, response_sse_events
from psrl.serving.json_body import loads_bounded
from psrl.session.config import SessionConfig
from psrl.session.state import (
    RANK_HEADER,
    WORKER_HEADER,
    HangState,
    SessionState,
    SessionStore,
    TrajectoryStrategy,
    session_headers_from,
    session_ids_of,
)
from psrl.session.thunder_driver import LocalSessions, ReadError, ThunderDriver, ThunderMetrics

logger = logging.getLogger("psrl.session")

_METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE"]
CHAT_PATH = "v1/chat/completions"
# The agent APIs a session serves as turns, each with the SSE sequence its streaming clients expect.
TURN_APIS: dict[str, Callable[[dict[str, Any]], list[str]]] = {
    CHAT_PATH: chat_sse_events,
    "v1/responses": response_sse_events,
    "v1/messages": message_sse_events,
}


class SessionError(Exception):
    """A typed error at the SessionRouter's boundary; mapped once to a status and `x-smg-error-code`."""

    status = 500
    code = "internal_error"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidBody(SessionError):
    status, code = 400, "invalid_body"


class Unauthorized(SessionError):
    status, code = 401, "unauthorized"


class UnknownSession(SessionError):
    status, code = 404, "session_not_found"


class SessionClosing(SessionError):
    status, code = 409, "session_closing"


class UpstreamUnavailable(SessionError):
    status, code = 502, "router_unavailable"


def render_error(code: str, message: str) -> bytes:
    """The SessionRouter's error body (the code travels as `x-smg-error-code`), also for what its HTTP layer
    refuses before a handler runs (too large, too slow, malformed framing)."""
    return json.dumps({"error": message}).encode()


def _passthrough_headers(upstream: httpx.Response) -> dict[str, str]:
    """What the client sees of the router's answer: its x-* headers (instance, version, request id)."""
    return {k: v for k, v in upstream.headers.items() if k.lower().startswith("x-")}


def _upstream_response(upstream: httpx.Response, extra: dict[str, str] | None = None) -> Response:
    headers = _passthrough_headers(upstream)
    headers.update(extra or {})
    return Response(
        content=upstream.content,
        status_code=upstream.status_code,
        headers=headers,
        media_type=upstream.headers.get("content-type"),
    )


def _json_body(raw: bytes) -> dict[str, Any]:
    try:
        body = loads_bounded(raw)
    except ValueError as e:
        raise InvalidBody(str(e)) from None
    if not isinstance(body, dict):
        raise InvalidBody("the JSON body must be an object")
    return body


def _wants_stream(body: dict[str, Any]) -> bool:
    """`stream` as the router reads it: absent, null or a boolean; anything else is the client's mistake."""
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise InvalidBody(f"'stream' must be a boolean, got {type(stream).__name__}")
    return bool(stream)


def _include_usage(body: dict[str, Any]) -> bool:
    """`stream_options.include_usage` as the router reads it: the streamed reply then ends with a usage chunk."""
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise InvalidBody("'stream_options' must be an object")
    include = options.get("include_usage")
    if include is not None and not isinstance(include, bool):
        raise InvalidBody(f"'stream_options.include_usage' must be a boolean, got {type(include).__name__}")
    return bool(include)


def _authorization(request: Request) -> dict[str, str]:
    """The client's own credentials for the router, forwarded as given."""
    auth = request.headers.get("authorization")
    return {"authorization": auth} if auth is not None else {}


def _reopen(state: SessionState, was_hung: bool) -> None:
    """Undo `start_closing` after a DELETE the router refused: the session goes on as it was."""
    state.closing = False
    if was_hung:
        state.hang()


async def _until_client_leaves(request: Request, work: Awaitable[httpx.Response]) -> httpx.Response:
    """`work` (a turn's upstream call), cancelled if the client disconnects first: the router then sees its
    caller go and aborts the generation. ClientDisconnect in that case. The request's body is read already."""

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    call = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait((call, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not call.done():
            call.cancel()
        await asyncio.gather(call, watcher, return_exceptions=True)
    if call.cancelled():
        raise ClientDisconnect()
    return call.result()


def _json_of(upstream: httpx.Response) -> Any:
    """The answer's JSON body, or None when it is not JSON."""
    try:
        return upstream.json()
    except ValueError:
        return None


class SessionRouter:
    """Owns the session table and the upstream client; the FastAPI routes call into it."""

    def __init__(self, config: SessionConfig, transport: httpx.AsyncBaseTransport | None = None) -> None:
        config.validate()
        self.config = config
        self.sessions = SessionStore()
        self.strategy: TrajectoryStrategy = "auto" if config.trajectory_id_strategy == "auto" else "manual"
        self._transport = transport
        self._client: httpx.AsyncClient | None = None
        self.metrics = CollectorRegistry()
        Gauge("psrl_session_sessions", "sessions this SessionRouter holds", registry=self.metrics).set_function(
            lambda: len(self.sessions.all())
        )
        self.thunder: ThunderDriver | None = None
        if config.session_strategy == "thunder_agent":
            local = LocalSessions(lambda: [s.summary() for s in self.sessions.all()], self.hang, self.resume)
            self.thunder = ThunderDriver(config.thunder, self.router_json, local, ThunderMetrics(self.metrics))

    # ---- upstream -------------------------------------------------------------------------------------

    @property
    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            raise RuntimeError("the upstream client lives in the app's lifespan")
        return self._client

    async def open(self) -> None:
        c = self.config
        self._client = httpx.AsyncClient(
            base_url=c.router_url,
            transport=self._transport,
            timeout=httpx.Timeout(c.request_timeout_s, connect=c.connect_timeout_s),
            limits=httpx.Limits(max_connections=c.max_connections, max_keepalive_connections=c.max_connections),
        )

    async def close(self) -> None:
        if self.thunder is not None:
            await self.thunder.stop()
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def upstream(
        self, method: str, path: str, *, headers: dict[str, str] | None = None, **kwargs: Any
    ) -> httpx.Response:
        """One call to the router. The client's Authorization goes along; without one, `router_api_key`."""
        headers = dict(headers or {})
        key = self.config.router_api_key
        if key and not any(name.lower() == "authorization" for name in headers):
            headers["authorization"] = f"Bearer {key}"
        # Header values go on as the bytes they came as (ASGI servers decode them as latin-1).
        raw = [(name.encode("latin-1"), value.encode("latin-1", "replace")) for name, value in headers.items()]
        try:
            return await self.client.request(method, quote(path, safe="/"), headers=raw, **kwargs)
        except httpx.TransportError as e:
            raise UpstreamUnavailable(f"router unreachable: {type(e).__name__}: {e}") from e

    async def router_json(self, path: str) -> Any:
        """GET one of the router's admin endpoints (the strategy's reads), with `router_admin_api_key`."""
        key = self.config.router_admin_api_key
        headers = {"authorization": f"Bearer {key}"} if key else {}
        try:
            upstream = await self.upstream("GET", path, headers=headers, timeout=self.config.connect_timeout_s)
        except UpstreamUnavailable as e:
            raise ReadError(e.message) from e
        if not upstream.is_success:
            raise ReadError(f"GET {path}: the router answered {upstream.status_code}: {upstream.text:.200}")
        try:
            return upstream.json()
        except ValueError as e:
            raise ReadError(f"GET {path}: the router's answer is not JSON") from e

    # ---- sessions -------------------------------------------------------------------------------------

    def state(self, sid: str) -> SessionState:
        state = self.sessions.get(sid)
        if state is None:
            raise UnknownSession(f"session {sid!r} not found")
        return state

    async def create(self, request: Request) -> Response:
        upstream = await self.upstream("POST", "/tito/sessions", headers=_authorization(request))
        if upstream.status_code >= 300:
            return _upstream_response(upstream)
        sid = upstream.json()["session_id"]
        state = SessionState(sid, headers=session_headers_from(request.headers))
        self.sessions.add(state)
        if self.thunder is not None and not self.thunder.admit(sid):
            state.hang()  # held: its first turn waits until a round of the strategy admits it
        return JSONResponse({"session_id": sid})

    async def get(self, sid: str, request: Request) -> Response:
        upstream = await self.upstream("GET", f"/tito/sessions/{sid}", headers=_authorization(request))
        extra: dict[str, str] = {}
        state = self.sessions.get(sid)
        if state is not None and state.base_worker_id is not None:
            extra[WORKER_HEADER] = state.base_worker_id
            if state.target_dp_rank is not None:
                extra[RANK_HEADER] = state.target_dp_rank
        return _upstream_response(upstream, extra)

    async def delete(self, sid: str, request: Request) -> Response:
        """Close the session here and on the router. The local state goes only once the router's is gone
        (deleted, or unknown to it); a refused or failed delete leaves the session as it was."""
        state = self.sessions.get(sid)
        was_hung = False
        if state is not None:
            was_hung = state.hang_state == HangState.HUNG or state.marked_for_hang
            state.start_closing()
            await state.drained.wait()
        try:
            upstream = await self.upstream("DELETE", f"/tito/sessions/{sid}", headers=_authorization(request))
        except UpstreamUnavailable:
            if state is not None:
                _reopen(state, was_hung)
            raise
        if upstream.is_success or upstream.status_code == 404:
            self.sessions.remove(sid)
        elif state is not None:
            _reopen(state, was_hung)
        return _upstream_response(upstream)

    # ---- turns ----------------------------------------------------------------------------------------

    async def _admit(self, state: SessionState) -> None:
        """Wait out a hang; refuse a closing session. Returns with no await between the checks and the caller's
        begin_turn, so a hang or close cannot slip in between."""
        if state.closing:
            raise SessionClosing("session is closing")
        while state.hang_state == HangState.HUNG and not state.closing:
            await state.continue_event.wait()
        if state.closing:
            raise SessionClosing("session is closing")

    async def api_turn(self, sid: str, path: str, request: Request) -> Response:
        """A turn on one of the agent APIs (`TURN_APIS`): sent upstream non-streamed, after the trajectory's
        previous turn; a client that asked for a stream gets the API's SSE sequence built from the buffered
        result. Log-probs are the client's to ask for: the router records every sampled token's log-prob in the
        TITO turn whether or not the reply carries them."""
        state = self.state(sid)
        body = _json_body(await request.body())
        wants_stream = _wants_stream(body)
        include_usage = path == CHAT_PATH and _include_usage(body)
        body["stream"] = False
        body.pop("stream_options", None)
        content = json.dumps(body).encode()
        upstream, result = await self._turn(state, request, f"/{path}", content, {"content-type": "application/json"})
        if not upstream.is_success or not wants_stream or not isinstance(result, dict):
            return _upstream_response(upstream)
        events = chat_sse_events(result, include_usage) if path == CHAT_PATH else TURN_APIS[path](result)

        async def stream() -> AsyncIterator[str]:
            for event in events:
                yield event

        return StreamingResponse(stream(), media_type="text/event-stream", headers=_passthrough_headers(upstream))

    async def forward(self, sid: str, path: str, request: Request) -> Response:
        """Any other path under a session goes to the router's `/{path}` with the same header treatment; a POST
        counts as a turn (after the trajectory's previous turn; hang, closing, in-flight, instance and version)."""
        state = self.state(sid)
        raw = await request.body()
        if request.method == "POST":
            upstream, _ = await self._turn(state, request, f"/{path}", raw, params=request.query_params)
            return _upstream_response(upstream)
        headers, _ = state.turn_headers(request.headers, self.strategy)
        upstream = await self.upstream(
            request.method, f"/{path}", content=raw, headers=headers, params=request.query_params
        )
        return _upstream_response(upstream)

    async def _turn(
        self,
        state: SessionState,
        request: Request,
        path: str,
        content: bytes,
        extra_headers: dict[str, str] | None = None,
        params: Any = None,
    ) -> tuple[httpx.Response, Any]:
        """POST one turn upstream, after the trajectory's previous turn has answered; a success pins the session
        to the instance and version that served it and advances the trajectory. Returns the answer and, for a
        success, its JSON body (parsed once here; None when not JSON)."""
        result = None
        async with state.turn_lock(request.headers, self.strategy):
            await self._admit(state)
            headers, trajectory = state.turn_headers(request.headers, self.strategy)
            headers.update(extra_headers or {})
            state.begin_turn()
            try:
                upstream = await _until_client_leaves(
                    request, self.upstream("POST", path, content=content, headers=headers, params=params)
                )
                if upstream.is_success:
                    result = _json_of(upstream)
                    usage = result.get("usage") if isinstance(result, dict) else None
                    state.record_success(upstream.headers, usage)
                    state.advance_trajectory(trajectory)
            finally:
                state.end_turn()
        return upstream, result

    # ---- control --------------------------------------------------------------------------------------

    def check_admin(self, request: Request) -> None:
        key = self.config.admin_api_key
        if not key:
            return
        given = request.headers.get("x-admin-api-key") or ""
        auth = request.headers.get("authorization") or ""
        if auth.lower().startswith("bearer "):
            given = given or auth[7:].strip()
        if not hmac.compare_digest(given.encode(), key.encode()):
            raise Unauthorized("admin API key required")

    async def control_items(self, request: Request) -> list[tuple[str, dict[str, Any]]]:
        try:
            items = session_ids_of(loads_bounded(await request.body()))
        except ValueError as e:  # the body's JSON, or its shape
            raise InvalidBody(str(e)) from None
        for sid, _ in items:
            try:
                sid.encode()
            except UnicodeEncodeError:  # a lone surrogate from a JSON escape: no session has such an id
                raise InvalidBody(f"session id {sid!a} is not valid Unicode") from None
        return items

    def hang(self, items: list[tuple[str, dict[str, Any]]]) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {"hung": [], "deferred": [], "missing": []}
        for sid, _ in items:
            state = self.sessions.get(sid)
            if state is None or state.closing:
                out["missing"].append(sid)
                continue
            out[state.request_hang()].append(sid)
        return out

    def resume(self, items: list[tuple[str, dict[str, Any]]]) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {"continued": [], "missing": []}
        for sid, item in items:
            state = self.sessions.get(sid)
            if state is None:
                out["missing"].append(sid)
                continue
            worker, rank = item.get("base_worker_id"), item.get("target_dp_rank")
            state.resume(
                None if worker is None else str(worker),
                None if rank is None else str(rank),
            )
            out["continued"].append(sid)
        return out


def create_app(config: SessionConfig, *, transport: httpx.AsyncBaseTransport | None = None) -> FastAPI:
    """The SessionRouter app. `transport` replaces the network to the router (tests use an in-process one)."""
    sr = SessionRouter(config, transport)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await sr.open()
        if sr.thunder is not None:
            sr.thunder.start()
        try:
            yield
        finally:
            await sr.close()

    # No redirect of "/sessions/" to "/sessions": an unknown path is a 404 like any other.
    app = FastAPI(title="PSRL SessionRouter", lifespan=lifespan, redirect_slashes=False)
    app.state.session_router = sr

    @app.exception_handler(SessionError)
    async def _on_error(_: Request, e: SessionError) -> JSONResponse:
        return JSONResponse({"error": e.message}, status_code=e.status, headers={"x-smg-error-code": e.code})

    @app.exception_handler(StarletteHTTPException)
    async def _on_http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        """Unrouted paths and methods (404/405) in our error shape, not FastAPI's `{"detail": ...}`."""
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code, "invalid_request")
        return JSONResponse(
            {"error": str(e.detail)}, status_code=e.status_code, headers={**(e.headers or {}), "x-smg-error-code": code}
        )

    @app.exception_handler(ClientDisconnect)
    async def _on_client_gone(_: Request, e: ClientDisconnect) -> Response:
        return Response(status_code=400)  # never delivered: the client left, or its body was refused

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(sr.metrics), media_type="text/plain; version=0.0.4")

    @app.post("/sessions")
    async def create_session(request: Request) -> Response:
        return await sr.create(request)

    @app.get("/sessions/{sid}")
    async def get_session(sid: str, request: Request) -> Response:
        return await sr.get(sid, request)

    @app.delete("/sessions/{sid}")
    async def delete_session(sid: str, request: Request) -> Response:
        return await sr.delete(sid, request)

    @app.post("/sessions/{sid}/v1/messages/count_tokens")
    async def count_tokens(sid: str) -> dict[str, int]:
        sr.state(sid)
        return {"input_tokens": 0}

    def turn_route(path: str) -> Callable[[str, Request], Awaitable[Response]]:
        async def api_turn(sid: str, request: Request) -> Response:
            return await sr.api_turn(sid, path, request)

        return api_turn

    for api_path in TURN_APIS:
        app.add_api_route(f"/sessions/{{sid}}/{api_path}", turn_route(api_path), methods=["POST"])

    @app.get("/control/sessions")
    async def control_sessions(request: Request) -> dict[str, Any]:
        sr.check_admin(request)
        return {"sessions": [s.summary() for s in sr.sessions.all()]}

    @app.post("/control/hang")
    async def control_hang(request: Request) -> dict[str, list[str]]:
        sr.check_admin(request)
        return sr.hang(await sr.control_items(request))

    @app.post("/control/continue")
    async def control_continue(request: Request) -> dict[str, list[str]]:
        sr.check_admin(request)
        return sr.resume(await sr.control_items(request))

    @app.api_route("/sessions/{sid}/{path:path}", methods=_METHODS)
    async def catch_all(sid: str, path: str, request: Request) -> Response:
        return await sr.forward(sid, path, request)

    return app
