"""The SessionRouter in front of a keyed router, over real processes: the client's Authorization reaches the
router on every call (also GET and DELETE /sessions/{sid}); `--router-api-key` stands in for clients that
send none; a DELETE the router refuses, or cannot be reached for, leaves the session as it was."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from _procs import Proc, start_router, start_session_router

from psrl.gateway.processes import stop_processes

KEY = "data-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
TURN = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def keyed_router(replica: Proc, log_dir: Path) -> Iterator[Proc]:
    proc = start_router(log_dir, [replica.url], args=["--api-key", KEY, "--admin-api-key", "admin-key"])
    yield proc
    stop_processes([proc.proc])


@pytest.fixture(scope="module")
def session(keyed_router: Proc, log_dir: Path) -> Iterator[Proc]:
    proc = start_session_router(log_dir, keyed_router.url)
    yield proc
    stop_processes([proc.proc])


@pytest.fixture(scope="module")
def keyed_session(keyed_router: Proc, log_dir: Path) -> Iterator[Proc]:
    proc = start_session_router(log_dir, keyed_router.url, ["--router-api-key", KEY])
    yield proc
    stop_processes([proc.proc])


def _local(session: Proc) -> dict[str, dict]:
    r = httpx.get(f"{session.url}/control/sessions", timeout=10)
    return {s["session_id"]: s for s in r.json()["sessions"]}


def _create(session: Proc, headers: dict[str, str]) -> str:
    r = httpx.post(f"{session.url}/sessions", headers=headers, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["session_id"]


def test_the_clients_key_reaches_the_router_on_get_and_delete(session: Proc, keyed_router: Proc) -> None:
    sid = _create(session, AUTH)
    assert httpx.post(f"{session.url}/sessions/{sid}/v1/chat/completions", json=TURN, headers=AUTH).status_code == 200
    r = httpx.get(f"{session.url}/sessions/{sid}", headers=AUTH, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["session_id"] == sid
    assert httpx.get(f"{session.url}/sessions/{sid}", timeout=30).status_code == 401  # no key, no record
    r = httpx.delete(f"{session.url}/sessions/{sid}", headers=AUTH, timeout=30)
    assert r.is_success, r.text
    assert sid not in _local(session)
    assert httpx.get(f"{keyed_router.url}/tito/sessions/{sid}", headers=AUTH, timeout=30).status_code == 404


def test_a_refused_delete_keeps_the_session(session: Proc, keyed_router: Proc) -> None:
    sid = _create(session, AUTH)
    r = httpx.delete(f"{session.url}/sessions/{sid}", timeout=30)  # no key: the router refuses
    assert r.status_code == 401
    assert r.json()["error"]["code"] == "unauthorized"
    state = _local(session)[sid]
    assert state["closing"] is False
    assert httpx.get(f"{keyed_router.url}/tito/sessions/{sid}", headers=AUTH, timeout=30).status_code == 200
    r = httpx.post(f"{session.url}/sessions/{sid}/v1/chat/completions", json=TURN, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text  # still open for turns
    assert httpx.delete(f"{session.url}/sessions/{sid}", headers=AUTH, timeout=30).is_success
    assert sid not in _local(session)


def test_a_hung_session_stays_hung_after_a_refused_delete(session: Proc) -> None:
    sid = _create(session, AUTH)
    assert httpx.post(f"{session.url}/control/hang", json=[sid], timeout=10).json()["hung"] == [sid]
    assert httpx.delete(f"{session.url}/sessions/{sid}", timeout=30).status_code == 401
    assert _local(session)[sid]["hang_state"] == "hung"
    assert httpx.delete(f"{session.url}/sessions/{sid}", headers=AUTH, timeout=30).is_success


def test_router_api_key_serves_clients_without_one(keyed_session: Proc) -> None:
    sid = _create(keyed_session, {})
    r = httpx.post(f"{keyed_session.url}/sessions/{sid}/v1/chat/completions", json=TURN, timeout=60)
    assert r.status_code == 200, r.text
    assert httpx.get(f"{keyed_session.url}/sessions/{sid}", timeout=30).status_code == 200
    assert httpx.get(f"{keyed_session.url}/sessions/{sid}/v1/models", timeout=30).status_code == 200
    assert httpx.delete(f"{keyed_session.url}/sessions/{sid}", timeout=30).is_success
    assert sid not in _local(keyed_session)


def test_a_client_key_wins_over_the_router_api_key(keyed_session: Proc) -> None:
    r = httpx.post(f"{keyed_session.url}/sessions", headers={"Authorization": "Bearer wrong"}, timeout=30)
    assert r.status_code == 401


def test_delete_with_the_router_gone_keeps_the_session(replica: Proc, log_dir: Path) -> None:
    router = start_router(log_dir, [replica.url])
    session = start_session_router(log_dir, router.url)
    try:
        sid = _create(session, {})
        stop_processes([router.proc])
        r = httpx.delete(f"{session.url}/sessions/{sid}", timeout=30)
        assert r.status_code == 502
        assert r.headers["x-smg-error-code"] == "router_unavailable"
        assert _local(session)[sid]["closing"] is False
    finally:
        stop_processes([session.proc, router.proc])
