"""TITO through the router over real processes: session endpoints, incremental turns, exact sampled ids."""

from __future__ import annotations

import httpx
import pytest
from _procs import start_replica, start_router

from psrl.gateway.processes import stop_processes
from psrl.tito import build_training_arrays


@pytest.fixture(scope="module")
def router(model_dir, log_dir):
    replica = start_replica(model_dir, log_dir)
    proc = start_router(log_dir, [replica.url])
    yield proc
    stop_processes([proc.proc, replica.proc])


def _turn(router, sid: str, messages: list[dict], **extra) -> httpx.Response:
    body = {"messages": messages, "max_tokens": 12, "temperature": 0, "logprobs": True, **extra}
    return httpx.post(
        f"{router.url}/v1/chat/completions", json=body, timeout=60, headers={"x-smg-tito-session-id": sid}
    )


def test_three_turns_record_exactly_what_was_sampled(router, tokenizer) -> None:
    sid = httpx.post(f"{router.url}/tito/sessions").json()["session_id"]
    messages = [{"role": "user", "content": "Hello there"}]
    replies = []
    for i in range(3):
        r = _turn(router, sid, messages)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        ids = [tokenizer.encode(t["token"]) for t in choice["logprobs"]["content"]]
        replies.append((choice["message"]["content"] or "", r.json()["usage"]["completion_tokens"], ids))
        messages += [
            {"role": "assistant", "content": choice["message"]["content"] or ""},
            {"role": "user", "content": f"and then {i}?"},
        ]
    snap = httpx.get(f"{router.url}/tito/sessions/{sid}").json()
    assert snap["session_id"] == sid and snap["header_info"]["base_worker_id"]
    [trajectory] = snap["trajectories"]
    records = trajectory["records"]
    assert len(records) == 3
    counts = [rec["prompt_token_count"] for rec in records]
    assert counts == sorted(counts) and len(set(counts)) == 3
    arrays = build_training_arrays(snap)
    assert arrays.num_turns == 3
    sampled = arrays.response_ids[arrays.response_mask == 1].tolist()
    assert len(sampled) == sum(n for _, n, _ in replies)
    # each turn's sampled ids decode to the reply the client saw
    start = 0
    for text, n, _ in replies:
        assert tokenizer.decode(sampled[start : start + n]) == text
        start += n
    assert (arrays.rollout_logprobs[arrays.response_mask == 1] <= 0).all()
    assert (arrays.response_mask == 0).any()  # the user turns in between
    assert "psrl_router_tito_sessions 1.0" in httpx.get(f"{router.url}/metrics").text
    assert httpx.delete(f"{router.url}/tito/sessions/{sid}").status_code == 204
    assert "psrl_router_tito_sessions 0.0" in httpx.get(f"{router.url}/metrics").text
    r = httpx.get(f"{router.url}/tito/sessions/{sid}")
    assert r.status_code == 404 and r.json()["error"]["code"] == "session_not_found"


def test_tito_errors(router) -> None:
    r = _turn(router, "no-such-session", [{"role": "user", "content": "hi"}])
    assert r.status_code == 404
    sid = httpx.post(f"{router.url}/tito/sessions").json()["session_id"]
    r = _turn(router, sid, [{"role": "user", "content": "hi"}], stream=True)
    assert r.status_code == 400 and "stream" in r.json()["error"]["message"]
    r = httpx.post(
        f"{router.url}/v1/chat/completions",
        timeout=30,
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        headers={"x-smg-tito-session-id": sid, "x-smg-tito-trajectory-id": "x"},
    )
    assert r.status_code == 400
