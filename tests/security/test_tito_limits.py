"""TITO store exhaustion over real processes: idle sessions expire (and are counted), keyed clients are capped."""

from __future__ import annotations

import re
import threading
import time

import httpx
import pytest
from _procs import start_router, wait_for

from psrl.gateway.processes import stop_processes

KEY = "data-key"
TTL_S = 0.5


@pytest.fixture(scope="module")
def short_ttl_router(replica, log_dir):
    args = ["--tito-max-sessions", "4", "--tito-session-ttl-s", str(TTL_S)]
    proc = start_router(log_dir, [replica.url], args=args)
    yield proc
    stop_processes([proc.proc])


@pytest.fixture(scope="module")
def queued_router(replica, log_dir):
    args = ["--enable-routing-loop", "--tito-session-ttl-s", str(TTL_S)]
    proc = start_router(log_dir, [replica.url], args=args)
    yield proc
    stop_processes([proc.proc])


@pytest.fixture(scope="module")
def keyed_router(replica, log_dir):
    args = ["--api-key", KEY, "--tito-max-sessions", "100", "--tito-max-sessions-per-client", "2"]
    proc = start_router(log_dir, [replica.url], args=args)
    yield proc
    stop_processes([proc.proc])


def _create(router, **kw) -> httpx.Response:
    return httpx.post(f"{router.url}/tito/sessions", timeout=30, **kw)


def _metric(router, name: str) -> float:
    text = httpx.get(f"{router.url}/metrics", timeout=10).text
    match = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
    assert match, text
    return float(match.group(1))


def test_a_filled_store_takes_sessions_again_after_the_ttl(short_ttl_router) -> None:
    router = short_ttl_router
    sids = [_create(router).json()["session_id"] for _ in range(4)]
    r = _create(router)
    assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_sessions", r.text
    assert r.headers["x-smg-error-code"] == "too_many_sessions"

    filled = time.monotonic()  # the router stamped each session's last use before it answered
    wait_for(lambda: time.monotonic() > filled + TTL_S, "the session TTL passed", timeout_s=30)
    r = _create(router)  # the idle sessions expired: room again
    assert r.status_code == 200, r.text
    assert _metric(router, "psrl_router_tito_sessions_expired_total") == 4
    assert _metric(router, "psrl_router_tito_sessions") == 1
    for sid in sids:
        assert httpx.get(f"{router.url}/tito/sessions/{sid}", timeout=10).status_code == 404


def test_a_session_with_a_turn_in_flight_outlives_its_ttl(queued_router) -> None:
    router = queued_router
    sid = _create(router).json()["session_id"]
    assert httpx.post(f"{router.url}/routing_loop/pause?wait=true", json={}, timeout=30).status_code == 200
    result: dict = {}
    body = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 3}
    headers = {"x-smg-tito-session-id": sid, "x-request-id": "1", "x-prompt-id": "1"}
    url = f"{router.url}/v1/chat/completions"
    turn = threading.Thread(target=lambda: result.update(r=httpx.post(url, json=body, headers=headers, timeout=60)))
    turn.start()
    try:
        # the turn is prepared and waits in the paused routing loop, for longer than the TTL
        wait_for(
            lambda: httpx.get(f"{router.url}/routing_loop/status").json()["queue_len"] == 1,
            "one request queued in the routing loop",
        )
        queued = time.monotonic()
        wait_for(
            lambda: time.monotonic() > queued + 2 * TTL_S, "twice the session TTL passed while queued", timeout_s=30
        )
        assert _create(router).status_code == 200  # creation sweeps expired sessions: not this one
    finally:
        httpx.post(f"{router.url}/routing_loop/resume", json={}, timeout=30)
        turn.join(60)
    assert result["r"].status_code == 200, result["r"].text
    snap = httpx.get(f"{router.url}/tito/sessions/{sid}", timeout=10)
    assert snap.status_code == 200 and len(snap.json()["trajectories"][0]["records"]) == 1
    assert _metric(router, "psrl_router_tito_sessions_expired_total") == 0


def test_keyed_clients_are_capped_per_credential(keyed_router) -> None:
    router = keyed_router
    auth = {"authorization": f"Bearer {KEY}"}
    assert _create(router).status_code == 401
    first, _ = (_create(router, headers=auth).json()["session_id"] for _ in range(2))
    r = _create(router, headers=auth)
    assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_client_sessions", r.text
    assert httpx.delete(f"{router.url}/tito/sessions/{first}", headers=auth, timeout=10).status_code == 204
    assert _create(router, headers=auth).status_code == 200  # a deleted session frees the slot
