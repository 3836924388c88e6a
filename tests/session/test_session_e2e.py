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
    # no usage unless asked for (stream_options.include_usage), as OpenAI and vLLM stream
    assert chunks[-1].choices[0].finish_reason is not None and all(c.usage is None for c in chunks)
    snap = httpx.get(f"{session_url}/sessions/{sid}").json()
    assert [t["trajectory_id"] for t in snap["trajectories"]] == [0, 1]
    httpx.delete(f"{session_url}/sessions/{sid}")


def test_log_probs_are_what_the_client_asked_for_and_the_record_has_them_all(session_url: str, model_name: str) -> None:
    """The session forces no log-probs on the turn: top_logprobs=3 gets 3 (as through the router directly), a
    client that asked for none gets none, and the TITO record still holds every sampled token's log-prob."""
    sid = httpx.post(f"{session_url}/sessions").json()["session_id"]
    client = openai.OpenAI(base_url=f"{session_url}/sessions/{sid}/v1", api_key="x", max_retries=0)
    messages: list[dict] = [{"role": "user", "content": "Hello there"}]
    kwargs = dict(model=model_name, max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    wide = client.chat.completions.create(messages=messages, logprobs=True, top_logprobs=3, **kwargs)
    entries = wide.choices[0].logprobs.content
    assert len(entries) == 6 and all(len(e.top_logprobs) == 3 for e in entries)
    messages += [{"role": "assistant", "content": wide.choices[0].message.content}, {"role": "user", "content": "Go"}]
    bare = client.chat.completions.create(messages=messages, **kwargs)
    assert bare.choices[0].logprobs is None
    streamed = list(
        client.chat.completions.create(
            messages=messages,
            stream=True,
            stream_options={"include_usage": True},
            **kwargs,
            extra_headers={"x-smg-tito-trajectory-id": "1"},
        )
    )
    assert all(c.choices[0].logprobs is None for c in streamed if c.choices)
    # the usage alone on the last chunk, with no choices
    assert streamed[-1].choices == [] and streamed[-1].usage.completion_tokens == 6
    assert all(c.usage is None for c in streamed[:-1])

    snap = httpx.get(f"{session_url}/sessions/{sid}").json()
    records = [r for t in snap["trajectories"] for r in t["records"]]
    assert len(records) >= 3  # each trajectory lists its whole path: turn 1 is on both
    for record in records:
        pairs = record["output_logprobs"]
        assert pairs is not None and len(pairs) == 6  # one [log-prob, token id] per sampled token
        assert all(isinstance(lp, float) and lp <= 0 for lp, _ in pairs)
    # the first turn's record holds what the client got
    assert [p[0] for p in records[0]["output_logprobs"]] == pytest.approx([e.logprob for e in entries])
    httpx.delete(f"{session_url}/sessions/{sid}")
