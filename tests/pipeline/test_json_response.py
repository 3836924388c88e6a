"""The router's JSON answers (psrl.router.web.json_response): msgspec writes those the caller knows hold only
finite floats; json.dumps the rest, so a -inf logprob stays `-Infinity` (as vLLM's server writes it), never null."""

from __future__ import annotations

import json

from psrl.router.web import json_response

_PAYLOAD = {
    "id": "gen-1",
    "output_ids": [214, 7],
    "meta_info": {"finish_reason": {"type": "length", "length": 2}, "weight_version": 3, "routed_experts": None},
    "text": 'caf\u00e9 \u0017\n"quoted"',
    "flags": [True, False],
    "big": 2**70,
}


def test_a_finite_payload_is_the_same_json_value() -> None:
    response = json_response(_PAYLOAD, 201, {"x-version-tag": "3"}, finite=True)
    assert json.loads(response.body) == _PAYLOAD
    assert (response.status_code, response.media_type, response.headers) == (
        201,
        "application/json",
        {"x-version-tag": "3"},
    )
    assert "café".encode() in response.body  # UTF-8, as application/json is by default


def test_non_finite_floats_keep_json_spelling() -> None:
    payload = {"output_token_logprobs": [[float("-inf"), 5], [-0.5, 6]], "x": float("nan")}
    body = json_response(payload).body
    assert b"-Infinity" in body and b"NaN" in body
    decoded = json.loads(body)
    assert decoded["output_token_logprobs"][0][0] == float("-inf") and decoded["output_token_logprobs"][1] == [-0.5, 6]


def test_a_lone_surrogate_falls_back_to_json() -> None:
    """msgspec refuses to write one (it has no UTF-8 form); json escapes it, as the answer did before."""
    payload = {"echo": "a\ud800b"}
    response = json_response(payload, finite=True)
    assert response.body == json.dumps(payload).encode()
