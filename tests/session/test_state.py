"""SessionState and the turn header rules, without a server."""

from __future__ import annotations

import json

import pytest

from psrl.apis import chat_sse_events
from psrl.session.state import SessionState, session_headers_from, session_ids_of, trajectory_key


def test_whitelist_keeps_routing_headers_and_drops_a_spoofed_session_id() -> None:
    sent = {"X-Prompt-Id": "7", "x-request-id": "8", "x-smg-tito-session-id": "evil", "x-other": "1"}
    kept = session_headers_from({**sent, "x-version-tag": "-1"})
    assert kept == {"x-prompt-id": "7", "x-request-id": "8", "x-version-tag": "-1"}


def test_header_precedence_session_request_state_pin() -> None:
    s = SessionState("s1", headers={"x-prompt-id": "1", "x-base-worker-id": "w0", "x-version-tag": "-1"})
    h, traj = s.turn_headers({"x-prompt-id": "2", "x-smg-tito-session-id": "evil", "host": "h"}, "manual")
    assert h["x-prompt-id"] == "2" and h["x-base-worker-id"] == "w0" and h["x-version-tag"] == "-1"
    assert h["x-smg-tito-session-id"] == "s1" and "host" not in h and traj == "0"
    s.record_success({"x-base-worker-id": "w1", "x-target-dp-rank": "3", "x-version-tag": "5"}, None)
    h, _ = s.turn_headers({"x-base-worker-id": "client", "x-version-tag": "0"}, "manual")
    assert (h["x-base-worker-id"], h["x-target-dp-rank"], h["x-version-tag"]) == ("w1", "3", "5")
    assert "x-force-pin-once" not in h
    s.resume("w2", "1")
    h, _ = s.turn_headers({}, "manual")
    assert (h["x-base-worker-id"], h["x-target-dp-rank"], h["x-force-pin-once"]) == ("w2", "1", "true")
    h, _ = s.turn_headers({}, "manual")  # one shot only
    assert h["x-base-worker-id"] == "w1" and "x-force-pin-once" not in h


def test_trajectory_id_manual_and_auto() -> None:
    s = SessionState("s")
    assert s.turn_headers({"x-smg-tito-trajectory-id": "4"}, "manual")[0]["x-smg-tito-trajectory-id"] == "4"
    h, traj = s.turn_headers({"x-smg-tito-trajectory-id": "4"}, "auto")
    assert "x-smg-tito-trajectory-id" not in h and traj is None
    s.advance_trajectory("0")
    s.advance_trajectory("00")
    assert s.trajectory_turns == {"0": 2}  # one trajectory to the router


def test_hang_is_deferred_mid_turn_and_applies_at_zero_inflight() -> None:
    s = SessionState("s")
    assert s.status == "env"
    s.begin_turn()
    assert s.status == "generate" and s.request_hang() == "deferred" and s.marked_for_hang
    assert s.hang_state == "running"
    s.end_turn()
    assert s.hang_state == "hung" and not s.continue_event.is_set() and s.drained.is_set()
    s.resume()
    assert s.hang_state == "running" and s.continue_event.is_set() and s.pin_once_instance is None
    assert s.request_hang() == "hung"
    s.start_closing()
    assert s.closing and s.continue_event.is_set()


def test_total_tokens_is_the_max_turn_size() -> None:
    s = SessionState("s")
    s.record_success({}, {"prompt_tokens": 10, "completion_tokens": 5})
    s.record_success({}, {"prompt_tokens": 3, "completion_tokens": 1})
    s.record_success({}, {"input_tokens": 20, "output_tokens": 2})  # the Responses / Messages shape
    assert s.total_tokens == 22
    s.record_success({}, {"input_tokens": 4, "cache_read_input_tokens": 19, "output_tokens": 2})  # Anthropic's
    assert s.total_tokens == 25  # its cache reads are prompt tokens too


def test_control_bodies() -> None:
    assert [sid for sid, _ in session_ids_of(["a", {"session_id": "b"}])] == ["a", "b"]
    assert session_ids_of({"sessions": [{"session_id": "c", "base_worker_id": "w"}]}) == [
        ("c", {"session_id": "c", "base_worker_id": "w"})
    ]
    with pytest.raises(ValueError):
        session_ids_of({"x": 1})
    with pytest.raises(ValueError):
        session_ids_of([1])


def test_sse_from_a_buffered_result() -> None:
    result = {
        "id": "c1",
        "created": 1,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "finish_reason": "tool_calls",
                "message": {
                    "role": "assistant",
                    "content": "hi",
                    "reasoning_content": "think",
                    "tool_calls": [{"id": "t1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
                },
            }
        ],
        "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3},
    }
    events = chat_sse_events(result, include_usage=True)
    assert events[-1] == "data: [DONE]\n\n"
    chunks = [json.loads(e[len("data: ") :]) for e in events[:-1]]
    usage = chunks.pop()  # asked for: alone on a last chunk without choices, as OpenAI sends it
    assert usage["choices"] == [] and usage["usage"]["total_tokens"] == 3
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0]["role"] == "assistant"
    assert deltas[1] == {"reasoning_content": "think"} and deltas[2] == {"content": "hi"}
    assert deltas[3]["tool_calls"][0]["index"] == 0 and deltas[3]["tool_calls"][0]["function"]["name"] == "f"
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls" and "usage" not in chunks[-1]
    assert all("usage" not in json.loads(e[len("data: ") :]) for e in chat_sse_events(result)[:-1])  # not asked


def test_trajectory_keys_parse_as_the_router_does() -> None:
    assert trajectory_key("01") == trajectory_key("+1") == trajectory_key(" 1 ") == "1"
    assert trajectory_key(None) == "0"
    assert trajectory_key("²") == "²" and trajectory_key("main") == "main"  # not a number: the name itself
