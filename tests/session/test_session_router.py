"""The SessionRouter in-process against a mock router (ASGI transport): headers, body, pinning, hang, close."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx
import pytest
from _wait import until
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from psrl.session.app import create_app
from psrl.session.config import SessionConfig
from psrl.session.state import SessionState

INSTANCE = {"x-base-worker-id": "worker-a", "x-target-dp-rank": "2", "x-version-tag": "3"}


@dataclass
class MockRouter:
    """Stands in for the router: TITO session endpoints, a chat endpoint echoing worker-a/2/version 3, a
    catch-all; remembers what it got. `gate`, when set up, holds chat turns until it is set."""

    calls: list[tuple[str, dict[str, str], Any]] = field(default_factory=list)
    gate: asyncio.Event | None = None
    entered: asyncio.Event = field(default_factory=asyncio.Event)
    next_id: int = 0

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.post("/tito/sessions")
        async def create() -> dict[str, str]:
            self.next_id += 1
            return {"session_id": f"sid-{self.next_id}"}

        @app.get("/tito/sessions/{sid}")
        async def get(sid: str) -> dict[str, Any]:
            return {"session_id": sid, "trajectories": []}

        @app.delete("/tito/sessions/{sid}")
        async def delete(sid: str) -> Response:
            self.calls.append(("DELETE", {}, sid))
            return Response(status_code=204)

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> JSONResponse:
            body = await request.json()
            self.calls.append(("chat", dict(request.headers), body))
            self.entered.set()
            if self.gate is not None:
                await self.gate.wait()
            result = {
                "id": "c1",
                "object": "chat.completion",
                "created": 1,
                "model": "m",
                "choices": [
                    {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "hello"}}
                ],
                "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10},
            }
            return JSONResponse(result, headers=INSTANCE)

        @app.api_route("/{path:path}", methods=["GET", "POST"])
        async def other(path: str, request: Request) -> JSONResponse:
            self.calls.append((f"/{path}", dict(request.headers), (await request.body()).decode()))
            return JSONResponse({"path": path, "query": str(request.query_params)}, headers=INSTANCE)

        return app

    def last(self, kind: str = "chat") -> tuple[dict[str, str], Any]:
        for k, headers, body in reversed(self.calls):
            if k == kind:
                return headers, body
        raise AssertionError(f"no {kind} call")


@pytest.fixture
def mock() -> MockRouter:
    return MockRouter()


def _app(mock: MockRouter, **config: Any) -> FastAPI:
    return create_app(
        SessionConfig(router_url="http://router", **config), transport=httpx.ASGITransport(app=mock.app())
    )


async def _client(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://sr") as c,
    ):
        yield c


@pytest.fixture
def app(mock: MockRouter) -> FastAPI:
    return _app(mock)


@pytest.fixture
async def client(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    async for c in _client(app):
        yield c


@pytest.fixture
async def auto_client(mock: MockRouter) -> AsyncIterator[httpx.AsyncClient]:
    async for c in _client(_app(mock, trajectory_id_strategy="auto", admin_api_key="k")):
        yield c


class _WatchedEvent(asyncio.Event):
    """An asyncio.Event that counts the waits begun on it, so a test sees a turn (or a DELETE) reach one."""

    def __init__(self, source: asyncio.Event) -> None:
        super().__init__()
        self.waits = 0
        if source.is_set():
            self.set()

    async def wait(self) -> Literal[True]:
        self.waits += 1
        return await super().wait()


class _WatchedLock(asyncio.Lock):
    """An asyncio.Lock that counts the acquisitions begun on it (a turn waiting for its trajectory's lock)."""

    def __init__(self) -> None:
        super().__init__()
        self.acquires = 0

    async def acquire(self) -> Literal[True]:
        self.acquires += 1
        return await super().acquire()


class _WatchedLocks(dict[str | None, asyncio.Lock]):
    def setdefault(self, key: str | None, default: asyncio.Lock | None = None) -> asyncio.Lock:
        return super().setdefault(key, _WatchedLock())


def _watched(app: FastAPI, sid: str) -> SessionState:
    """The session's state, with its hang and drain events and its turn locks swapped for watched ones."""
    state = app.state.session_router.sessions.get(sid)
    assert state is not None and not state.turn_locks
    state.continue_event, state.drained = _WatchedEvent(state.continue_event), _WatchedEvent(state.drained)
    state.turn_locks = _WatchedLocks()
    return state


MSG = {"messages": [{"role": "user", "content": "hi"}]}


async def _session(c: httpx.AsyncClient, headers: dict[str, str] | None = None) -> str:
    r = await c.post("/sessions", headers=headers or {})
    assert r.status_code == 200, r.text
    return r.json()["session_id"]


async def _turn(c: httpx.AsyncClient, sid: str, headers: dict[str, str] | None = None, **body: Any) -> httpx.Response:
    return await c.post(f"/sessions/{sid}/v1/chat/completions", json={**MSG, **body}, headers=headers or {})


async def test_whitelist_spoof_forced_body_and_precedence(client: httpx.AsyncClient, mock: MockRouter) -> None:
    sid = await _session(
        client,
        {"x-prompt-id": "1", "x-request-id": "2", "x-is-sticky": "true", "x-other": "no", "x-version-tag": "-1"},
    )
    r = await _turn(client, sid, {"x-prompt-id": "9", "x-smg-tito-session-id": "spoofed"}, stream=False, top_logprobs=5)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "hello"
    assert r.headers["x-base-worker-id"] == "worker-a"
    headers, body = mock.last()
    assert headers["x-smg-tito-session-id"] == sid
    assert headers["x-prompt-id"] == "9" and headers["x-request-id"] == "2" and headers["x-is-sticky"] == "true"
    assert "x-other" not in headers and headers["x-version-tag"] == "-1"
    assert headers["x-smg-tito-trajectory-id"] == "0"
    # log-probs as the client asked for them (none forced: the router records the sampled ones by itself)
    assert body["stream"] is False and "logprobs" not in body and body["top_logprobs"] == 5
    # the next turn replays the instance and the version the first one got (-1 became 3)
    await _turn(client, sid, {"x-base-worker-id": "client-choice"})
    headers, _ = mock.last()
    instance = (headers["x-base-worker-id"], headers["x-target-dp-rank"], headers["x-version-tag"])
    assert instance == ("worker-a", "2", "3")
    r = await client.get(f"/sessions/{sid}")
    assert r.status_code == 200 and r.headers["x-base-worker-id"] == "worker-a" and r.headers["x-target-dp-rank"] == "2"
    listed = (await client.get("/control/sessions")).json()["sessions"]
    [entry] = [s for s in listed if s["session_id"] == sid]
    assert entry["total_tokens"] == 10 and entry["status"] == "env" and entry["hang_state"] == "running"


async def test_trajectory_id_in_manual_and_auto_mode(
    client: httpx.AsyncClient, auto_client: httpx.AsyncClient, mock: MockRouter
) -> None:
    sid = await _session(client)
    await _turn(client, sid, {"x-smg-tito-trajectory-id": "5"})
    assert mock.last()[0]["x-smg-tito-trajectory-id"] == "5"
    sid = await _session(auto_client)
    await _turn(auto_client, sid, {"x-smg-tito-trajectory-id": "5"})
    assert "x-smg-tito-trajectory-id" not in mock.last()[0]


async def test_continue_force_pins_exactly_one_turn(client: httpx.AsyncClient, mock: MockRouter) -> None:
    sid = await _session(client)
    await _turn(client, sid)
    r = await client.post("/control/continue", json=[{"session_id": sid, "base_worker_id": "w9", "target_dp_rank": 1}])
    assert r.json() == {"continued": [sid], "missing": []}
    await _turn(client, sid)
    headers, _ = mock.last()
    pin = (headers["x-base-worker-id"], headers["x-target-dp-rank"], headers["x-force-pin-once"])
    assert pin == ("w9", "1", "true")
    await _turn(client, sid)
    headers, _ = mock.last()
    assert headers["x-base-worker-id"] == "worker-a" and "x-force-pin-once" not in headers
    r = await client.post("/control/continue", json=["nope"])
    assert r.json() == {"continued": [], "missing": ["nope"]}


async def test_hang_defers_mid_turn_and_continue_releases(
    app: FastAPI, client: httpx.AsyncClient, mock: MockRouter
) -> None:
    sid = await _session(client)
    state = _watched(app, sid)
    mock.gate = asyncio.Event()
    first = asyncio.create_task(_turn(client, sid))
    await asyncio.wait_for(mock.entered.wait(), 5)
    [entry] = (await client.get("/control/sessions")).json()["sessions"]
    assert entry["status"] == "generate" and entry["inflight"] == 1
    r = await client.post("/control/hang", json={"sessions": [{"session_id": sid}, "nope"]})
    assert r.json() == {"hung": [], "deferred": [sid], "missing": ["nope"]}
    mock.gate.set()
    assert (await first).status_code == 200
    [entry] = (await client.get("/control/sessions")).json()["sessions"]
    assert entry["hang_state"] == "hung" and entry["inflight"] == 0 and not entry["marked_for_hang"]
    n_calls = len(mock.calls)
    second = asyncio.create_task(_turn(client, sid))
    await until(lambda: state.continue_event.waits == 1, "the turn waits on the hang")
    assert not second.done() and len(mock.calls) == n_calls  # held before forwarding
    r = await client.post("/control/continue", json=[sid])
    assert r.json()["continued"] == [sid]
    assert (await asyncio.wait_for(second, 5)).status_code == 200
    # an idle session hangs at once
    assert (await client.post("/control/hang", json=[sid])).json()["hung"] == [sid]


async def test_closing_session_gets_409_and_delete_releases_a_hang(
    app: FastAPI, client: httpx.AsyncClient, mock: MockRouter
) -> None:
    sid = await _session(client)
    state = _watched(app, sid)
    await client.post("/control/hang", json=[sid])
    waiting = asyncio.create_task(_turn(client, sid))
    await until(lambda: state.continue_event.waits == 1, "the turn waits out the hang")
    r = await client.delete(f"/sessions/{sid}")
    assert r.status_code == 204 and mock.calls[-1] == ("DELETE", {}, sid)
    r = await asyncio.wait_for(waiting, 5)
    assert r.status_code == 409 and r.json() == {"error": "session is closing"}
    assert (await _turn(client, sid)).status_code == 404


async def test_closing_while_a_turn_is_in_flight(app: FastAPI, client: httpx.AsyncClient, mock: MockRouter) -> None:
    sid = await _session(client)
    state = _watched(app, sid)
    mock.gate = asyncio.Event()
    first = asyncio.create_task(_turn(client, sid))
    await asyncio.wait_for(mock.entered.wait(), 5)
    queued = asyncio.create_task(_turn(client, sid))  # same trajectory: waits for the first turn
    deleting = asyncio.create_task(client.delete(f"/sessions/{sid}"))
    await until(
        lambda: state.turn_locks["0"].acquires == 2 and state.drained.waits == 1, "the DELETE waits for the turn"
    )
    r = await _turn(client, sid, {"x-smg-tito-trajectory-id": "1"})  # another trajectory: refused at once
    assert r.status_code == 409 and r.json() == {"error": "session is closing"}
    assert not deleting.done() and not queued.done()  # DELETE waits for the in-flight turn
    mock.gate.set()
    assert (await first).status_code == 200
    assert (await asyncio.wait_for(queued, 5)).status_code == 409
    assert (await asyncio.wait_for(deleting, 5)).status_code == 204


async def test_turns_of_one_trajectory_run_one_at_a_time(
    app: FastAPI, client: httpx.AsyncClient, mock: MockRouter
) -> None:
    sid = await _session(client)
    state = _watched(app, sid)
    mock.gate = asyncio.Event()
    first = asyncio.create_task(_turn(client, sid))
    await asyncio.wait_for(mock.entered.wait(), 5)
    second = asyncio.create_task(_turn(client, sid))
    other = asyncio.create_task(_turn(client, sid, {"x-smg-tito-trajectory-id": "1"}))
    await until(
        lambda: state.turn_locks["0"].acquires == 2 and len(mock.calls) == 2, "the second turn waits for the lock"
    )
    trajectories = [h.get("x-smg-tito-trajectory-id") for kind, h, _ in mock.calls if kind == "chat"]
    assert trajectories == ["0", "1"]  # the second turn of trajectory 0 is held, trajectory 1 is not
    mock.gate.set()
    assert [(await t).status_code for t in (first, second, other)] == [200, 200, 200]
    trajectories = [h.get("x-smg-tito-trajectory-id") for kind, h, _ in mock.calls if kind == "chat"]
    assert trajectories == ["0", "1", "0"]

    # A POST to any other path under the session is a turn too: it waits for its trajectory's turn.
    mock.gate, mock.entered = asyncio.Event(), asyncio.Event()
    held = asyncio.create_task(_turn(client, sid))
    await asyncio.wait_for(mock.entered.wait(), 5)
    forwarded = asyncio.create_task(client.post(f"/sessions/{sid}/v1/completions", json={"prompt": "x"}))
    await until(lambda: state.turn_locks["0"].acquires == 4, "four turns took the lock")  # incl. the held one
    assert not forwarded.done() and mock.calls[-1][0] == "chat"
    mock.gate.set()
    assert (await held).status_code == 200 and (await asyncio.wait_for(forwarded, 5)).status_code == 200
    assert mock.calls[-1][0] == "/v1/completions"


async def test_streaming_reply_is_built_from_the_buffered_result(client: httpx.AsyncClient, mock: MockRouter) -> None:
    sid = await _session(client)
    r = await _turn(client, sid, stream=True, stream_options={"include_usage": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    _, body = mock.last()
    assert body["stream"] is False and "stream_options" not in body
    lines = [line for line in r.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == "hello"
    # as OpenAI and vLLM send it: the finish chunk, then the usage alone on a chunk without choices
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop" and "usage" not in chunks[-2]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] == 10
    r = await _turn(client, sid, stream=True)
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop" and all("usage" not in c for c in chunks)
    r = await _turn(client, sid, stream=True, stream_options={"include_usage": "yes"})
    assert r.status_code == 400 and "include_usage" in r.json()["error"]


async def test_errors_count_tokens_and_catch_all(client: httpx.AsyncClient, mock: MockRouter) -> None:
    sid = await _session(client)
    r = await client.post(f"/sessions/{sid}/v1/chat/completions", content=b"{not json")
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]
    assert (await _turn(client, "nope")).status_code == 404
    r = await client.post(f"/sessions/{sid}/v1/messages/count_tokens", json={})
    assert r.json() == {"input_tokens": 0}
    r = await client.post(f"/sessions/{sid}/v1/completions?a=1", json={"prompt": "x"}, headers={"x-prompt-id": "4"})
    assert r.status_code == 200 and r.json() == {"path": "v1/completions", "query": "a=1"}
    headers, body = mock.last("/v1/completions")
    assert headers["x-smg-tito-session-id"] == sid and headers["x-prompt-id"] == "4"
    assert json.loads(body) == {"prompt": "x"}
    [entry] = (await client.get("/control/sessions")).json()["sessions"]
    assert entry["base_worker_id"] == "worker-a"
    # a turn's API is the route's, never a query parameter
    chats = sum(kind == "chat" for kind, _, _ in mock.calls)
    r = await client.post(f"/sessions/{sid}/v1/chat/completions?path=generate", json=MSG)
    assert r.status_code == 200 and sum(kind == "chat" for kind, _, _ in mock.calls) == chats + 1


async def test_admin_key_and_unreachable_router(mock: MockRouter) -> None:
    async for c in _client(_app(mock, admin_api_key="k")):
        assert (await c.get("/control/sessions")).status_code == 401
        assert (await c.get("/control/sessions", headers={"authorization": "Bearer k"})).status_code == 200
        assert (await c.post("/control/hang", json=[], headers={"x-admin-api-key": "k"})).status_code == 200
        assert (await c.post("/control/hang", content=b"{}", headers={"x-admin-api-key": "k"})).status_code == 400
    app = create_app(SessionConfig(router_url="http://127.0.0.1:1", connect_timeout_s=1))
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://sr") as c,
    ):
        r = await c.post("/sessions")
        assert r.status_code == 502 and "router unreachable" in r.json()["error"]
