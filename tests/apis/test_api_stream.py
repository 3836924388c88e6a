"""Streamed `/v1/responses` and `/v1/messages` (router pipeline, api_stream): text and tool calls written as the
API's events while the generation streams, read back by the official clients' stream parsers; a failure after
the first event ends the stream with the API's error event."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import anthropic
import httpx
import httpx2
import openai
import pytest
from _sse import sse_events

from psrl.router.errors import RouterError, WorkerStreamFailed
from psrl.router.pipeline.context import Generation, SamplingSpec
from psrl.router.pipeline.execute import Delta
from psrl.router.pipeline.stops import StreamedText
from psrl.router.pipeline.stream import ApiWriter, MessagesWriter, ResponsesWriter, StreamStart, api_stream
from psrl.router.pipeline.tool_calls import HermesToolParser
from psrl.tokenizer import Tokenizer, build_tiny_tokenizer

TEXT = 'Let me look.<tool_call>\n{"name": "lookup", "arguments": {"q": "hé"}}\n</tool_call>'
START = StreamStart({"input": "hi"}, "chatcmpl-1", 1, "tiny", 9)


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer.from_folder(build_tiny_tokenizer(Path(tmp_path_factory.mktemp("tok"))))


class _Source:
    """A generation that streams `ids` one token a delta, then ends (or fails with `error`)."""

    def __init__(self, ids: list[int], error: RouterError | None = None) -> None:
        self.ids, self.error = ids, error
        self.result = Generation(output_ids=ids, finish_reason="stop", prompt_tokens=9, cached_tokens=2)

    async def deltas(self) -> AsyncIterator[Delta]:
        for i, t in enumerate(self.ids):
            if self.error is not None and i == len(self.ids) // 2:
                raise self.error
            yield Delta([t], [-0.25], None)
        yield Delta([], None, None, finished=self.result)


async def _frames(tok: Tokenizer, writer: ApiWriter, source: _Source) -> list[str]:
    logprobs = [{"token": "t", "logprob": -0.25, "bytes": None, "top_logprobs": []}]
    parser = HermesToolParser().stream()
    events = api_stream(source, StreamedText(tok, SamplingSpec()), parser, writer, lambda d: logprobs, "chatcmpl-1")
    return sse_events([frame async for frame in events])


def _payloads(frames: list[str], kind: str) -> list[dict]:
    return [json.loads(f.split("data: ", 1)[1]) for f in frames if f.startswith(f"event: {kind}\n")]


def _transport(frames: list[str], http: type) -> object:
    body = "".join(f + "\n\n" for f in frames).encode()
    return http.MockTransport(lambda _: http.Response(200, content=body, headers={"content-type": "text/event-stream"}))


async def test_responses_stream_text_then_the_call(tok: Tokenizer) -> None:
    ids = tok.encode(TEXT)
    frames = await _frames(tok, ResponsesWriter(START), _Source(ids))
    text_deltas = _payloads(frames, "response.output_text.delta")
    assert len(text_deltas) > 1 and "".join(d["delta"] for d in text_deltas) == "Let me look."
    # Each text delta carries the log-probs of the tokens since the previous one; the call's tokens carry none.
    assert sum(len(d["logprobs"]) for d in text_deltas) == len(tok.encode("Let me look."))
    client = openai.OpenAI(
        api_key="x", base_url="http://t/v1", http_client=httpx.Client(transport=_transport(frames, httpx))
    )
    with client.responses.stream(model="tiny", input="hi") as stream:
        final = stream.get_final_response()
    assert final.output_text == "Let me look." and final.status == "completed" and final.id == "resp-1"
    assert final.output[1].type == "function_call" and json.loads(final.output[1].arguments) == {"q": "hé"}
    assert final.usage.input_tokens == 9 and final.usage.output_tokens == len(ids)


async def test_the_end_of_turn_tokens_log_prob_stays_on_the_text(tok: Tokenizer) -> None:
    ids = [*tok.encode("Hello there"), tok.eos_token_ids[0]]  # the end-of-turn token decodes to no text
    frames = await _frames(tok, ResponsesWriter(START), _Source(ids))
    [done] = _payloads(frames, "response.output_text.done")
    assert done["text"] == "Hello there" and len(done["logprobs"]) == len(ids)


@pytest.mark.parametrize("per_delta", [1, 3, 1000])
async def test_text_log_probs_are_the_text_tokens_however_the_deltas_group_them(tok: Tokenizer, per_delta: int) -> None:
    """Reasoning and call tokens carry none; each content token's log-prob (whitespace dropped at a seam
    included) goes with the text, in order, also when a delta holds the end of a call and the next text. The
    text is as sampled, the newlines after the think block included (as vLLM keeps them)."""
    parts = ["<think>\nhm\n</think>\n\n", "Answer.", '<tool_call>{"name": "a"}</tool_call>', "\nBye."]
    ids_of = [tok.encode(p) for p in parts]
    ids = [t for p in ids_of for t in p]
    after_think = ids_of[0][ids_of[0].index(tok.encode("</think>")[0]) + 1 :]  # "\n\n": content, no text
    text_ids = [*after_think, *ids_of[1], *ids_of[3]]

    class Grouped(_Source):
        async def deltas(self) -> AsyncIterator[Delta]:
            for i in range(0, len(self.ids), per_delta):
                chunk = self.ids[i : i + per_delta]
                yield Delta(chunk, [-float(t) for t in chunk], None)
            yield Delta([], None, None, finished=self.result)

    def logprobs(d: Delta) -> list[dict]:
        return [
            {"token": str(t), "logprob": lp, "bytes": None, "top_logprobs": []}
            for t, lp in zip(d.token_ids, d.logprobs)
        ]

    parser = HermesToolParser().stream()
    text = StreamedText(tok, SamplingSpec())
    events = api_stream(Grouped(ids), text, parser, ResponsesWriter(START), logprobs, "r")
    frames = sse_events([f async for f in events])
    texts = _payloads(frames, "response.output_text.done")
    assert [t["text"] for t in texts] == ["\n\nAnswer.", "\nBye."]
    assert [int(lp["token"]) for t in texts for lp in t["logprobs"]] == text_ids


async def test_messages_stream_text_then_the_call(tok: Tokenizer) -> None:
    ids = tok.encode(TEXT)
    frames = await _frames(tok, MessagesWriter(START), _Source(ids))
    client = anthropic.Anthropic(
        api_key="x", base_url="http://t", http_client=httpx2.Client(transport=_transport(frames, httpx2))
    )
    with client.messages.stream(model="tiny", max_tokens=5, messages=[{"role": "user", "content": "hi"}]) as stream:
        text = list(stream.text_stream)
        final = stream.get_final_message()
    assert len(text) > 1 and "".join(text) == "Let me look."
    assert [b.type for b in final.content] == ["text", "tool_use"] and final.content[1].input == {"q": "hé"}
    assert final.stop_reason == "tool_use" and final.usage.output_tokens == len(ids)
    # The prompt's cached tokens are known only at the end: message_delta carries the final usage (Anthropic
    # counts cache reads apart: 9 prompt tokens, 2 of them cached).
    assert final.usage.input_tokens == 7 and final.usage.cache_read_input_tokens == 2


async def test_a_failure_mid_stream_ends_with_the_apis_error_event(tok: Tokenizer) -> None:
    ids = tok.encode(TEXT)
    error = WorkerStreamFailed("the replica went away")
    frames = await _frames(tok, ResponsesWriter(START), _Source(ids, error))
    error_event, failed = (json.loads(f.split("data: ", 1)[1]) for f in frames[-2:])
    assert error_event["type"] == "error" and error_event["code"] == "stream_drain_failed"
    assert failed["type"] == "response.failed" and failed["response"]["status"] == "failed"
    assert "went away" in failed["response"]["error"]["message"]
    assert not _payloads(frames, "response.completed")
    frames = await _frames(tok, MessagesWriter(START), _Source(ids, error))
    assert json.loads(frames[-1].split("data: ", 1)[1]) == {
        "type": "error",
        "error": {"type": "api_error", "message": "the replica went away"},
    }


async def test_reasoning_streams_as_a_reasoning_item_before_the_message(tok: Tokenizer) -> None:
    ids = tok.encode("<think>\nweigh it\n</think>\n\nAnswer.")
    frames = await _frames(tok, ResponsesWriter(START), _Source(ids))
    kinds = [f.split("\n", 1)[0].removeprefix("event: ") for f in frames]
    reasoning = kinds[kinds.index("response.output_item.added") : kinds.index("response.output_item.done") + 1]
    assert reasoning[:2] == ["response.output_item.added", "response.content_part.added"]
    assert reasoning[-3:] == ["response.reasoning_text.done", "response.content_part.done", "response.output_item.done"]
    assert "".join(d["delta"] for d in _payloads(frames, "response.reasoning_text.delta")) == "\nweigh it\n"
    client = openai.OpenAI(
        api_key="x", base_url="http://t/v1", http_client=httpx.Client(transport=_transport(frames, httpx))
    )
    with client.responses.stream(model="tiny", input="hi") as stream:
        final = stream.get_final_response()
    assert [o.type for o in final.output] == ["reasoning", "message"] and final.output_text == "\n\nAnswer."
    assert final.output[0].content[0].text == "\nweigh it\n"
