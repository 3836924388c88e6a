"""Response shaping for n > 1 and stop strings (router pipeline respond, stream; psrl.apis.messages): usage as
vLLM counts it, one stream for interleaved choices (each opened, each ended when it finishes, its text equal to
the non-streamed one), vLLM's stop_reason, SGLang's matched stop, Anthropic's stop_sequence."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import openai
import pytest
from _sse import sse_events

from psrl import apis as A
from psrl.router.errors import WorkerStreamFailed
from psrl.router.pipeline import respond as R
from psrl.router.pipeline.context import Generation, SamplingSpec
from psrl.router.pipeline.execute import Delta
from psrl.router.pipeline.stops import StreamedText, output_text
from psrl.router.pipeline.stream import ChatChoice, CompletionChoice, sse_stream
from psrl.router.pipeline.tool_calls import NoToolParser
from psrl.tokenizer import Tokenizer, build_tiny_tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer.from_folder(build_tiny_tokenizer(Path(tmp_path_factory.mktemp("tok"))))


def test_usage_counts_the_prompt_once_and_every_choice() -> None:
    a = Generation(output_ids=[1, 2], prompt_tokens=7, cached_tokens=3)
    b = Generation(output_ids=[1, 2, 3], prompt_tokens=7, cached_tokens=3)
    assert R.usage([a, b]) == {
        "prompt_tokens": 7,
        "completion_tokens": 5,
        "total_tokens": 12,
        "prompt_tokens_details": {"cached_tokens": 3},
    }
    c = Generation(output_ids=[4], prompt_tokens=2)
    assert R.sum_usage([[a, b], [c]])["prompt_tokens"] == 9 and R.sum_usage([[a, b], [c]])["completion_tokens"] == 6


def test_stop_reasons() -> None:
    by_str = Generation(output_ids=[1], finish_reason="stop", matched_stop_str="</a>")
    by_id = Generation(output_ids=[1], finish_reason="stop", matched_stop_token_id=9)
    assert R.generate_finish_reason(by_str) == {"type": "stop", "matched": "</a>"}
    assert R.generate_finish_reason(by_id) == {"type": "stop", "matched": 9}
    assert R.completion_choice(0, "x", by_str, None)["stop_reason"] == "</a>"
    assert A.stop_reason_of("stop", "</a>") == "stop_sequence" and A.stop_reason_of("stop") == "end_turn"
    completion = {
        "id": "chatcmpl-1",
        "model": "m",
        "choices": [{"message": {"content": "hi"}, "finish_reason": "stop", "stop_reason": "</a>"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2},
    }
    message = A.chat_to_message(completion)
    assert message["stop_reason"] == "stop_sequence" and message["stop_sequence"] == "</a>"
    delta = json.loads(A.message_sse_events(message)[-2].split("data: ", 1)[1])
    assert delta["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "</a>"}
    completion["choices"][0]["stop_reason"] = 9  # a stop token id is no stop sequence
    assert A.chat_to_message(completion)["stop_reason"] == "end_turn"
    completion["choices"][0].update(finish_reason="tool_calls", stop_reason="</a>")
    called = A.chat_to_message(completion)  # the sequence is named only when it is why the turn ended
    assert called["stop_reason"] == "tool_use" and called["stop_sequence"] is None


class _Interleaved:
    """Two choices streaming their ids one token a delta, alternating; each ends after its last token."""

    def __init__(self, gens: list[Generation]) -> None:
        self.gens = gens

    async def deltas(self) -> AsyncIterator[Delta]:
        for step in range(max(len(g.output_ids) for g in self.gens)):
            for i, gen in enumerate(self.gens):
                if step < len(gen.output_ids):
                    yield Delta([gen.output_ids[step]], [-1.0], None, i)
                if step == len(gen.output_ids) - 1:
                    yield Delta([], None, None, i, gen)


async def test_a_chat_stream_of_two_choices_read_by_the_openai_client(tok: Tokenizer) -> None:
    sampling = SamplingSpec(stop=["</answer>"], n=2)
    gens = [
        Generation(
            output_ids=tok.encode("The answer: 4</answer> and on"),
            finish_reason="stop",
            matched_stop_str="</answer>",
            prompt_tokens=5,
        ),
        Generation(output_ids=tok.encode("Still thinking"), finish_reason="length", prompt_tokens=5),
    ]
    choices = [ChatChoice(i, StreamedText(tok, sampling), NoToolParser().stream(), tok, True) for i in range(2)]
    envelope = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    frames = [f async for f in sse_stream(_Interleaved(gens), choices, envelope=envelope, include_usage=True)]
    events = [json.loads(f[6:]) for f in sse_events(frames) if f != "data: [DONE]"]
    ends = [(c["index"], c["finish_reason"], c.get("stop_reason")) for e in events for c in e["choices"]]
    ends = [end for end in ends if end[1]]
    assert ends == [(1, "length", None), (0, "stop", "</answer>")]  # the shorter one ends first
    assert events[-1]["usage"]["completion_tokens"] == sum(len(g.output_ids) for g in gens)

    body = b"".join(frames)
    sse = {"content-type": "text/event-stream"}
    transport = httpx.MockTransport(lambda _: httpx.Response(200, content=body, headers=sse))
    client = openai.OpenAI(api_key="x", base_url="http://t/v1", http_client=httpx.Client(transport=transport))
    texts = {0: "", 1: ""}
    lps = {0: 0, 1: 0}
    for chunk in client.chat.completions.create(model="m", messages=[], stream=True):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            lps[c.index] += len(c.logprobs.content) if c.logprobs else 0
    assert texts == {i: output_text(tok, g, sampling) for i, g in enumerate(gens)}
    assert texts[0] == "The answer: 4"
    assert lps == {i: len(g.output_ids) for i, g in enumerate(gens)}  # every sampled token's, past the cut too


async def test_a_completion_stream_of_two_choices(tok: Tokenizer) -> None:
    sampling = SamplingSpec(stop=["."], include_stop_str_in_output=True, n=2)
    gens = [
        Generation(output_ids=tok.encode("One. Two"), finish_reason="stop", matched_stop_str="."),
        Generation(output_ids=tok.encode("Three"), finish_reason="length"),
    ]
    choices = [CompletionChoice(i, StreamedText(tok, sampling), tok) for i in range(2)]
    envelope = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m"}
    frames = sse_events([f async for f in sse_stream(_Interleaved(gens), choices, envelope=envelope)])
    texts = {0: "", 1: ""}
    for frame in frames[:-1]:
        for c in json.loads(frame[6:])["choices"]:
            texts[c["index"]] += c["text"]
    assert texts == {0: "One.", 1: "Three"}


async def test_stream_usage_comes_only_when_asked_and_per_choice_with_continuous_stats(tok: Tokenizer) -> None:
    """As vLLM streams it: no usage unless include_usage, then alone on a last `choices: []` event; with
    continuous_usage_stats each event also carries its own choice's usage so far."""
    gens = [
        Generation(output_ids=tok.encode("One two three"), finish_reason="length", prompt_tokens=5),
        Generation(output_ids=tok.encode("Four"), finish_reason="length", prompt_tokens=5),
    ]
    envelope = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m"}

    async def events(**usage: bool) -> list[dict]:
        choices = [
            ChatChoice(i, StreamedText(tok, SamplingSpec()), NoToolParser().stream(), tok, False) for i in (0, 1)
        ]
        frames = sse_events(
            [f async for f in sse_stream(_Interleaved(gens), choices, envelope=envelope, prompt_tokens=5, **usage)]
        )
        return [json.loads(f[6:]) for f in frames if f != "data: [DONE]"]

    assert all("usage" not in e for e in await events())
    asked = await events(include_usage=True)
    assert all("usage" not in e for e in asked[:-1]) and asked[-1]["choices"] == []
    assert asked[-1]["usage"]["completion_tokens"] == sum(len(g.output_ids) for g in gens)
    every = await events(include_usage=True, continuous_usage=True)
    for e in every[:-1]:
        [choice] = e["choices"]
        produced = e["usage"]["completion_tokens"]
        assert e["usage"]["prompt_tokens"] == 5 and e["usage"]["total_tokens"] == 5 + produced
        assert 0 <= produced <= len(gens[choice["index"]].output_ids)
        if choice["finish_reason"]:
            assert produced == len(gens[choice["index"]].output_ids)


async def test_a_stream_writes_once_per_delta(tok: Tokenizer) -> None:
    """The opening goes with the first token, each token in one write, the end (it comes after the last token)
    in one with the usage and [DONE]."""
    ids = tok.encode("one two three")
    gen = Generation(output_ids=ids, finish_reason="length", prompt_tokens=5)
    [choice] = [ChatChoice(0, StreamedText(tok, SamplingSpec()), NoToolParser().stream(), tok, False)]
    envelope = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    writes = [w async for w in sse_stream(_Interleaved([gen]), [choice], envelope=envelope, include_usage=True)]
    assert len(writes) == len(ids) + 1
    per_write = [[json.loads(e[6:]) if e != "data: [DONE]" else None for e in sse_events([w])] for w in writes]
    assert [c["choices"][0]["delta"] for c in per_write[0]] == [
        {"role": "assistant", "content": ""},
        {"content": tok.decode(ids[:1])},
    ]
    assert all(len(events) == 1 for events in per_write[1:-1])
    finish, usage, done = per_write[-1]
    assert finish["choices"][0]["finish_reason"] == "length" and usage["usage"]["completion_tokens"] == len(ids)
    assert done is None


async def test_a_failed_stream_ends_with_what_was_pending_the_error_and_done(tok: Tokenizer) -> None:
    """A choice's end waits for the next write; a failure after it still sends it, then the error, then [DONE]."""

    class _FailsAfterOneEnds:
        async def deltas(self) -> AsyncIterator[Delta]:
            yield Delta(tok.encode("Hi"), None, None, 0)
            yield Delta([], None, None, 0, Generation(output_ids=tok.encode("Hi"), finish_reason="stop"))
            raise WorkerStreamFailed("worker w1 closed the stream")

    choices = [ChatChoice(i, StreamedText(tok, SamplingSpec()), NoToolParser().stream(), tok, False) for i in (0, 1)]
    envelope = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    writes = [w async for w in sse_stream(_FailsAfterOneEnds(), choices, envelope=envelope, include_usage=True)]
    finish, error, done = sse_events(writes[-1:])
    assert json.loads(finish[6:])["choices"][0]["finish_reason"] == "stop"
    assert json.loads(error[6:])["error"]["message"] == "worker w1 closed the stream"
    assert done == "data: [DONE]" and len(writes) == 2
