"""The router in front of plain HTTP workers (a fake one here; tests/real_vllm/test_http_mode_vllm.py has vLLM's):
- a body goes to the worker as it came, checked by the worker alone, whose answer (an error too) comes back;
- a prefix-aware policy matches on the prompt's text, whichever API the body speaks;
- `--request-timeout-s`: an upstream that stalls past it is a 504 naming the worker, and the router goes on
  serving; without it, a slow upstream is waited for;
- a worker's health check is GET /health on the router's own HTTP client: 200 in time is healthy, anything else
  (another status, nobody there, no answer) is not."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from _procs import free_port, silent_peer, start_router, stop_processes

from psrl.router.http_backend import HttpWorkers
from psrl.router.registry import WorkerRegistry

MODEL = "slow-model"


class _SlowWorker(BaseHTTPRequestHandler):
    """A stock OpenAI-compatible server's shape, whose chat completions take `delay_s` (set per test). It keeps
    the bodies it was sent, and answers `refusal` (a status and its JSON) instead when that is set."""

    delay_s = 0.0
    refusal: tuple[int, dict] | None = None
    health = 200  # what GET /health answers
    received: list[bytes] = []
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:
        pass

    def _json(self, payload: object, status: int = 200) -> None:
        body = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        if self.path == "/v1/models":
            self._json({"object": "list", "data": [{"id": MODEL, "object": "model", "max_model_len": 2048}]})
        elif self.path == "/health":
            self._json({"status": "ok"}, type(self).health)
        else:
            self._json({"error": "not found"}, 404)

    def do_POST(self) -> None:
        type(self).received.append(self.rfile.read(int(self.headers.get("content-length", "0"))))
        time.sleep(type(self).delay_s)
        if type(self).refusal is not None:
            self._json(type(self).refusal[1], type(self).refusal[0])
        else:
            self._json({"id": "c", "object": "chat.completion", "model": MODEL, "choices": []})


@contextlib.contextmanager
def _fake_worker() -> Iterator[tuple[str, type[_SlowWorker]]]:
    handler = type("SlowWorker", (_SlowWorker,), {"received": []})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", handler
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def slow_worker() -> Iterator[tuple[str, type[_SlowWorker]]]:
    with _fake_worker() as worker:
        yield worker


def _chat(url: str, stream: bool = False) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": stream}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30)


def test_bodies_go_to_the_worker_as_they_came_and_its_verdict_comes_back(slow_worker, log_dir) -> None:
    """The router reads only what routing needs (the model, stream, and a prefix-aware policy's text); the
    rest is the worker's to check, as it would be without the router: an image part, which gRPC workers'
    text-only models refuse, goes through byte for byte, and so does the worker's own error."""
    url, handler = slow_worker
    args = ["--connection-mode", "http", "--policy", "cache_aware", "--enable-routing-loop"]
    router = start_router(log_dir, [url], args=args)
    try:
        image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
        messages = [{"role": "user", "content": [{"type": "text", "text": "what is this?"}, image]}]
        body = json.dumps({"model": MODEL, "messages": messages, "top_k": 0, "max_tokens": 3}).encode()
        r = httpx.post(f"{router.url}/v1/chat/completions", content=body, timeout=30)
        assert r.status_code == 200, r.text
        assert handler.received == [body]
        handler.refusal = (400, {"error": {"message": "the worker says no", "type": "BadRequestError", "code": 400}})
        responses = {"model": MODEL, "input": [{"role": "user", "content": "hi"}], "max_output_tokens": -5}
        r = httpx.post(f"{router.url}/v1/responses", json=responses, timeout=30)
        assert (r.status_code, r.json()) == handler.refusal
        assert json.loads(handler.received[-1]) == responses
        # What routing itself reads is still checked here, and a request refused for it holds no instance.
        psrl = {"x-request-id": "7", "x-prompt-id": "7"}  # through the routing loop
        for headers in ({}, psrl):
            bad = {"model": MODEL, "messages": [], "stream": "yes"}
            r = httpx.post(f"{router.url}/v1/chat/completions", json=bad, headers=headers, timeout=30)
            assert r.status_code == 400 and r.json()["error"]["param"] == "stream"
        r = httpx.post(f"{router.url}/v1/chat/completions", json={"model": "other", "messages": []})
        assert r.status_code == 404
        assert len(handler.received) == 2
        [worker] = httpx.get(f"{router.url}/workers", timeout=10).json()["workers"]
        assert worker["instances"][0]["inflight_requests"] == 0
        loop = httpx.get(f"{router.url}/routing_loop/status", timeout=10).json()
        assert (loop["active_dispatch_handoffs"], loop["running_request_num"]) == (0, 0)
    finally:
        stop_processes([router.proc])


def test_cache_aware_places_a_prompt_by_its_text_in_every_api(log_dir) -> None:
    """Over HTTP the policy has no token ids: it matches the text the router reads from the body. Two prompts
    take one worker each (the second goes to the emptier tree), and each comes back to its own worker whether
    it is sent as a chat, a Responses or a Messages body. With no text every request would go to the first."""
    a, b = "the story of a lighthouse keeper " * 20, "a recipe for bread with seeds " * 20
    bodies = {
        "/v1/chat/completions": lambda text: {"model": MODEL, "messages": [{"role": "user", "content": text}]},
        "/v1/responses": lambda text: {"model": MODEL, "input": [{"role": "user", "content": text}]},
        "/v1/messages": lambda text: {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": text}]},
    }
    with _fake_worker() as (url_1, _), _fake_worker() as (url_2, _):
        router = start_router(log_dir, [url_1, url_2], args=["--connection-mode", "http", "--policy", "cache_aware"])
        try:

            def served(path: str, text: str) -> str:
                r = httpx.post(f"{router.url}{path}", json=bodies[path](text), timeout=30)
                assert r.status_code == 200, r.text
                return r.headers["x-base-worker-id"]

            home_a = served("/v1/chat/completions", a)
            home_b = served("/v1/chat/completions", b)
            assert home_a != home_b
            for path in bodies:
                assert (served(path, a + path), served(path, b + path)) == (home_a, home_b), path
        finally:
            stop_processes([router.proc])


def test_an_upstream_past_the_request_timeout_is_a_504(slow_worker, log_dir) -> None:
    url, handler = slow_worker
    router = start_router(log_dir, [url], args=["--connection-mode", "http", "--request-timeout-s", "0.5"])
    try:
        handler.delay_s = 3.0
        started = time.monotonic()
        r = _chat(router.url)
        assert r.status_code == 504, r.text
        assert r.json()["error"]["code"] == "worker_timeout"
        assert time.monotonic() - started < 2.5  # cut at the timeout, not when the upstream answered
        started = time.monotonic()
        r = _chat(router.url, stream=True)  # a stream whose upstream sent nothing yet fails as a whole
        assert r.status_code == 504 and r.json()["error"]["code"] == "worker_timeout", r.text
        assert time.monotonic() - started < 2.5
        handler.delay_s = 0.0
        assert _chat(router.url).status_code == 200  # the router goes on serving
    finally:
        stop_processes([router.proc])


def test_without_a_request_timeout_a_slow_upstream_is_waited_for(slow_worker, log_dir) -> None:
    url, handler = slow_worker
    router = start_router(log_dir, [url], args=["--connection-mode", "http"])
    try:
        handler.delay_s = 1.5
        r = _chat(router.url)
        assert r.status_code == 200, r.text
        assert r.json()["object"] == "chat.completion"
    finally:
        stop_processes([router.proc])


async def test_a_health_check_is_a_get_of_health_on_the_lean_client(
    slow_worker: tuple[str, type[_SlowWorker]], monkeypatch: pytest.MonkeyPatch
) -> None:
    url, handler = slow_worker
    workers = HttpWorkers(connect_timeout_s=5.0, request_timeout_s=None)

    async def not_httpx(*args: object, **kwargs: object) -> None:
        raise AssertionError("the health check went through httpx")

    monkeypatch.setattr(workers._client, "get", not_httpx)
    registry = WorkerRegistry()
    worker = registry.create_worker("w", url, models=[MODEL], labels={}, connection_mode="http")
    try:
        assert await workers.is_healthy(worker, 5.0)
        handler.health = 503
        assert not await workers.is_healthy(worker, 5.0)
        gone = registry.create_worker("gone", f"http://127.0.0.1:{free_port()}", models=[MODEL], labels={})
        assert not await workers.is_healthy(gone, 5.0)
        with silent_peer() as port:  # only the check's timeout ends it
            quiet = registry.create_worker("quiet", f"http://127.0.0.1:{port}", models=[MODEL], labels={})
            start = time.monotonic()
            assert not await workers.is_healthy(quiet, 0.5)
            assert time.monotonic() - start < 5
    finally:
        await workers.close()
