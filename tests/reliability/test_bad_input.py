"""Bad input over real processes: a 4xx with a JSON error body that names the problem; nothing crashes."""

from __future__ import annotations

import json

import httpx
import openai
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


@pytest.mark.parametrize(
    ("path", "body", "words"),
    [
        ("/generate", {"input_ids": [1, True]}, ["token ids", "item 1 is bool", "input_ids"]),
        ("/generate", {"input_ids": [[1, 2], [False]]}, ["token ids", "item 0 is bool"]),
        ("/v1/completions", {"prompt": [1, True], "max_tokens": 2}, ["token ids", "item 1 is bool"]),
        ("/v1/chat/completions", {"messages": MSG, "stop_token_ids": [True]}, ["item 0 is bool", "stop_token_ids"]),
        ("/generate", {"input_ids": [1, 2], "sampling_params": {"stop_token_ids": [True]}}, ["stop_token_ids"]),
    ],
)
def test_booleans_are_not_token_ids(router, path, body, words) -> None:
    _error(_post(router, path, json=body), 400, *words)


@pytest.mark.parametrize("header", ["x-version-tag", "x-request-id", "x-prompt-id", "x-target-dp-rank"])
def test_psrl_header_values_past_int64_are_400(router, header) -> None:
    headers = {"x-request-id": "1", "x-prompt-id": "1", header: "9" * 20}
    body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}
    r = _post(router, "/generate", json=body, headers=headers)
    assert _error(r, 400, header, "int64")["param"] == header


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/workers", {"url": "grpc://127.0.0.1:99999"}),
        ("/workers", {"url": "grpc://[::1:1"}),
        ("/workers", {"url": "grpc://127.0.0.1:port"}),
    ],
)
def test_worker_urls_that_do_not_parse_are_400(router, path, body) -> None:
    _error(_post(router, path, json=body), 400, "'url' must look like grpc://host:port")


def test_coordinator_bodies_with_odd_values_are_rejected_per_entry(router) -> None:
    for path in ("/workers/pause", "/workers/resume"):
        odd = [{"base_worker_id": "0", "dp_rank": [[0]]}, {"base_worker_id": "0", "dp_rank": {}}]
        r = _post(router, path, json=odd)
        assert r.status_code == 200, r.text
        assert [e["status"] for e in r.json()["results"]] == ["rejected", "rejected"]
    entry = {"worker_id": "0", "dp_rank": 0, "timestamp": "2030-01-01T00:00:00Z"}
    body = [
        {**entry, "scheduler_stats": {"num_running_reqs": 1e999}},
        {**entry, "scheduler_stats": {"kv_cache_usage": 1e999}},
    ]
    r = _post(router, "/workers/update_stats", content=json.dumps(body).encode())  # 1e999 goes out as Infinity
    assert r.status_code == 200 and r.json()["rejected"] == 2, r.text


def test_unknown_model_is_404(router) -> None:
    body = _error(_post(router, "/v1/chat/completions", json={"model": "gpt-17", "messages": MSG}), 404, "gpt-17")
    assert body["code"] == "model_not_found"


def _overflow(r: httpx.Response) -> dict:
    """A context overflow reads as OpenAI's (client libraries) and as PSRL's (header and vLLM's phrase) at once."""
    assert r.status_code == 400, r.text
    body = r.json()["error"]
    assert body["code"] == "context_length_exceeded" and body["type"] == "invalid_request_error", body
    assert r.headers["x-smg-error-code"] == "prompt_overflow"
    assert body["message"].startswith("This model's maximum context length is "), body
    assert "Please reduce the length of the messages or completion." in body["message"]
    assert "longer than the maximum model length" in body["message"]
    return body


def _max_context(router) -> int:
    [worker] = httpx.get(f"{router.url}/workers", timeout=10).json()["workers"]
    return int(worker["max_context_length"])


def test_prompt_longer_than_context_is_400_prompt_overflow(router) -> None:
    n = _max_context(router)
    r = _post(router, "/generate", json={"input_ids": [7] * (n + 10), "sampling_params": {"max_new_tokens": 1}})
    body = _overflow(r)
    assert (
        f"maximum context length is {n} tokens. However, you requested {n + 11} tokens ({n + 10} in the "
        in (body["message"])
    )
    long_text = "hello " * 6000
    r = _post(router, "/v1/chat/completions", json={"messages": [{"role": "user", "content": long_text}]})
    assert _overflow(r)["param"] == "messages"


def test_prompt_plus_max_tokens_over_context_is_the_same_overflow(router) -> None:
    n = _max_context(router)
    r = _post(router, "/generate", json={"input_ids": [7] * 10, "sampling_params": {"max_new_tokens": n}})
    body = _overflow(r)
    assert f"you requested {n + 10} tokens (10 in the messages, {n} in the completion)" in body["message"]
    assert body["param"] == "max_tokens"


# Too long a prompt, and a prompt that fits with too large a max_tokens.
OVERFLOWS = [({"messages": [{"role": "user", "content": "hello " * 6000}]}), ({"messages": MSG, "max_tokens": 10**6})]


@pytest.mark.parametrize("request_kw", OVERFLOWS)
def test_openai_sdk_sees_a_context_length_error(router, request_kw) -> None:
    client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="none", max_retries=0)
    model = client.models.list().data[0].id
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=model, **request_kw)
    assert exc.value.code == "context_length_exceeded"
    assert exc.value.response.headers["x-smg-error-code"] == "prompt_overflow"
    assert "maximum context length" in exc.value.message


@pytest.mark.parametrize("request_kw", OVERFLOWS)
def test_litellm_raises_context_window_exceeded(router, monkeypatch, request_kw) -> None:
    """litellm retried the old overflow error with backoff instead of raising ContextWindowExceededError."""
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no network: litellm's bundled cost map
    import litellm  # imported here, after the environment says not to fetch its cost map

    model = httpx.get(f"{router.url}/v1/models", timeout=10).json()["data"][0]["id"]
    with pytest.raises(litellm.ContextWindowExceededError):
        litellm.completion(
            model=f"openai/{model}", api_base=f"{router.url}/v1", api_key="none", num_retries=0, **request_kw
        )


def _raw(router, path: str, body: dict, headers: dict | None = None) -> httpx.Response:
    """json.dumps escapes a lone surrogate as \\udXXX, as a careless client's JSON encoder would send it."""
    headers = {"content-type": "application/json", **(headers or {})}
    return _post(router, path, content=json.dumps(body).encode(), headers=headers)


BAD = "ok \ud800 there"
CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": "' + BAD + '"}'}}
TOOL = {"type": "function", "function": {"name": "f", "description": BAD, "parameters": {"type": "object"}}}


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": BAD}]}, "messages[0].content"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": BAD}]}]},
            "messages[0].content[1].text",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "system", "content": BAD}, {"role": "user", "content": "hi"}]},
            "messages[0].content",
        ),
        (
            "/v1/chat/completions",
            {"messages": [*MSG, {"role": "assistant", "content": None, "tool_calls": [CALL]}, *MSG]},
            "messages[1].tool_calls[0].function.arguments",
        ),
        ("/v1/chat/completions", {"messages": MSG, "tools": [TOOL]}, "tools[0].function.description"),
        ("/v1/chat/completions", {"messages": MSG, "chat_template_kwargs": {"x": BAD}}, "chat_template_kwargs.x"),
        ("/v1/chat/completions", {"messages": MSG, "stop": [BAD]}, "stop"),
        ("/v1/completions", {"prompt": BAD, "max_tokens": 2}, "prompt"),
        ("/v1/completions", {"prompt": ["fine", BAD], "max_tokens": 2}, "prompt[1]"),
        ("/generate", {"text": BAD, "sampling_params": {"max_new_tokens": 2}}, "text"),
        ("/v1/responses", {"input": BAD}, None),
        ("/v1/responses", {"input": "hi", "instructions": BAD}, None),
        ("/v1/messages", {"max_tokens": 2, "messages": [{"role": "user", "content": BAD}]}, None),
        ("/v1/messages", {"max_tokens": 2, "system": BAD, "messages": MSG}, None),
    ],
)
def test_lone_surrogate_is_400_naming_the_field(router, path, body, param) -> None:
    err = _error(_raw(router, path, body), 400, "lone surrogate")
    if param is not None:
        assert err["param"] == param and param in err["message"], err


def test_paired_surrogates_are_fine(router) -> None:
    # Both go on the wire as the escaped pair \\ud83d\\ude00, which JSON decodes to one character.
    r = _raw(router, "/v1/chat/completions", {"messages": [{"role": "user", "content": "\U0001f600 \ud83d\ude00"}]})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("key", ["messages", "tools", "add_generation_prompt", "bos_token", "eos_token"])
def test_template_kwargs_that_collide_with_the_template_call_are_400(router, key) -> None:
    body = {"messages": MSG, "max_tokens": 2, "chat_template_kwargs": {key: []}}
    err = _error(_post(router, "/v1/chat/completions", json=body), 400, repr(key))
    assert err["param"] == f"chat_template_kwargs.{key}"


@pytest.mark.parametrize("kwargs", [[1], "enable_thinking", 3])
def test_template_kwargs_must_be_an_object(router, kwargs) -> None:
    body = {"messages": MSG, "chat_template_kwargs": kwargs}
    _error(_post(router, "/v1/chat/completions", json=body), 400, "'chat_template_kwargs' must be an object")


def test_template_kwargs_are_still_passed_to_the_template(router) -> None:
    body = {"messages": MSG, "max_tokens": 2, "chat_template_kwargs": {"enable_thinking": False}}
    assert _post(router, "/v1/chat/completions", json=body).status_code == 200


def test_bad_tito_turns_are_400_and_leave_the_session_usable(router) -> None:
    sid = _post(router, "/tito/sessions").json()["session_id"]
    headers = {"x-smg-tito-session-id": sid}
    r = _raw(router, "/v1/chat/completions", {"messages": [{"role": "user", "content": BAD}]}, headers)
    _error(r, 400, "lone surrogate")
    body = {"messages": MSG, "chat_template_kwargs": {"messages": []}}
    _error(_post(router, "/v1/chat/completions", json=body, headers=headers), 400, "'messages'")
    r = _post(router, "/v1/chat/completions", json={"messages": MSG, "max_tokens": 2}, headers=headers)
    assert r.status_code == 200, r.text


def test_token_outside_vocabulary_is_400(router) -> None:
    _error(_post(router, "/generate", json={"input_ids": [1, 10**7]}), 400, "vocab")


def test_worker_registration_errors(router) -> None:
    r = httpx.post(f"{router.url}/workers", json={"url": "ftp://nope:1"}, timeout=10)
    _error(r, 400, "grpc://host:port")
    r = httpx.post(f"{router.url}/workers", json={"url": "http://nope"}, timeout=10)
    _error(r, 400, "http://host:port")
    # Calls reach a worker at host:port: an HTTP worker in plain HTTP, no worker under a path prefix.
    unreachable = ("https://127.0.0.1:8443", "http://127.0.0.1:8000/v1", "grpc://127.0.0.1:9000/x")
    said_more = ("http://127.0.0.1:8000?key=1", "grpc://127.0.0.1:9000#x", "grpc://user:secret@127.0.0.1:9000")
    for url in unreachable + said_more:  # the last ones would have their extra part dropped, or sent on
        r = httpx.post(f"{router.url}/workers", json={"url": url}, timeout=10)
        _error(r, 400, "(no path, query or user)", url)
    r = httpx.post(f"{router.url}/workers", json={"url": "grpc://ü..example:9000"}, timeout=10)
    _error(r, 400, "IDNA cannot encode")  # a host name with no ASCII form (an empty label)
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
