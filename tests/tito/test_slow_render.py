"""A TITO turn whose template render takes long holds up only its own session: the router's event loop, other
sessions' turns and snapshots, and /health carry on. The router runs in this process (uvicorn in a thread, a
real reference replica behind it), so the render can be held for exactly as long as the test needs."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import uvicorn
from _http_raw import connect
from _procs import Proc, free_port, wait_for

from psrl.router.app import RouterApp
from psrl.router.config import parse_args
from psrl.router.server import uvicorn_config
from psrl.router.tito_bridge import RENDER_THREADS
from psrl.tokenizer import Tokenizer

HOLD = "HOLD THIS RENDER"
LIVE_S = 20.0  # how long a call may take while the render is held before the test calls it stuck


class HeldRender:
    """Set while a render of messages carrying HOLD is held; the render goes on once `release` is set."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.release = threading.Event()
        self.holding = 0  # renders held now
        self.lock = threading.Lock()


@pytest.fixture
def held(monkeypatch: pytest.MonkeyPatch) -> Iterator[HeldRender]:
    hold = HeldRender()
    render = Tokenizer.apply_chat_template

    def held_render(tok: Tokenizer, messages: Any, **kw: Any) -> str:
        if any(HOLD in str(m.get("content")) for m in messages):
            with hold.lock:
                hold.holding += 1
            hold.started.set()
            assert hold.release.wait(120), "never released"
        return render(tok, messages, **kw)

    monkeypatch.setattr(Tokenizer, "apply_chat_template", held_render)
    yield hold
    hold.release.set()


@pytest.fixture
def router_url(router_app: tuple[str, RouterApp]) -> str:
    return router_app[0]


@pytest.fixture
def router_app(replica: Proc, held: HeldRender) -> Iterator[tuple[str, RouterApp]]:
    """(its URL, the router) served in this process."""
    port = free_port()
    router = RouterApp(parse_args(["--port", str(port), "--worker-urls", replica.url]))
    server = uvicorn.Server(uvicorn_config(router))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        try:
            return httpx.get(f"{url}/health", timeout=2).json()["workers"] >= 1
        except httpx.TransportError:
            return False

    try:
        wait_for(ready, "the router sees its replica", timeout_s=60, poll_s=0.1)
        yield url, router
    finally:
        held.release.set()
        server.should_exit = True
        thread.join(30)


def _turn(url: str, sid: str, text: str, trajectory: int = 0) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": 4, "temperature": 0}
    headers = {"x-smg-tito-session-id": sid, "x-smg-tito-trajectory-id": str(trajectory)}
    return httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=120)


def _background(fn: Any) -> tuple[threading.Thread, dict[str, Any]]:
    box: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: box.update(r=fn()), daemon=True)
    thread.start()
    return thread, box


def test_a_held_render_stalls_neither_the_loop_nor_other_sessions(router_url: str, held: HeldRender) -> None:
    url = router_url
    busy = httpx.post(f"{url}/tito/sessions").json()["session_id"]
    held_turn, held_box = _background(lambda: _turn(url, busy, f"{HOLD}, please."))
    assert held.started.wait(60)
    try:
        # The render is held in a worker thread now. The loop answers, and another session works end to end.
        assert httpx.get(f"{url}/health", timeout=LIVE_S).status_code == 200
        other = httpx.post(f"{url}/tito/sessions", timeout=LIVE_S).json()["session_id"]
        for i in range(2):
            assert _turn(url, other, f"Hello {i}").status_code == 200
        snap = httpx.get(f"{url}/tito/sessions/{other}", timeout=LIVE_S).json()
        assert [len(t["records"]) for t in snap["trajectories"]] == [1, 1]  # two roots: no echoed reply
        # The busy session's own calls wait for its render, off the loop: /health still answers meanwhile.
        busy_snap, busy_box = _background(lambda: httpx.get(f"{url}/tito/sessions/{busy}", timeout=120))
        second, second_box = _background(lambda: _turn(url, busy, "Another trajectory.", trajectory=1))
        assert httpx.get(f"{url}/health", timeout=LIVE_S).status_code == 200
        assert httpx.get(f"{url}/metrics", timeout=LIVE_S).status_code == 200
        assert held_turn.is_alive()  # still held: everything above happened during the render
    finally:
        held.release.set()
    for thread in (held_turn, busy_snap, second):
        thread.join(120)
    assert held_box["r"].status_code == 200, held_box["r"].text
    assert busy_box["r"].status_code == 200 and second_box["r"].status_code == 200
    final = httpx.get(f"{url}/tito/sessions/{busy}").json()
    assert [(t["trajectory_id"], len(t["records"])) for t in final["trajectories"]] == [(0, 1), (1, 1)]


def test_renders_holding_every_render_thread_leave_other_sessions_calls_alone(
    router_url: str, held: HeldRender
) -> None:
    url = router_url
    done = httpx.post(f"{url}/tito/sessions").json()["session_id"]
    assert _turn(url, done, "Hello").status_code == 200
    busy = [httpx.post(f"{url}/tito/sessions").json()["session_id"] for _ in range(RENDER_THREADS)]
    turns = [_background(lambda sid=sid: _turn(url, sid, f"{HOLD} in {sid}")) for sid in busy]
    wait_for(lambda: held.holding == RENDER_THREADS, "every render thread held", timeout_s=60, poll_s=0.05)
    try:
        # Every render thread is held: snapshots, creations and deletions of other sessions still answer.
        snap = httpx.get(f"{url}/tito/sessions/{done}", timeout=LIVE_S)
        assert snap.status_code == 200 and len(snap.json()["trajectories"][0]["records"]) == 1
        fresh = httpx.post(f"{url}/tito/sessions", timeout=LIVE_S).json()["session_id"]
        assert httpx.delete(f"{url}/tito/sessions/{fresh}", timeout=LIVE_S).status_code == 204
        assert httpx.get(f"{url}/health", timeout=LIVE_S).status_code == 200
        assert held.holding == RENDER_THREADS  # all of it while every render was held
    finally:
        held.release.set()
    for thread, box in turns:
        thread.join(120)
        assert box["r"].status_code == 200, box["r"].text


def test_a_client_that_leaves_while_its_turn_renders_leaves_nothing_pending(
    router_app: tuple[str, RouterApp], held: HeldRender
) -> None:
    url, router = router_app
    sid = httpx.post(f"{url}/tito/sessions").json()["session_id"]
    body = json.dumps({"messages": [{"role": "user", "content": f"{HOLD}, then leave."}], "max_tokens": 4}).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
        f"x-smg-tito-session-id: {sid}\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    sock = connect(url)
    try:
        sock.sendall(head.encode() + body)
        assert held.started.wait(60)
    finally:
        sock.close()
    # The router cancels the request; the turn it was preparing runs on in its thread until released.
    wait_for(lambda: router.tito.orphaned_calls == 1, "the prepare outlives its cancelled request", timeout_s=60)
    held.release.set()
    # Once prepared, the orphaned turn is abandoned: nothing recorded, nothing left pending.
    wait_for(
        lambda: httpx.get(f"{url}/tito/sessions/{sid}").json()["trajectories"] == [],
        "the orphaned turn abandoned",
        timeout_s=60,
    )
    r = _turn(url, sid, "Hello again.")
    assert r.status_code == 200, r.text
    [trajectory] = httpx.get(f"{url}/tito/sessions/{sid}").json()["trajectories"]
    assert len(trajectory["records"]) == 1
