"""Hostile or careless HTTP over real processes, on the router and on the SessionRouter: JSON nested without
end, integer literals Python refuses to convert, broken framing and a non-boolean `stream` are each a 400
with the server's JSON error, never a 500 and never an "unexpected error" in the log."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from _http_raw import exchange, json_error
from _procs import Proc, start_session_router

from psrl.gateway.processes import stop_processes
from psrl.serving.json_body import MAX_JSON_DEPTH

MSG = [{"role": "user", "content": "hi"}]
CRASH_MARKERS = ("unexpected error", "Exception in ASGI application", "Traceback")


@pytest.fixture(scope="module")
def session(router: Proc, log_dir: Path) -> Iterator[Proc]:
    proc = start_session_router(log_dir, router.url)
    yield proc
    stop_processes([proc.proc])


@pytest.fixture(scope="module")
def sid(session: Proc) -> str:
    return httpx.post(f"{session.url}/sessions", timeout=30).json()["session_id"]


@pytest.fixture
def targets(router: Proc, session: Proc, sid: str) -> dict[str, str]:
    """Every kind of endpoint that parses a JSON body, on both servers."""
    return {
        "router-chat": f"{router.url}/v1/chat/completions",
        "router-generate": f"{router.url}/generate",
        "router-coordinator": f"{router.url}/workers/update_stats",
        "session-turn": f"{session.url}/sessions/{sid}/v1/chat/completions",
        "session-control": f"{session.url}/control/hang",
    }


def _assert_400(r: httpx.Response, *words: str) -> None:
    assert r.status_code == 400, r.text
    assert r.headers["content-type"] == "application/json"
    assert r.headers["x-smg-error-code"]
    error = r.json()["error"]
    message = error["message"] if isinstance(error, dict) else error  # the router's shape, the SessionRouter's
    for word in words:
        assert word in message, (word, message)


def _nested(depth: int) -> bytes:
    return b'{"messages": [{"role": "user", "content": "hi"}], "x": ' + b"[" * depth + b"]" * depth + b"}"


TARGETS = ["router-chat", "router-generate", "router-coordinator", "session-turn", "session-control"]


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize(
    "body",
    [
        b"[" * 100_000,  # past the interpreter's recursion limit: a RecursionError before
        _nested(MAX_JSON_DEPTH),  # the object around it is one level more
        b'{"a": ' * 5000 + b"1" + b"}" * 5000,
    ],
    ids=["unterminated-100k", "just-over", "objects-5k"],
)
def test_deeply_nested_json_is_400(targets: dict[str, str], target: str, body: bytes) -> None:
    r = httpx.post(targets[target], content=body, timeout=30)
    _assert_400(r, f"nested deeper than {MAX_JSON_DEPTH} levels")


def test_nesting_at_the_limit_is_parsed(targets: dict[str, str]) -> None:
    r = httpx.post(targets["router-chat"], content=_nested(MAX_JSON_DEPTH - 1), timeout=30)
    assert "nested" not in r.text


@pytest.mark.parametrize("target", TARGETS)
def test_integer_literal_over_the_digit_limit_is_400(targets: dict[str, str], target: str) -> None:
    r = httpx.post(targets[target], content=b'{"max_tokens": ' + b"9" * 5000 + b"}", timeout=30)
    _assert_400(r, "integer literal longer than 4300 digits")


@pytest.mark.parametrize("server", ["router", "session"])
@pytest.mark.parametrize(
    "data",
    [
        b"GARBAGE\r\n\r\n",
        b"POST /generate HTTP/1.1\r\nHost: t\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}",
        b"POST /generate HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
        b"GET / HTTP/1.1\r\nBad Header\r\n\r\n",
    ],
    ids=["not-http", "two-lengths", "bad-chunk", "bad-header"],
)
def test_framing_errors_get_a_json_400(router: Proc, session: Proc, server: str, data: bytes) -> None:
    url = router.url if server == "router" else session.url
    status, code, body = json_error(exchange(url, data))
    assert (status, code) == (400, "invalid_http_request")
    message = body["error"]["message"] if server == "router" else body["error"]
    assert "malformed HTTP request" in message
    assert httpx.get(f"{router.url}/health", timeout=10).status_code == 200


def test_a_pipelined_request_is_answered_before_the_framing_error_after_it(router: Proc) -> None:
    body = b'{"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}'
    head = b"POST /generate HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
    raw = exchange(router.url, head % len(body) + body + b"GARBAGE / HTTP/1.1\r\n\r\n")
    first, _, rest = raw.partition(b"\r\n\r\n")
    assert first.startswith(b"HTTP/1.1 200"), raw[:300]
    assert b"output_ids" in rest and b"HTTP/1.1 400" in rest and b"invalid_http_request" in rest, raw[-400:]


@pytest.mark.parametrize("stream", [[1], "yes", 1, {}])
def test_session_turn_stream_must_be_a_boolean(router: Proc, targets: dict[str, str], stream: object) -> None:
    body = {"messages": MSG, "max_tokens": 2, "stream": stream}
    _assert_400(httpx.post(targets["session-turn"], json=body, timeout=30), "'stream' must be a boolean")
    _assert_400(httpx.post(targets["router-chat"], json=body, timeout=30), "'stream' must be a boolean")


def _session_error(r: httpx.Response, status: int) -> str:
    assert r.status_code == status, (r.status_code, r.text)
    assert isinstance(r.json()["error"], str) and r.headers["x-smg-error-code"], r.text
    return r.headers["x-smg-error-code"]


def test_session_router_passes_latin1_header_bytes_on(session: Proc, sid: str) -> None:
    body = {"messages": MSG, "max_tokens": 2}
    url = f"{session.url}/sessions/{sid}/v1/chat/completions"
    r = httpx.post(url, json=body, headers={"x-request-id": b"\xbd", "x-prompt-id": b"1"}, timeout=30)
    assert r.status_code == 400 and "x-request-id" in r.text  # the router's verdict on the header, passed back
    r = httpx.post(url, json=body, headers={"x-note": b"caf\xe9"}, timeout=30)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("path", ["/sessions/%0B", "/sessions/a%7Fb", "/sessions/{sid}/%7F"])
def test_session_router_control_characters_in_paths_are_not_500(session: Proc, sid: str, path: str) -> None:
    for method in ("GET", "DELETE"):
        r = httpx.request(method, session.url + path.format(sid=sid), timeout=30)
        assert r.status_code == 404, (method, path, r.status_code, r.text)


def test_session_router_control_refuses_ids_that_are_not_unicode(session: Proc) -> None:
    for path, raw in (("/control/continue", b'["\\ud800"]'), ("/control/hang", b'[{"session_id": "\\udfff"}]')):
        r = httpx.post(session.url + path, content=raw, headers={"content-type": "application/json"}, timeout=30)
        assert _session_error(r, 400) == "invalid_body" and "not valid Unicode" in r.json()["error"]


@pytest.mark.parametrize(
    ("method", "path", "status", "code"),
    [
        ("POST", "/sessions//v1/chat/completions", 404, "not_found"),
        ("GET", "/control/hang", 405, "method_not_allowed"),
        ("GET", "/sessions/", 404, "not_found"),  # no redirect to /sessions
        ("DELETE", "/sessions/", 404, "not_found"),
    ],
)
def test_session_router_unrouted_requests_are_json_errors(
    session: Proc, method: str, path: str, status: int, code: str
) -> None:
    r = httpx.request(method, session.url + path, timeout=30, follow_redirects=False)
    assert _session_error(r, status) == code


def test_no_crash_was_logged(router: Proc, session: Proc) -> None:
    for proc in (router, session):
        log = proc.log_text()
        assert not any(marker in log for marker in CRASH_MARKERS), log[-4000:]
