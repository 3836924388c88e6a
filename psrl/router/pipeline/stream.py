"""Stage 5 for streaming clients: turn a worker call's deltas into SSE events, whatever the API's spelling.

Chat and completions (`sse_stream`): each supplies one function that spells the choices of a delta (text delta,
token delta or None at the end, finish reason); the framing, the usage event, the error event and `[DONE]` are
shared. Responses and Messages (`api_stream`): the text is parsed into content, reasoning and tool calls as it
arrives, and an `ApiWriter` spells each piece as that API's events.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from psrl import apis as A
from psrl.router.errors import RouterError
from psrl.router.pipeline import respond as R
from psrl.router.pipeline.context import Generation
from psrl.router.pipeline.execute import Delta
from psrl.router.pipeline.tool_calls import StreamPiece, ToolCallStream
from psrl.tokenizer import IncrementalDecoder

logger = logging.getLogger(__name__)

# (new text, the token delta or None for the closing event, finish reason or None) -> the choices to send (the
# closing call returns at least the one with the finish reason)
ChoiceFn = Callable[[str, Delta | None, str | None], list[dict[str, Any]]]


class DeltaSource(Protocol):
    """A started generation: its token deltas (which clean up after themselves) and, after them, the result."""

    def deltas(self) -> AsyncIterator[Delta]: ...

    @property
    def result(self) -> Generation: ...


async def sse_stream(
    source: DeltaSource,
    decoder: IncrementalDecoder,
    *,
    envelope: dict[str, Any],
    choice: ChoiceFn,
    opening: dict[str, Any] | None = None,
    include_usage: bool = False,
) -> AsyncIterator[bytes]:
    def event(ch: dict[str, Any]) -> bytes:
        return R.sse({**envelope, "choices": [ch]})

    try:
        if opening is not None:
            yield event(opening)
        async for d in source.deltas():
            for ch in choice(decoder.push(d.token_ids), d, None):
                yield event(ch)
        result = source.result
        for ch in choice(decoder.flush(), None, result.finish_reason):
            yield event(ch)
        if include_usage:
            yield R.sse({**envelope, "choices": [], "usage": R.usage(result)})
    except RouterError as e:  # headers are sent: the error travels as an SSE event
        logger.warning("stream %s failed: %s", envelope.get("id"), e.message)
        yield R.sse(e.body())
    yield R.SSE_DONE


@dataclass(frozen=True)
class StreamStart:
    """What an API's stream opens with."""

    body: dict[str, Any]  # the API's request body
    request_id: str
    created: int
    model: str
    prompt_tokens: int


class ApiWriter(Protocol):
    """One API's events for a streamed chat generation (frames, each a complete SSE event)."""

    def start(self) -> list[str]: ...

    def content(self, text: str, logprobs: list[dict[str, Any]] | None) -> list[str]: ...

    def reasoning(self, text: str) -> list[str]: ...

    def tool_call(self, call: dict[str, Any]) -> list[str]: ...

    def trailing_logprobs(self, logprobs: list[dict[str, Any]]) -> list[str]:
        """Log-probs of the last tokens, which added no text (e.g. the end-of-turn token)."""
        ...

    def finish(self, finish_reason: str | None, usage: dict[str, Any]) -> list[str]: ...

    def error(self, e: RouterError) -> list[str]: ...


async def api_stream(
    source: DeltaSource,
    decoder: IncrementalDecoder,
    parser: ToolCallStream,
    writer: ApiWriter,
    logprobs: Callable[[Delta], list[dict[str, Any]] | None],
    request_id: str,
) -> AsyncIterator[bytes]:
    """`writer`'s events for a started generation. `logprobs` spells a delta's log-probs (None when not asked
    for). With log-probs the tokens go through the parser one at a time: a token that starts, is in or ends
    reasoning or a call loses its log-prob (those carry none), the others' go with the next content piece, and
    those left at the end (tokens with no text: the end of turn) go to `writer.trailing_logprobs`."""
    pending: list[dict[str, Any]] = []  # log-probs of content tokens not yet sent with a piece
    asked = False  # whether log-probs were asked for (the source's deltas carry them)
    calls = 0

    def token_frames(d: Delta, lps: list[dict[str, Any]]) -> list[str]:
        frames: list[str] = []
        for token_id, lp in zip(d.token_ids, lps, strict=True):
            was_content = parser.in_content
            pieces = parser.push(decoder.push([token_id]))
            if was_content and parser.in_content and not any(p.kind != "content" for p in pieces):
                pending.append(lp)
            frames += frames_of(pieces)
        return frames

    def frames_of(pieces: list[StreamPiece]) -> list[str]:
        nonlocal pending, calls
        frames: list[str] = []
        for p in pieces:
            if p.kind == "content":
                frames += writer.content(p.text, pending if asked else None)
                pending = []
            elif p.kind == "reasoning":
                frames += writer.reasoning(p.text)
            elif p.call is not None:
                frames += writer.tool_call(p.call)
                calls += 1
        return frames

    try:
        for frame in writer.start():
            yield frame.encode()
        async for d in source.deltas():
            lps = logprobs(d)
            asked = asked or lps is not None
            frames = frames_of(parser.push(decoder.push(d.token_ids))) if lps is None else token_frames(d, lps)
            for frame in frames:
                yield frame.encode()
        for frame in frames_of(parser.finish(decoder.flush())):
            yield frame.encode()
        for frame in writer.trailing_logprobs(pending) if pending else []:
            yield frame.encode()
        result = source.result
        for frame in writer.finish(R.chat_finish_reason(calls > 0, result.finish_reason), R.usage(result)):
            yield frame.encode()
    except RouterError as e:  # headers are sent: the error travels as the API's error event
        logger.warning("stream %s failed: %s", request_id, e.message)
        for frame in writer.error(e):
            yield frame.encode()


class ResponsesWriter:
    """`/v1/responses` events (psrl.apis.ResponseStream) as an ApiWriter."""

    def __init__(self, start: StreamStart) -> None:
        response_id = A.response_id_of(start.request_id)
        self.stream = A.ResponseStream(
            A.response_base(start.body, response_id=response_id, created=start.created, model=start.model)
        )

    def start(self) -> list[str]:
        return self.stream.start()

    def content(self, text: str, logprobs: list[dict[str, Any]] | None) -> list[str]:
        return self.stream.text(text, logprobs)

    def reasoning(self, text: str) -> list[str]:
        return self.stream.reasoning(text)

    def tool_call(self, call: dict[str, Any]) -> list[str]:
        return self.stream.function_call(call["id"], call["function"]["name"], call["function"]["arguments"])

    def trailing_logprobs(self, logprobs: list[dict[str, Any]]) -> list[str]:
        return self.stream.logprobs(logprobs)

    def finish(self, finish_reason: str | None, usage: dict[str, Any]) -> list[str]:
        return self.stream.finish(A.response_outcome(finish_reason, usage))

    def error(self, e: RouterError) -> list[str]:
        return self.stream.error(e.message, e.code, e.param)


class MessagesWriter:
    """`/v1/messages` events (psrl.apis.MessageStream) as an ApiWriter."""

    def __init__(self, start: StreamStart) -> None:
        message_id = A.message_id_of(start.request_id)
        self.stream = A.MessageStream(
            A.message_base(message_id=message_id, model=start.model, input_tokens=start.prompt_tokens)
        )

    def start(self) -> list[str]:
        return self.stream.start()

    def content(self, text: str, logprobs: list[dict[str, Any]] | None) -> list[str]:
        return self.stream.text(text)  # Messages has no log-probs

    def reasoning(self, text: str) -> list[str]:
        return self.stream.thinking(text)

    def tool_call(self, call: dict[str, Any]) -> list[str]:
        function = call["function"]
        return self.stream.tool_use(call["id"], function["name"], A.tool_input_of(function["arguments"]))

    def trailing_logprobs(self, logprobs: list[dict[str, Any]]) -> list[str]:
        return []  # Messages has no log-probs

    def finish(self, finish_reason: str | None, usage: dict[str, Any]) -> list[str]:
        return self.stream.finish(A.stop_reason_of(finish_reason), A.message_usage(usage))

    def error(self, e: RouterError) -> list[str]:
        return self.stream.error(e.message, e.status)
