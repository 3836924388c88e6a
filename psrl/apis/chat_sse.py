"""An SSE chat-completion stream rebuilt from a buffered (non-streamed) chat completion. Pure."""

from __future__ import annotations

import json
from typing import Any


def _chunk(result: dict[str, Any], choices: list[dict[str, Any]], usage: Any = None) -> str:
    chunk: dict[str, Any] = {
        "id": result.get("id", ""),
        "object": "chat.completion.chunk",
        "created": result.get("created", 0),
        "model": result.get("model", ""),
        "choices": choices,
    }
    if result.get("system_fingerprint") is not None:
        chunk["system_fingerprint"] = result["system_fingerprint"]
    if usage is not None:
        chunk["usage"] = usage
    return f"data: {json.dumps(chunk, separators=(',', ':'))}\n\n"


def chat_sse_events(result: dict[str, Any], include_usage: bool = False) -> list[str]:
    """Per choice: a role chunk, reasoning_content, content, tool_calls (indexed), then one finish_reason chunk
    per choice, then (`include_usage`: the client's stream_options.include_usage) the usage alone on a chunk
    with `choices: []`, as OpenAI and vLLM send it, then `[DONE]`."""
    events: list[str] = []
    choices = result.get("choices") or []
    for choice in choices:
        index = choice.get("index", 0)
        message = choice.get("message") or {}

        def delta(d: dict[str, Any], logprobs: Any = None, *, index: int = index) -> dict[str, Any]:
            return {"index": index, "delta": d, "logprobs": logprobs, "finish_reason": None}

        events.append(_chunk(result, [delta({"role": message.get("role") or "assistant", "content": ""})]))
        if message.get("reasoning_content"):
            events.append(_chunk(result, [delta({"reasoning_content": message["reasoning_content"]})]))
        if message.get("content"):
            events.append(_chunk(result, [delta({"content": message["content"]}, choice.get("logprobs"))]))
        for i, call in enumerate(message.get("tool_calls") or []):
            tool_call = {
                "index": i,
                "id": call.get("id"),
                "type": call.get("type", "function"),
                "function": call.get("function") or {},
            }
            events.append(_chunk(result, [delta({"tool_calls": [tool_call]})]))
    for choice in choices:
        final = {"index": choice.get("index", 0), "delta": {}, "logprobs": None}
        final["finish_reason"] = choice.get("finish_reason")
        if choice.get("stop_reason") is not None:
            final["stop_reason"] = choice["stop_reason"]
        events.append(_chunk(result, [final]))
    if include_usage and result.get("usage") is not None:
        events.append(_chunk(result, [], result["usage"]))
    events.append("data: [DONE]\n\n")
    return events
