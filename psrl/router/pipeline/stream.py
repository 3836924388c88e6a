"""The respond stage for streaming clients: turn a generation's deltas into SSE events, whatever the API's spelling.

Chat and completions (`sse_stream`): one ChoiceWriter per choice spells its chunks (the opening, each delta,
its end); deltas of n > 1 choices interleave, each choice's end comes when it finishes; the framing, the usage
event, the error event and `[DONE]` are shared. Responses and Messages (`api_stream`, one choice): the text is
parsed into content, reasoning and tool calls as it arrives, and an `ApiWriter` spells each piece as that API's
events. A choice's text is a StreamedText: held back while it could still become a stop string.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from psrl import apis as A
from psrl.router.errors import RouterError
from psrl.router.pipeline import respond as R
from psrl.router.pipeline.context import Generation
from psrl.router.pipeline.execute import Delta
from psrl.router.pipeline.parse import ChatRequest, CompletionRequest
from psrl.router.pipeline.stops import StreamedText
from psrl.router.pipeline.tool_calls import StreamPiece, ToolCallParser, ToolCallStream
from psrl.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


class DeltaSource(Protocol):
    """A started generation: its token deltas, then each choice's end (a Delta with `finished`); the iterator
    cleans up after itself."""

    def deltas(self) -> AsyncIterator[Delta]: ...


class ChoiceWriter(Protocol):
    """One choice's chunks (each the `choices` entry of one SSE event)."""

    def opening(self) -> list[dict[str, Any]]: ...

    def delta(self, d: Delta) -> list[dict[str, Any]]: ...

    def finish(self, gen: Generation) -> list[dict[str, Any]]:
        """The last chunks, at least the one with the finish reason."""
        ...


async def sse_stream(
    source: DeltaSource,
    choices: Sequence[ChoiceWriter],
    *,
    envelope: dict[str, Any],
    include_usage: bool = False,
    continuous_usage: bool = False,
    prompt_tokens: int = 0,
) -> AsyncIterator[bytes]:
    """The SSE events of a started generation, then `[DONE]`. As OpenAI and vLLM send them: the usage comes
    only with `include_usage`, as a last event of its own with `choices: []`; with `continuous_usage` (vLLM's
    `continuous_usage_stats`) every event also carries its choice's usage so far (`prompt_tokens`: the
    prompt's length).

    What one delta makes goes out as one write: the opening with the first token's events (as vLLM sends its
    first chunk with the first output), a choice's end with the next delta's events, or with the usage and
    `[DONE]` at the end (each write costs the router a system call and the client a read)."""
    chunks = R.SseChunks(envelope)
    generated = [0] * len(choices)  # tokens each choice has produced so far

    def event(index: int, ch: dict[str, Any]) -> bytes:
        if not continuous_usage:
            return chunks.event(ch)
        completion = generated[index]
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion,
        }
        return chunks.event(ch, usage)

    out = [event(i, ch) for i, writer in enumerate(choices) for ch in writer.opening()]  # not yet sent
    try:
        finished: dict[int, Generation] = {}  # by choice index: usage reads choice 0, as the non-streamed answer
        async for d in source.deltas():
            writer = choices[d.index]
            if d.finished is None:
                generated[d.index] += len(d.token_ids)
                out += [event(d.index, ch) for ch in writer.delta(d)]
                if out:
                    yield b"".join(out)
                    out = []
            else:
                finished[d.index] = d.finished
                generated[d.index] = d.finished.completion_tokens
                out += [event(d.index, ch) for ch in writer.finish(d.finished)]
        if include_usage:
            out.append(chunks.event(None, R.usage([finished[i] for i in sorted(finished)])))
    except RouterError as e:  # headers are sent: the error travels as an SSE event
        logger.warning("stream %s failed: %s", envelope.get("id"), e.message)
        out.append(R.sse(e.body()))
    out.append(R.SSE_DONE)
    yield b"".join(out)


class ChatChoice:
    """A streamed chat choice: content, reasoning and tool-call deltas as the parser finds them; with `logprobs`
    every sampled token's log-prob, also of text held back or parsed into a call."""

    def __init__(
        self,
        index: int,
        text: StreamedText,
        parser: ToolCallStream,
        tok: Tokenizer,
        logprobs: bool,
        named_tool: bool = False,
    ) -> None:
        self._index = index
        self._text = text
        self._parser = parser
        self._tok = tok
        self._logprobs = logprobs
        self._named_tool = named_tool  # the request named the tool to call: its finish_reason stays "stop"
        self._calls = 0

    def _chunk(self, delta: dict[str, Any]) -> dict[str, Any]:
        return {"index": self._index, "delta": delta, "logprobs": None, "finish_reason": None}

    def opening(self) -> list[dict[str, Any]]:
        return [self._chunk({"role": "assistant", "content": ""})]

    def _pieces(self, pieces: list[StreamPiece]) -> list[dict[str, Any]]:
        choices = []
        for piece in pieces:
            choices.append(self._chunk(R.chat_stream_delta(piece, self._calls)))
            self._calls += piece.kind == "tool_call"
        return choices

    def delta(self, d: Delta) -> list[dict[str, Any]]:
        choices = self._pieces(self._parser.push(self._text.push(d.token_ids)))
        lps = R.chat_logprobs(self._tok, d.token_ids, d.logprobs, d.top_logprobs) if self._logprobs else None
        if lps is not None:
            if not choices:
                choices.append(self._chunk({"content": ""}))
            choices[0]["logprobs"] = lps
        return choices

    def finish(self, gen: Generation) -> list[dict[str, Any]]:
        choices = self._pieces(self._parser.finish(self._text.finish(gen)))
        closing = self._chunk({})
        closing["finish_reason"] = R.chat_finish_reason(self._calls > 0, gen.finish_reason, self._named_tool)
        closing["stop_reason"] = gen.stop_reason
        return [*choices, closing]


class CompletionChoice:
    """A streamed completion choice: text deltas, with their tokens' log-probs when asked for."""

    def __init__(self, index: int, text: StreamedText, tok: Tokenizer) -> None:
        self._index = index
        self._text = text
        self._tok = tok

    def opening(self) -> list[dict[str, Any]]:
        return []

    def delta(self, d: Delta) -> list[dict[str, Any]]:
        text = self._text.push(d.token_ids)
        lps = R.completion_logprobs(self._tok, d.token_ids, d.logprobs, d.top_logprobs)
        if not text and lps is None:
            return []
        return [{"index": self._index, "text": text, "logprobs": lps, "finish_reason": None}]

    def finish(self, gen: Generation) -> list[dict[str, Any]]:
        return [R.completion_choice(self._index, self._text.finish(gen), gen, None)]


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

    def finish(self, finish_reason: str | None, usage: dict[str, Any], stop_sequence: str | None) -> list[str]:
        """The end (`stop_sequence`: the stop string the generation stopped at)."""
        ...

    def error(self, e: RouterError) -> list[str]: ...


async def api_stream(
    source: DeltaSource,
    text: StreamedText,
    parser: ToolCallStream,
    writer: ApiWriter,
    logprobs: Callable[[Delta], list[dict[str, Any]] | None],
    request_id: str,
) -> AsyncIterator[bytes]:
    """`writer`'s events for a started one-choice generation. `logprobs` spells a delta's log-probs (None when
    not asked for). With log-probs the tokens go through the parser one at a time: a token that starts, is in
    or ends reasoning or a call loses its log-prob (those carry none), the others' go with the next content
    piece, and those left at the end (tokens with no text: the end of turn) go to `writer.trailing_logprobs`."""
    pending: list[dict[str, Any]] = []  # log-probs of content tokens not yet sent with a piece
    asked = False  # whether log-probs were asked for (the source's deltas carry them)
    calls = 0

    def token_frames(d: Delta, lps: list[dict[str, Any]]) -> list[str]:
        frames: list[str] = []
        for token_id, lp in zip(d.token_ids, lps, strict=True):
            was_content = parser.in_content
            pieces = parser.push(text.push([token_id]))
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
        yield "".join(writer.start()).encode()
        result: Generation | None = None
        async for d in source.deltas():
            if d.finished is not None:
                result = d.finished
                continue
            lps = logprobs(d)
            asked = asked or lps is not None
            frames = frames_of(parser.push(text.push(d.token_ids))) if lps is None else token_frames(d, lps)
            if frames:
                yield "".join(frames).encode()  # one write per delta, as sse_stream
        assert result is not None, "a generation ends with its choice's end"
        frames = frames_of(parser.finish(text.finish(result)))
        frames += writer.trailing_logprobs(pending) if pending else []
        frames += writer.finish(
            R.chat_finish_reason(calls > 0, result.finish_reason), R.usage([result]), result.matched_stop_str
        )
        yield "".join(frames).encode()
    except RouterError as e:  # headers are sent: the error travels as the API's error event
        logger.warning("stream %s failed: %s", request_id, e.message)
        yield "".join(writer.error(e)).encode()


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

    def finish(self, finish_reason: str | None, usage: dict[str, Any], stop_sequence: str | None) -> list[str]:
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

    def finish(self, finish_reason: str | None, usage: dict[str, Any], stop_sequence: str | None) -> list[str]:
        stop_reason = A.stop_reason_of(finish_reason, stop_sequence)
        return self.stream.finish(stop_reason, A.message_usage(usage), stop_sequence)

    def error(self, e: RouterError) -> list[str]:
        return self.stream.error(e.message, e.status)


# ---- each streaming API's events, from a started generation ------------------------------------------------


def chat_events(
    source: DeltaSource,
    tok: Tokenizer,
    chat: ChatRequest,
    parser: ToolCallParser,
    *,
    request_id: str,
    created: int,
    model: str,
    prompt_tokens: int,
) -> AsyncIterator[bytes]:
    """`/v1/chat/completions` chunks, one ChatChoice per choice."""
    choices = [
        ChatChoice(i, StreamedText(tok, chat.sampling), parser.stream(), tok, chat.logprobs, chat.tool_choice.named)
        for i in range(chat.sampling.n)
    ]
    envelope = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model}
    return sse_stream(
        source,
        choices,
        envelope=envelope,
        include_usage=chat.include_usage,
        continuous_usage=chat.continuous_usage,
        prompt_tokens=prompt_tokens,
    )


def completion_events(
    source: DeltaSource,
    tok: Tokenizer,
    req: CompletionRequest,
    *,
    request_id: str,
    created: int,
    model: str,
    prompt_tokens: int,
) -> AsyncIterator[bytes]:
    """`/v1/completions` chunks, one CompletionChoice per choice."""
    choices = [CompletionChoice(i, StreamedText(tok, req.sampling), tok) for i in range(req.sampling.n)]
    envelope = {"id": request_id, "object": "text_completion", "created": created, "model": model}
    return sse_stream(
        source,
        choices,
        envelope=envelope,
        include_usage=req.include_usage,
        continuous_usage=req.continuous_usage,
        prompt_tokens=prompt_tokens,
    )


def converted_events(
    source: DeltaSource,
    tok: Tokenizer,
    chat: ChatRequest,
    parser: ToolCallParser,
    writer: ApiWriter,
    request_id: str,
) -> AsyncIterator[bytes]:
    """A chat generation streamed as another API's events (`/v1/responses`, `/v1/messages`), spelt by `writer`."""
    asked = chat.logprobs

    def logprobs(d: Delta) -> list[dict[str, Any]] | None:
        chat_lps = R.chat_logprobs(tok, d.token_ids, d.logprobs, d.top_logprobs) if asked else None
        return None if chat_lps is None else chat_lps["content"]  # the Responses entries have this shape

    return api_stream(source, StreamedText(tok, chat.sampling), parser.stream(), writer, logprobs, request_id)
