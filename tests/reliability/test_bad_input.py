"""Bad input over real processes: a 4xx with a JSON error body that names the problem; nothing crashes."""

from __future__ import annotations

import httpx
import pytest


def _post(router, path: str, **kw) -> httpx.Response:
    return httpx.post(f"{router.url}{path}", timeout=30, **kw)


def _error(r: httpx.Response, status: int, *words: str) -> dict:
    assert r.status_code == status, r.text
    body = r.json()["error"]
    for w in words:
        assert w in body["message"], (w, body)
    assert r.headers["x-smg-error-code"] == body["code"]
    return body


MSG = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("path", "kwargs", "status", "words"),
    [
        ("/v1/chat/completions", {"content": b"{not json"}, 400, ["not valid JSON"]),
        ("/v1/chat/completions", {"content": b"[1, 2]"}, 400, ["JSON object"]),
        ("/v1/chat/completions", {"json": {"max_tokens": 4}}, 400, ["'messages' is required"]),
        ("/v1/chat/completions", {"json": {"messages": []}}, 400, ["non-empty"]),
        ("/v1/chat/completions", {"json": {"messages": "hi"}}, 400, ["'messages'"]),
        ("/v1/chat/completions", {"json": {"messages": [{"role": "wizard", "content": "x"}]}}, 400, ["role"]),
        ("/v1/chat/completions", {"json": {"messages": [{"role": "user", "content": 5}]}}, 400, ["content"]),
        ("/v1/chat/completions", {"json": {"messages": MSG, "max_tokens": 0}}, 400, ["max_tokens", ">= 1"]),
        ("/v1/chat/completions", {"json": {"messages": MSG, "max_tokens": "5"}}, 400, ["max_tokens", "integer"]),
        ("/v1/chat/completions", {"json": {"messages": MSG, "temperature": "hot"}}, 400, ["temperature"]),
        ("/v1/chat/completions", {"json": {"messages": MSG, "top_p": 0}}, 400, ["top_p"]),
        ("/v1/chat/completions", {"json": {"messages": MSG, "n": 0}}, 400, ["'n' must be >= 1"]),
        ("/v1/chat/completions", {"json": {"messages": MSG, "stream": "yes"}}, 400, ["stream", "boolean"]),
        ("/v1/completions", {"json": {"max_tokens": 3}}, 400, ["'prompt' is required"]),
        ("/v1/completions", {"json": {"prompt": [1, "a"]}}, 400, ["prompt"]),
        ("/generate", {"json": {"sampling_params": {}}}, 400, ["input_ids"]),
        ("/generate", {"json": {"input_ids": [1, -2]}}, 400, ["negative"]),
        (
            "/generate",
            {"json": {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 0}}},
            400,
            ["max_new_tokens"],
        ),
        ("/generate", {"json": {"input_ids": [1, 2], "sampling_params": []}}, 400, ["sampling_params"]),
    ],
)
def test_malformed_requests_are_400(router, path, kwargs, status, words) -> None:
    _error(_post(router, path, **kwargs), status, *words)


def test_unknown_model_is_404(router) -> None:
    body = _error(_post(router, "/v1/chat/completions", json={"model": "gpt-17", "messages": MSG}), 404, "gpt-17")
    assert body["code"] == "model_not_found"


def test_prompt_longer_than_context_is_400_prompt_overflow(router) -> None:
    r = _post(router, "/generate", json={"input_ids": [7] * 5000, "sampling_params": {"max_new_tokens": 1}})
    body = _error(r, 400, "longer than the maximum model length")
    assert body["code"] == "prompt_overflow"
    long_text = "hello " * 6000
    r = _post(router, "/v1/chat/completions", json={"messages": [{"role": "user", "content": long_text}]})
    assert _error(r, 400, "maximum model length")["code"] == "prompt_overflow"


def test_token_outside_vocabulary_is_400(router) -> None:
    _error(_post(router, "/generate", json={"input_ids": [1, 10**7]}), 400, "vocab")


def test_worker_registration_errors(router) -> None:
    r = httpx.post(f"{router.url}/workers", json={"url": "ftp://nope:1"}, timeout=10)
    _error(r, 400, "grpc://host:port")
    r = httpx.post(f"{router.url}/workers", json={"url": "http://nope"}, timeout=10)
    _error(r, 400, "http://host:port")
    r = httpx.post(f"{router.url}/workers", json={"url": "grpc://h:1", "connection_mode": "carrier-pigeon"})
    _error(r, 400, "connection_mode")
    r = httpx.post(f"{router.url}/workers", json={"url": "grpc://127.0.0.1:1"}, timeout=30)
    _error(r, 503, "cannot reach worker")
    r = httpx.delete(f"{router.url}/workers/does-not-exist", timeout=10)
    _error(r, 404, "does-not-exist")


def test_router_still_serves_after_all_that(router) -> None:
    r = _post(router, "/v1/chat/completions", json={"messages": MSG, "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] <= 2
