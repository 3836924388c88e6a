"""Anthropic's Messages API (`POST /v1/messages`) over chat completions, and its SSE event sequence.

`system` becomes a system message; a user message's `tool_result` blocks become `tool` messages (before the
message's remaining text); an assistant message's `tool_use` blocks become its `tool_calls` (the input
serialized as JSON arguments); `thinking` blocks are dropped (the chat template does not render them).
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from psrl.apis.common import ApiShapeError, chat_tools

_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "abort": "end_turn"}


def _text_of(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiShapeError(f"{where} must be a string or a list of text blocks", param=where)
    out = []
    for j, block in enumerate(content):
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            raise ApiShapeError(f"{where}[{j}] must be a text block; this model takes text only", param=where)
        out.append(block["text"])
    return "".join(out)


def _blocks(content: Any, where: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise ApiShapeError(f"{where} must be a string or a list of content blocks", param=where)
    for j, block in enumerate(content):
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise ApiShapeError(f"{where}[{j}] must be a content block with a type", param=f"{where}[{j}]")
    return content


def _user(blocks: list[dict[str, Any]], where: str) -> list[dict[str, Any]]:
    tools: list[dict[str, Any]] = []
    texts: list[str] = []
    for j, block in enumerate(blocks):
        kind = block["type"]
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_result":
            if not isinstance(block.get("tool_use_id"), str):
                raise ApiShapeError(f"{where}[{j}].tool_use_id must be a string", param=f"{where}[{j}]")
            text = _text_of(block.get("content", ""), f"{where}[{j}].content")
            tools.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": text})
        else:
            raise ApiShapeError(f"{where}[{j}]: a user block of type {kind!r} is not supported", param=where)
    return tools + ([{"role": "user", "content": "".join(texts)}] if texts or not tools else [])


def _assistant(blocks: list[dict[str, Any]], where: str) -> dict[str, Any]:
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):
        kind = block["type"]
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_use":
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                raise ApiShapeError(f"{where}[{j}] needs string id and name", param=f"{where}[{j}]")
            arguments = json.dumps(block.get("input") or {}, ensure_ascii=False)
            function = {"name": block["name"], "arguments": arguments}
            calls.append({"id": block["id"], "type": "function", "function": function})
        elif kind in ("thinking", "redacted_thinking"):
            continue
        else:
            raise ApiShapeError(f"{where}[{j}]: an assistant block of type {kind!r} is not supported", param=where)
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if calls:
        message["tool_calls"] = calls
    return message


def messages_to_chat(body: dict[str, Any]) -> dict[str, Any]:
    """A chat-completions body for a Messages request (stream excluded)."""
    if not isinstance(body.get("max_tokens"), int) or isinstance(body.get("max_tokens"), bool):
        raise ApiShapeError("'max_tokens' is required and must be an integer", param="max_tokens")
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise ApiShapeError("'messages' must be a non-empty list", param="messages")
    messages: list[dict[str, Any]] = []
    system = body.get("system")
    if system is not None:
        messages.append({"role": "system", "content": _text_of(system, "system")})
    for i, message in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
            raise ApiShapeError(f"{where}.role must be 'user' or 'assistant'", param=f"{where}.role")
        blocks = _blocks(message.get("content"), f"{where}.content")
        if message["role"] == "user":
            messages += _user(blocks, f"{where}.content")
        else:
            messages.append(_assistant(blocks, f"{where}.content"))
    chat: dict[str, Any] = {"messages": messages, "max_tokens": body["max_tokens"]}
    for key in ("model", "temperature", "top_p", "top_k"):
        if body.get(key) is not None:
            chat[key] = body[key]
    if body.get("stop_sequences") is not None:
        chat["stop"] = body["stop_sequences"]
    tools = chat_tools(body.get("tools"), schema_key="input_schema", tool_type=None)
    if tools:
        chat["tools"] = tools
    return chat


def chat_to_message(completion: dict[str, Any]) -> dict[str, Any]:
    """The Messages response for a finished chat completion."""
    choice = (completion.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    content: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        content.append({"type": "thinking", "thinking": message["reasoning_content"], "signature": ""})
    if message.get("content"):
        content.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or []:
        function = call.get("function") or {}
        try:
            tool_input = json.loads(function.get("arguments") or "{}")
        except ValueError:
            tool_input = {}
        if not isinstance(tool_input, dict):
            tool_input = {"value": tool_input}
        content.append({"type": "tool_use", "id": call.get("id"), "name": function.get("name"), "input": tool_input})
    usage = completion.get("usage") or {}
    return {
        "id": completion.get("id", "").replace("chatcmpl", "msg", 1) or f"msg_{uuid.uuid4().hex}",
        "type": "message",
        "role": "assistant",
        "model": completion.get("model"),
        "content": content,
        "stop_reason": _STOP_REASONS.get(choice.get("finish_reason") or "stop", "end_turn"),
        "stop_sequence": None,
        "usage": {
            "input_tokens": usage.get("prompt_tokens", 0),
            "output_tokens": usage.get("completion_tokens", 0),
            "cache_read_input_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
        },
    }


def _frame(kind: str, **fields: Any) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields}, separators=(',', ':'))}\n\n"


def message_sse_events(message: dict[str, Any]) -> list[str]:
    """Anthropic's stream for a finished message: message_start, each content block (start, delta, stop),
    message_delta with the stop reason and output tokens, message_stop."""
    usage = message["usage"]
    opening = {**message, "content": [], "stop_reason": None, "usage": {**usage, "output_tokens": 0}}
    frames = [_frame("message_start", message=opening)]
    for index, block in enumerate(message["content"]):
        start: dict[str, Any]
        if block["type"] == "text":
            start, delta = {"type": "text", "text": ""}, {"type": "text_delta", "text": block["text"]}
        elif block["type"] == "thinking":
            start = {"type": "thinking", "thinking": "", "signature": ""}
            delta = {"type": "thinking_delta", "thinking": block["thinking"]}
        else:
            start = {**block, "input": {}}
            delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"], ensure_ascii=False)}
        frames.append(_frame("content_block_start", index=index, content_block=start))
        frames.append(_frame("content_block_delta", index=index, delta=delta))
        frames.append(_frame("content_block_stop", index=index))
    stop = {"stop_reason": message["stop_reason"], "stop_sequence": message["stop_sequence"]}
    frames.append(_frame("message_delta", delta=stop, usage={"output_tokens": usage["output_tokens"]}))
    frames.append(_frame("message_stop"))
    return frames
