"""Turn a model's generated text into OpenAI chat `tool_calls`, content and reasoning_content.

The `hermes` format (Qwen2.5/Qwen3 use it too): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`
blocks, optionally after a leading `<think>...</think>` block. Pure: model output never makes it raise.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
THINK_START = "<think>"
THINK_END = "</think>"
# COMPAT: a null tool_call_parser in the config means the Qwen/hermes format.
DEFAULT_TOOL_PARSER = "qwen"

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


def new_tool_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def split_reasoning(text: str) -> tuple[str | None, str]:
    """(reasoning, rest) for a text that opens with a complete `<think>...</think>` block; else (None, text).

    An unterminated think block (cut at max_tokens) is left in the text, like an unterminated tool call.
    """
    body_start = len(text) - len(text.lstrip())
    if not text.startswith(THINK_START, body_start):
        return None, text
    body_start += len(THINK_START)
    end = text.find(THINK_END, body_start)
    if end < 0:
        return None, text
    return text[body_start:end].strip() or None, text[end + len(THINK_END) :]


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
    kept = [p.strip() for p in pieces]
    return "\n".join(p for p in kept if p) or None


class HermesToolParser:
    """`<tool_call>` JSON blocks -> tool_calls; everything else (bad or cut-off blocks included) -> content."""

    def __init__(self, id_factory: Callable[[], str] = new_tool_call_id) -> None:
        self._new_id = id_factory

    def parse(self, text: str) -> ParsedOutput:
        reasoning, rest = split_reasoning(text)
        if TOOL_CALL_START not in rest:
            return ParsedOutput(content=rest.strip() or None, reasoning_content=reasoning)
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
        pieces.append(rest[kept_from:])
        return ParsedOutput(content=_join_content(pieces), tool_calls=calls, reasoning_content=reasoning)


class NoToolParser:
    """Tool parsing off: the whole generation is content, as generated."""

    def parse(self, text: str) -> ParsedOutput:
        return ParsedOutput(content=text or None)


_PARSERS: dict[str, Callable[[], ToolCallParser]] = {
    "hermes": HermesToolParser,
    "qwen": HermesToolParser,
    "none": NoToolParser,
}
TOOL_PARSER_NAMES = tuple(sorted(_PARSERS))


def make_tool_parser(name: str | None) -> ToolCallParser:
    """The parser a config's tool_call_parser names (None means the default, "qwen")."""
    key = DEFAULT_TOOL_PARSER if name is None else name
    factory = _PARSERS.get(key)
    if factory is None:
        raise ValueError(f"unknown tool_call_parser {name!r}; known: {', '.join(TOOL_PARSER_NAMES)}")
    return factory()
