"""Turn a model's generated text into OpenAI chat `tool_calls`, content and reasoning_content: the whole text
at once (`parse`), or as it streams (`StreamingHermesParser`).

The `hermes` format (Qwen2.5/Qwen3 use it too): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`
blocks, optionally after a leading `<think>...</think>` block. Pure: model output never makes it raise.

Text is kept as the model sampled it, as vLLM keeps it: a reply without calls is its content verbatim, leading
and trailing whitespace included, and reasoning is what the think block holds. Only the whitespace that joins
content to a call is dropped (the chat template writes that separator itself when the reply is sent back, so
the echoed reply renders to the sampled text), and content resuming after a call is joined with "\\n".
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from psrl.router.config import DEFAULT_TOOL_PARSER, TOOL_PARSER_NAMES
from psrl.router.pipeline.stops import partial_match_start

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
THINK_START = "<think>"
THINK_END = "</think>"
# One block per match: the body runs to the nearest end marker, or to the end of the text when the output
# was cut at max_tokens (then `end` is None and the block is not a call).
_TOOL_CALL_BLOCK = re.compile(r"<tool_call>(?P<body>.*?)(?:(?P<end></tool_call>)|\Z)", re.DOTALL)


@dataclass
class ParsedOutput:
    """What one generation becomes in an OpenAI assistant message."""

    content: str | None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    reasoning_content: str | None = None


class ToolCallParser(Protocol):
    def parse(self, text: str) -> ParsedOutput: ...

    def stream(self) -> ToolCallStream:
        """A parser for one streamed generation."""
        ...


class ToolCallStream(Protocol):
    def push(self, text: str) -> list[StreamPiece]: ...

    def finish(self, text: str = "") -> list[StreamPiece]: ...

    @property
    def in_content(self) -> bool:
        """Whether the text so far ends in content, not in reasoning or a call."""
        ...


def new_tool_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def split_reasoning(text: str) -> tuple[str | None, str]:
    """(reasoning, rest) for a text that opens with a complete `<think>...</think>` block; else (None, text).

    Whitespace before the block goes with it; the reasoning and the rest are verbatim, as vLLM's reasoning
    parsers leave them. An unterminated think block (cut at max_tokens) is left in the text, like an
    unterminated tool call.
    """
    body_start = len(text) - len(text.lstrip())
    if not text.startswith(THINK_START, body_start):
        return None, text
    body_start += len(THINK_START)
    end = text.find(THINK_END, body_start)
    if end < 0:
        return None, text
    return text[body_start:end] or None, text[end + len(THINK_END) :]


def _tool_call_from_json(body: str, new_id: Callable[[], str]) -> dict[str, Any] | None:
    """The OpenAI tool call a block's JSON describes, or None when it is not a well-formed call."""
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):  # RecursionError: absurdly deep nesting
        return None
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return None
    arguments = obj.get("arguments")
    if arguments is None:
        arguments_text = "{}"
    elif isinstance(arguments, str):
        arguments_text = arguments  # already JSON text: pass it through as the model wrote it
    else:
        arguments_text = json.dumps(arguments, ensure_ascii=False)
    return {"id": new_id(), "type": "function", "function": {"name": name, "arguments": arguments_text}}


def _join_content(pieces: list[str]) -> str | None:
    """The content around parsed calls (`pieces[i]` ends where call i starts): the first piece keeps its leading
    whitespace, and the whitespace next to a call goes (the template's separator)."""
    kept = [pieces[0].rstrip(), *(p.strip() for p in pieces[1:])]
    return "\n".join(p for p in kept if p) or None


class HermesToolParser:
    """`<tool_call>` JSON blocks -> tool_calls; everything else (bad or cut-off blocks included) -> content."""

    def __init__(self, id_factory: Callable[[], str] = new_tool_call_id) -> None:
        self._new_id = id_factory

    def parse(self, text: str) -> ParsedOutput:
        reasoning, rest = split_reasoning(text)
        if TOOL_CALL_START not in rest:
            return ParsedOutput(content=rest or None, reasoning_content=reasoning)
        calls: list[dict[str, Any]] = []
        pieces: list[str] = []
        kept_from = 0  # start of the text not yet consumed by a parsed call
        for match in _TOOL_CALL_BLOCK.finditer(rest):
            if match.group("end") is None:
                break  # cut off mid-call: it stays content
            call = _tool_call_from_json(match.group("body"), self._new_id)
            if call is None:
                continue  # malformed: the block stays content, verbatim
            pieces.append(rest[kept_from : match.start()])
            kept_from = match.end()
            calls.append(call)
        if not calls:  # blocks that are no calls stay content, and so the text is as sampled
            return ParsedOutput(content=rest or None, reasoning_content=reasoning)
        pieces.append(rest[kept_from:])
        return ParsedOutput(content=_join_content(pieces), tool_calls=calls, reasoning_content=reasoning)

    def stream(self) -> StreamingHermesParser:
        return StreamingHermesParser(self._new_id)


@dataclass(frozen=True)
class StreamPiece:
    """One thing a streamed generation adds to the assistant message: text for `content` or
    `reasoning_content`, or a whole tool call (OpenAI shape)."""

    kind: Literal["content", "reasoning", "tool_call"]
    text: str = ""
    call: dict[str, Any] | None = None


class StreamingHermesParser:
    """HermesToolParser for a stream: text goes in as it is decoded, pieces come out as soon as they are
    certain. Content and reasoning stream through as generated, holding back only what could be the start of a
    marker and, in content, trailing whitespace (sent once more content follows it or the generation ends
    without a call; dropped at a call, as the separator `parse` drops); a tool call comes out whole when its
    `</tool_call>` arrives (a malformed or cut-off block comes out as content, verbatim). Content that resumes
    after a call starts with the "\n" `parse` joins such content with, its leading whitespace dropped.

    So the pieces add up to what `parse` makes of the whole text, except for a `<think>` block that is never
    closed: all of it streams as reasoning, a `<tool_call>` in it included, as vLLM's streaming reasoning
    parsers do (`parse` keeps such a block in the content and parses calls in it). Text cannot be taken back
    once sent, and what a closed think block holds is reasoning whatever tags it contains.
    """

    def __init__(self, id_factory: Callable[[], str] = new_tool_call_id) -> None:
        self._new_id = id_factory
        self._buf = ""
        self._state: Literal["start", "reasoning", "content", "call"] = "start"
        self._strip = False  # drop whitespace before the next content (after a call: the separator)
        self._ws = ""  # trailing whitespace of the content sent so far, held until more content follows
        self._content_sent = False
        self._called = False  # a call was parsed: held whitespace at the end is a separator too
        self._after_call = False  # content resuming now follows a call: it starts with "\n"
        self._scanned = 0  # call state: how much of the buffer is known to hold no end marker

    def _text(self, kind: Literal["content", "reasoning"], text: str, out: list[StreamPiece]) -> None:
        if kind == "reasoning":
            if text:
                out.append(StreamPiece("reasoning", text))
            return
        if self._strip:
            text = text.lstrip()
            self._strip = not text
        body = text.rstrip()
        if not body:
            self._ws += text
            return
        lead = self._ws
        if self._after_call:
            lead, self._after_call = "\n", False
        out.append(StreamPiece(kind, lead + body))
        self._ws = text[len(body) :]
        self._content_sent = True

    def _until(self, kind: Literal["content", "reasoning"], markers: tuple[str, ...], out: list[StreamPiece]) -> bool:
        """Stream the buffer as `kind` up to the first of `markers`: True with the marker left at the buffer's
        start, or False with only what could begin a marker left."""
        found = [at for at in (self._buf.find(m) for m in markers) if at >= 0]
        cut = min(found) if found else min(partial_match_start(self._buf, m) for m in markers)
        self._text(kind, self._buf[:cut], out)
        self._buf = self._buf[cut:]
        return bool(found)

    @property
    def in_content(self) -> bool:
        return self._state in ("start", "content")  # "start": no think block has opened (yet)

    def push(self, text: str) -> list[StreamPiece]:
        out: list[StreamPiece] = []
        self._buf += text
        while self._buf:
            if self._state == "start":
                lead = self._buf.lstrip()
                if not lead or (len(lead) < len(THINK_START) and THINK_START.startswith(lead)):
                    break  # cannot tell yet whether a think block opens the output
                if lead.startswith(THINK_START):
                    self._buf, self._state = lead[len(THINK_START) :], "reasoning"
                else:
                    self._state = "content"
            elif self._state == "reasoning":
                if not self._until("reasoning", (THINK_END,), out):
                    break
                self._buf = self._buf[len(THINK_END) :]
                self._state = "content"
            elif self._state == "content":
                if not self._until("content", (TOOL_CALL_START,), out):
                    break
                self._state, self._scanned = "call", 0
            else:
                end = self._buf.find(TOOL_CALL_END, max(0, self._scanned - len(TOOL_CALL_END) + 1))
                if end < 0:
                    self._scanned = len(self._buf)
                    break
                block, self._buf = self._buf[: end + len(TOOL_CALL_END)], self._buf[end + len(TOOL_CALL_END) :]
                self._state = "content"
                call = _tool_call_from_json(block[len(TOOL_CALL_START) : end], self._new_id)
                if call is None:
                    self._text("content", block, out)
                else:
                    out.append(StreamPiece("tool_call", call=call))
                    self._ws, self._strip, self._after_call, self._called = "", True, self._content_sent, True
        return out

    def finish(self, text: str = "") -> list[StreamPiece]:
        """The pieces of the last text and of whatever was held back (a cut-off call is content)."""
        out = self.push(text)
        kind: Literal["content", "reasoning"] = "reasoning" if self._state == "reasoning" else "content"
        self._text(kind, self._buf, out)
        self._buf = ""
        if self._ws and not self._called:  # a reply without calls keeps its trailing whitespace
            out.append(StreamPiece("content", self._ws))
        self._ws = ""
        return out


class NoToolParser:
    """Tool parsing off: the whole generation is content, as generated."""

    def parse(self, text: str) -> ParsedOutput:
        return ParsedOutput(content=text or None)

    def stream(self) -> PlainStream:
        return PlainStream()


class PlainStream:
    """Every streamed text is content, as generated."""

    def push(self, text: str) -> list[StreamPiece]:
        return [StreamPiece("content", text)] if text else []

    def finish(self, text: str = "") -> list[StreamPiece]:
        return self.push(text)

    @property
    def in_content(self) -> bool:
        return True


_PARSERS: dict[str, Callable[[], ToolCallParser]] = {
    "hermes": HermesToolParser,
    "qwen": HermesToolParser,
    "none": NoToolParser,
}


def make_tool_parser(name: str | None) -> ToolCallParser:
    """The parser a config's tool_call_parser names (None means the default, "qwen")."""
    key = DEFAULT_TOOL_PARSER if name is None else name
    factory = _PARSERS.get(key)
    if factory is None:
        raise ValueError(f"unknown tool_call_parser {name!r}; known: {', '.join(TOOL_PARSER_NAMES)}")
    return factory()
