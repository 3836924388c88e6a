"""Bounded connections over real processes, on the router and on the SessionRouter (both configured with a
1 MiB body limit and 1 s header/body timeouts): oversized bodies are refused while they arrive, with memory
kept far below the body's size; silent, half-sent and stalled requests are cut off while the server keeps
serving; a long generation outlives the timeouts; SIGTERM stops a server that still has a request open."""

from __future__ import annotations

import json
import signal
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from _http_raw import (
    connect,
    exchange,
    json_error,
    peak_rss_kib,
    read_until_closed,
    reset_peak_rss,
    send_chunked_until_answered,
)
from _procs import Proc, start_router, start_session_router, wait_for

from psrl.gateway.processes import stop_processes

LIMIT = 1 << 20
LIMIT_FLAGS = ["--max-payload-bytes", str(LIMIT), "--client-header-timeout-s", "1", "--client-body-timeout-s", "1"]


@pytest.fixture(scope="module")
def limited_router(replica: Proc, log_dir: Path) -> Iterator[Proc]:
    proc = start_router(log_dir, [replica.url], args=LIMIT_FLAGS)
    yield proc
    stop_processes([proc.proc])


@pytest.fixture(scope="module")
def limited_session(limited_router: Proc, log_dir: Path) -> Iterator[Proc]:
    proc = start_session_router(log_dir, limited_router.url, LIMIT_FLAGS)
    yield proc
    stop_processes([proc.proc])


@dataclass
class Server:
    proc: Proc
    path: str  # reads a JSON body
    health: str  # answers 200 to a GET

    def serves(self) -> bool:
        return httpx.get(f"{self.proc.url}{self.health}", timeout=10).status_code == 200


@pytest.fixture(params=["router", "session"])
def server(request: pytest.FixtureRequest, limited_router: Proc, limited_session: Proc) -> Server:
    if request.param == "router":
        return Server(limited_router, "/generate", "/health")
    return Server(limited_session, "/control/hang", "/control/sessions")


def test_declared_oversized_body_is_refused_before_it_is_sent(server: Server) -> None:
    proc, path = server.proc, server.path
    with connect(proc.url) as sock:
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: t\r\nContent-Length: {100 * LIMIT}\r\n\r\n".encode())
        status, code, _ = json_error(read_until_closed(sock))  # answered with no byte of the body sent
    assert (status, code) == (413, "payload_too_large")
    assert server.serves()


def test_streamed_oversized_body_is_refused_while_it_arrives(server: Server) -> None:
    proc, path = server.proc, server.path
    body_kib = 20 * LIMIT // 1024
    before = reset_peak_rss(proc.proc.pid)
    status, code, _ = json_error(send_chunked_until_answered(proc.url, path, 20 * LIMIT))
    assert (status, code) == (413, "payload_too_large")
    grown = peak_rss_kib(proc.proc.pid) - before
    assert grown < body_kib // 4, f"peak RSS grew {grown} KiB for a {body_kib} KiB body"
    assert server.serves()


def test_body_at_the_limit_is_read(limited_router: Proc) -> None:
    body = json.dumps({"input_ids": [1, 2], "pad": "x" * (LIMIT - 100)}).encode()
    r = httpx.post(f"{limited_router.url}/generate", content=body, timeout=60)
    assert r.status_code != 413, r.text


def test_silent_connections_are_closed(server: Server) -> None:
    proc = server.proc
    socks = [connect(proc.url) for _ in range(20)]
    try:
        for sock in socks:
            assert read_until_closed(sock) == b""  # closed, nothing said: nothing was asked
    finally:
        for sock in socks:
            sock.close()
    assert server.serves()


def test_half_sent_request_head_gets_408(server: Server) -> None:
    proc, path = server.proc, server.path
    status, code, _ = json_error(exchange(proc.url, f"POST {path} HTTP/1.1\r\nHost: t\r\n".encode()))
    assert (status, code) == (408, "request_timeout")
    assert server.serves()


def test_stalled_body_gets_408(server: Server) -> None:
    proc, path = server.proc, server.path
    head = f"POST {path} HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
    status, code, body = json_error(exchange(proc.url, head.encode() + b'{"input_ids": [1,'))
    assert (status, code) == (408, "request_timeout")
    assert "stalled" in json.dumps(body)
    assert server.serves()
    log = proc.log_text()
    assert "Exception in ASGI application" not in log and "unexpected error" not in log


def test_long_generations_outlive_the_timeouts(limited_router: Proc) -> None:
    """Non-streamed and streamed generations that run far longer than the 1 s header/body timeouts."""
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1500, "ignore_eos": True}}
    r = httpx.post(f"{limited_router.url}/generate", json=body, timeout=300)
    assert r.status_code == 200 and len(r.json()["output_ids"]) == 1500
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{limited_router.url}/v1/chat/completions", json=chat, timeout=300) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert r.status_code == 200 and lines[-1] == "data: [DONE]"


def _hold_open(url: str, request: bytes) -> socket.socket:
    sock = connect(url, timeout_s=120)
    sock.sendall(request)
    return sock


def test_sigterm_stops_a_router_with_a_request_that_never_ends(replica: Proc, log_dir: Path) -> None:
    router = start_router(log_dir, [replica.url], args=["--enable-routing-loop", "--graceful-shutdown-timeout-s", "1"])
    body = json.dumps({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 4}}).encode()
    head = (
        "POST /generate HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
        f"x-request-id: 1\r\nx-prompt-id: 1\r\nx-version-tag: 7\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    sock = _hold_open(router.url, head.encode() + body)  # no instance has version 7: it waits in the queue
    try:
        wait_for(
            lambda: httpx.get(f"{router.url}/routing_loop/status", timeout=5).json()["queue_len"] == 1,
            "one request queued in the routing loop",
        )
        router.proc.send_signal(signal.SIGTERM)
        router.proc.wait(timeout=60)  # bound: the 1 s graceful timeout, then start-up's reverse
    finally:
        sock.close()
        stop_processes([router.proc])


def test_sigterm_stops_a_session_router_with_a_request_that_never_ends(log_dir: Path) -> None:
    silent = socket.create_server(("127.0.0.1", 0))  # a "router" that accepts and never answers
    url = f"http://127.0.0.1:{silent.getsockname()[1]}"
    session = start_session_router(log_dir, url, ["--graceful-shutdown-timeout-s", "1"])
    sent = threading.Event()

    def create() -> None:
        sent.set()
        try:
            httpx.post(f"{session.url}/sessions", timeout=120)
        except httpx.HTTPError:
            pass  # the server went away mid-request, as it should

    client = threading.Thread(target=create, daemon=True)
    try:
        client.start()
        sent.wait(10)
        upstream, _ = silent.accept()  # the SessionRouter's call to the router: the request is open
        session.proc.send_signal(signal.SIGTERM)
        session.proc.wait(timeout=60)
        upstream.close()
    finally:
        silent.close()
        stop_processes([session.proc])
        client.join(10)
