"""A client that leaves mid-generation over real processes (router + reference replica): the router cancels
its handler (non-streamed, which then never runs to its 200) or its stream, the replica aborts the
generation, and the instance's in-flight count drops to 0."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest
from _http_raw import connect
from _procs import Proc, replica_busy, start_session_router, wait_for

from psrl.gateway.processes import stop_processes

LONG = 3000  # tokens: seconds of decoding on the reference replica, far longer than the client stays


def _completed(router: Proc, route: str) -> float:
    """How many requests on `route` the router has answered 200 (its own metric)."""
    text = httpx.get(f"{router.url}/metrics", timeout=10).text
    sample = f'psrl_router_requests_total{{route="{route}",status="200"}} '
    return sum(float(line[len(sample) :]) for line in text.splitlines() if line.startswith(sample))


def _inflight(router: Proc) -> int:
    workers = httpx.get(f"{router.url}/workers", timeout=10).json()["workers"]
    return sum(i["inflight_requests"] for w in workers for i in w["instances"])


@pytest.mark.parametrize(
    ("route", "body"),
    [
        ("/generate", {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": LONG, "ignore_eos": True}}),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "max_tokens": LONG, "ignore_eos": True},
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "max_tokens": LONG, "ignore_eos": True, "stream": True},
        ),
    ],
    ids=["generate", "chat", "chat-streamed"],
)
def test_departed_client_aborts_its_generation(router: Proc, replica: Proc, route: str, body: dict) -> None:
    wait_for(lambda: replica_busy(replica.url) == 0 and _inflight(router) == 0, "the replica and the router idle")
    done_before = _completed(router, route)
    data = json.dumps(body).encode()
    head = f"POST {route} HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    sock = connect(router.url)
    try:
        sock.sendall(head.encode() + data)
        wait_for(lambda: replica_busy(replica.url) > 0, "the request generating on the replica")  # generating
        if body.get("stream"):  # the stream has begun (its 200 is counted) before the client leaves
            sock.settimeout(30)
            received = b""
            while b"\r\n\r\n" not in received:
                received += sock.recv(4096)
            assert received.startswith(b"HTTP/1.1 200")
    finally:
        sock.close()  # the client leaves
    wait_for(
        lambda: replica_busy(replica.url) == 0, "the replica idle (the departed client's request aborted)", timeout_s=60
    )
    wait_for(lambda: _inflight(router) == 0, "no request in flight in the router", timeout_s=30)
    # the router still serves, and the departed request was never answered: its handler was cancelled
    short = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}
    assert httpx.post(f"{router.url}/generate", json=short, timeout=60).status_code == 200
    answered = int(body.get("stream", False)) + int(route == "/generate")  # a stream counts when it starts
    assert _completed(router, route) == done_before + answered
    log = router.log_text()
    assert "unexpected error" not in log and "Exception in ASGI application" not in log


@pytest.fixture(scope="module")
def session_router(router: Proc, log_dir) -> Iterator[Proc]:
    proc = start_session_router(log_dir, router.url)
    yield proc
    stop_processes([proc.proc])


def test_an_agent_that_leaves_mid_turn_aborts_the_turn_through_the_session_router(
    session_router: Proc, router: Proc, replica: Proc
) -> None:
    wait_for(lambda: replica_busy(replica.url) == 0 and _inflight(router) == 0, "the replica and the router idle")
    sid = httpx.post(f"{session_router.url}/sessions", timeout=30).json()["session_id"]
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": LONG, "ignore_eos": True}
    data = json.dumps(body).encode()
    path = f"/sessions/{sid}/v1/chat/completions"
    head = f"POST {path} HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    sock = connect(session_router.url)
    try:
        sock.sendall(head.encode() + data)
        wait_for(lambda: replica_busy(replica.url) > 0, "the request generating on the replica")
    finally:
        sock.close()
    wait_for(
        lambda: replica_busy(replica.url) == 0, "the replica idle (the departed client's request aborted)", timeout_s=60
    )
    wait_for(lambda: _inflight(router) == 0, "no request in flight in the router", timeout_s=30)
    # The session serves its next turn, and the abandoned one left no record behind.
    short = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    r = httpx.post(f"{session_router.url}{path}", json=short, timeout=60)
    assert r.status_code == 200, r.text
    snapshot = httpx.get(f"{session_router.url}/sessions/{sid}", timeout=30).json()
    turns = [t for traj in snapshot["trajectories"] for t in traj["records"]]
    assert len(turns) == 1, snapshot
