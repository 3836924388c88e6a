"""The router's JSON answers and SSE events (psrl.router.web.encode_json): msgspec writes those the caller
knows hold only finite floats; json the rest, so a -inf logprob stays `-Infinity` (as vLLM's server writes it),
never null."""

from __future__ import annotations

import json
from types import SimpleNamespace

from psrl.router.pipeline import parse as P
from psrl.router.pipeline.context import Generation, GenerationInput
from psrl.router.pipeline.respond import SseChunks
from psrl.router.pipeline.runner import RequestContext
from psrl.router.pipeline.stages import respond_generate
from psrl.router.registry import InstanceId
from psrl.router.web import json_response
from psrl.serving.http1 import Response

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
    assert response.body == json.dumps(payload, separators=(",", ":")).encode()


def _generate_answer(return_logprob: bool) -> bytes:
    """respond_generate's body for one generation whose first token's log-prob is -inf."""
    body = {"input_ids": [1, 2], "return_logprob": return_logprob, "sampling_params": {"detokenize": False}}
    req = P.parse_generate(body)
    ctx = RequestContext(http=None, route="/generate", generate=req)  # type: ignore[arg-type]
    ctx.inputs = [GenerationInput("gen-1", [1, 2], req.sampling)]
    gen = Generation(output_ids=[5, 6], logprobs=[float("-inf"), -0.5], finish_reason="length", prompt_tokens=2)
    ticket = SimpleNamespace(instance=SimpleNamespace(id=InstanceId("w1", 0)), pinned_version=3)
    ctx.rollouts = [SimpleNamespace(ticket=ticket, states=[SimpleNamespace(weight_version=3, token_versions=[3, 3])])]  # type: ignore[list-item]
    ctx.results = [[gen]]
    respond_generate(None, ctx)  # type: ignore[arg-type]
    assert isinstance(ctx.response, Response) and ctx.response.headers == {
        "x-base-worker-id": "w1",
        "x-target-dp-rank": "0",
        "x-version-tag": "3",
    }
    return ctx.response.body


def test_generate_answers_keep_a_minus_infinity_logprob() -> None:
    """/generate asked for logprobs goes to json, which spells -inf; without them, msgspec writes the answer."""
    with_logprobs = _generate_answer(True)
    assert b"[-Infinity,5]" in with_logprobs.replace(b" ", b"")
    assert json.loads(with_logprobs)["meta_info"]["output_token_logprobs"] == [[float("-inf"), 5], [-0.5, 6]]
    without = _generate_answer(False)
    assert b'"output_ids":[5,6]' in without  # msgspec's compact form
    assert "output_token_logprobs" not in json.loads(without)["meta_info"]


def test_stream_chunks_keep_a_minus_infinity_logprob() -> None:
    """A chunk with log-probs goes to json (-Infinity); one without to msgspec (UTF-8), or to json when msgspec
    cannot write it; the envelope is the same around each."""
    chunks = SseChunks({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m"})
    scored = {
        "index": 0,
        "delta": {"content": "a"},
        "logprobs": {"content": [{"token": "a", "logprob": float("-inf")}]},
    }
    line = chunks.event(scored)
    assert b'"logprob":-Infinity' in line and line.endswith(b"]}\n\n")
    assert json.loads(line[len(b"data: ") :])["choices"][0]["logprobs"]["content"][0]["logprob"] == float("-inf")
    for content in ("caf\u00e9", "a\ud800b"):  # the second only json can write
        plain = {"index": 0, "delta": {"content": content}, "logprobs": None, "finish_reason": None}
        line = chunks.event(plain, {"prompt_tokens": 1})
        assert line.startswith(b'data: {"id":"chatcmpl-1",') and line.endswith(b"\n\n")
        assert json.loads(line[len(b"data: ") :]) == {
            "id": "chatcmpl-1",
            "object": "chat.completion.chunk",
            "created": 1,
            "model": "m",
            "choices": [plain],
            "usage": {"prompt_tokens": 1},
        }
    assert "caf\u00e9".encode() in chunks.event({"delta": {"content": "caf\u00e9"}, "logprobs": None})
