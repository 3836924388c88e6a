"""The SessionRouter over real processes (reference replica + router + `python -m psrl.session`) with the
official openai client: every turn's sampled ids land in the router's TITO record."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from _procs import start_replica, start_router, start_session_router

from psrl.gateway.processes import stop_processes
from psrl.tito import build_training_arrays


@pytest.fixture(scope="module")
def session_url(model_dir: Path, log_dir: Path) -> Iterator[str]:
    replica = start_replica(model_dir, log_dir)
    router = start_router(log_dir, [replica.url])
    session = start_session_router(log_dir, router.url)
    yield session.url
    stop_processes([session.proc, router.proc, replica.proc])


@pytest.fixture(scope="module")
def model_name(session_url: str) -> str:
    # through the catch-all: GET /sessions/{sid}/v1/models -> the router's /v1/models
    sid = httpx.post(f"{session_url}/sessions").json()["session_id"]
    name = httpx.get(f"{session_url}/sessions/{sid}/v1/models").json()["data"][0]["id"]
    httpx.delete(f"{session_url}/sessions/{sid}")
    return name


def test_four_turns_through_the_session_router(session_url: str, model_name: str, tokenizer) -> None:
    sid = httpx.post(f"{session_url}/sessions", headers={"x-smg-tito-session-id": "spoofed"}).json()["session_id"]
    assert sid != "spoofed"
    client = openai.OpenAI(base_url=f"{session_url}/sessions/{sid}/v1", api_key="x")
    messages: list[dict] = [{"role": "user", "content": "Hello there"}]
    replies = []
    for i in range(4):
        r = client.chat.completions.with_raw_response.create(
            model=model_name, messages=messages, max_tokens=8, temperature=0
        )
        completion = r.parse()
        assert r.headers["x-base-worker-id"]
        text = completion.choices[0].message.content or ""
        replies.append((text, completion.usage.completion_tokens))
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": f"and then {i}?"}]
    r = httpx.get(f"{session_url}/sessions/{sid}")
    assert r.status_code == 200 and r.headers["x-base-worker-id"]
    snap = r.json()
    arrays = build_training_arrays(snap)
    assert arrays.num_turns == 4
    sampled = arrays.response_ids[arrays.response_mask == 1].tolist()
    assert len(sampled) == sum(n for _, n in replies)
    start = 0
    for text, n in replies:
        assert tokenizer.decode(sampled[start : start + n]) == text
        start += n
    [entry] = [s for s in httpx.get(f"{session_url}/control/sessions").json()["sessions"] if s["session_id"] == sid]
    assert entry["total_tokens"] > 0 and entry["status"] == "env"
    assert httpx.delete(f"{session_url}/sessions/{sid}").status_code == 204
    assert httpx.get(f"{session_url}/sessions/{sid}").status_code == 404


def test_streaming_client_gets_sse_from_the_buffered_result(session_url: str, model_name: str) -> None:
    sid = httpx.post(f"{session_url}/sessions").json()["session_id"]
    client = openai.OpenAI(base_url=f"{session_url}/sessions/{sid}/v1", api_key="x")
    messages = [{"role": "user", "content": "Hi"}]
    full = client.chat.completions.create(model=model_name, messages=messages, max_tokens=6, temperature=0)
    chunks = list(
        client.chat.completions.create(
            model=model_name,
            messages=messages,
            max_tokens=6,
            temperature=0,
            stream=True,
            extra_headers={"x-smg-tito-trajectory-id": "1"},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == (full.choices[0].message.content or "")
    assert chunks[-1].choices[0].finish_reason is not None and chunks[-1].usage is not None
    snap = httpx.get(f"{session_url}/sessions/{sid}").json()
    assert [t["trajectory_id"] for t in snap["trajectories"]] == [0, 1]
    httpx.delete(f"{session_url}/sessions/{sid}")
