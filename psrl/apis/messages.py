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
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    429: "rate_limit_error",
}


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
    if body.get("tool_choice") is not None:
        chat.update(_chat_tool_choice(body["tool_choice"]))
    return chat


def _chat_tool_choice(choice: Any) -> dict[str, Any]:
    """The chat `tool_choice` (and `parallel_tool_calls`) of an Anthropic one: auto, any (= required), tool
    (a named function) or none; `disable_parallel_tool_use` allows one call."""
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind == "tool" and isinstance(choice.get("name"), str):
        chat_choice: Any = {"type": "function", "function": {"name": choice["name"]}}
    elif kind in ("auto", "any", "none"):
        chat_choice = "required" if kind == "any" else kind
    else:
        raise ApiShapeError(
            "tool_choice must be {'type': 'auto' | 'any' | 'none'} or {'type': 'tool', 'name': ...}",
            param="tool_choice",
        )
    out: dict[str, Any] = {"tool_choice": chat_choice}
    if choice.get("disable_parallel_tool_use") is True:
        out["parallel_tool_calls"] = False
    return out


def message_base(*, message_id: str, model: str | None, input_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """A message as it starts: no content, no stop reason, no output tokens yet."""
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": input_tokens, "output_tokens": 0, "cache_read_input_tokens": cached_tokens},
    }


def message_usage(chat_usage: dict[str, Any]) -> dict[str, Any]:
    """A chat completion's usage in the Messages API's terms: input_tokens leave out the prompt tokens read from
    the cache (Anthropic's total input is input_tokens + cache_read_input_tokens)."""
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {
        "input_tokens": chat_usage.get("prompt_tokens", 0) - cached,
        "output_tokens": chat_usage.get("completion_tokens", 0),
        "cache_read_input_tokens": cached,
    }


def message_id_of(chat_id: str) -> str:
    return chat_id.replace("chatcmpl", "msg", 1) or f"msg_{uuid.uuid4().hex}"


def stop_reason_of(finish_reason: str | None, stop_sequence: str | None = None) -> str:
    """The Messages stop reason of a chat finish reason (`stop_sequence`: the stop string it stopped at)."""
    if stop_sequence is not None and finish_reason == "stop":
        return "stop_sequence"
    return _STOP_REASONS.get(finish_reason or "stop", "end_turn")


def tool_input_of(arguments: str | None) -> dict[str, Any]:
    """A chat tool call's JSON arguments as a tool_use block's `input` (an object, whatever the model wrote)."""
    try:
        tool_input = json.loads(arguments or "{}")
    except ValueError:
        return {}
    return tool_input if isinstance(tool_input, dict) else {"value": tool_input}


def chat_to_message(completion: dict[str, Any]) -> dict[str, Any]:
    """The Messages response for a finished chat completion."""
    choice = (completion.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    usage = message_usage(completion.get("usage") or {})
    base = message_base(
        message_id=message_id_of(completion.get("id", "")),
        model=completion.get("model"),
        input_tokens=usage["input_tokens"],
        cached_tokens=usage["cache_read_input_tokens"],
    )
    stream = MessageStream(base)  # builds the content blocks as a stream of this message would
    if message.get("reasoning_content"):
        stream.thinking(message["reasoning_content"])
    if message.get("content"):
        stream.text(message["content"])
    for call in message.get("tool_calls") or []:
        function = call.get("function") or {}
        stream.tool_use(call.get("id"), function.get("name"), tool_input_of(function.get("arguments")))
    # vLLM's `stop_reason` on a choice: the stop string (or stop token id) it stopped at
    stop_sequence = choice.get("stop_reason") if isinstance(choice.get("stop_reason"), str) else None
    finish_reason = choice.get("finish_reason")
    if finish_reason == "stop" and stop_sequence is None and message.get("tool_calls"):
        finish_reason = "tool_calls"  # a named tool choice ends with "stop" in chat; Anthropic says tool_use
    stream.finish(stop_reason_of(finish_reason, stop_sequence), usage, stop_sequence)
    return stream.message


class MessageStream:
    """Anthropic's event sequence, written as the output arrives: `start` (message_start), each content block
    as it opens (content_block_start), grows (text, thinking or input_json deltas) and closes
    (content_block_stop), then `finish` (message_delta with the stop reason and output tokens, message_stop).
    `message` is the message as streamed so far."""

    def __init__(self, base: dict[str, Any]) -> None:
        self.message: dict[str, Any] = {**base, "content": []}
        self._open: str | None = None  # the type of the block taking deltas ("text" or "thinking")

    @staticmethod
    def _frame(kind: str, **fields: Any) -> str:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields}, separators=(',', ':'))}\n\n"

    def start(self) -> list[str]:
        return [self._frame("message_start", message=self.message)]

    def _close(self) -> list[str]:
        if self._open is None:
            return []
        self._open = None
        return [self._frame("content_block_stop", index=len(self.message["content"]) - 1)]

    def _delta(self, kind: str, field: str, text: str) -> list[str]:
        frames: list[str] = []
        if self._open != kind:
            frames += self._close()
            start = {"type": kind, field: ""} if kind == "text" else {"type": kind, field: "", "signature": ""}
            self.message["content"].append(dict(start))
            self._open = kind
            frames.append(
                self._frame("content_block_start", index=len(self.message["content"]) - 1, content_block=start)
            )
        self.message["content"][-1][field] += text
        delta = {"type": f"{kind}_delta", field: text}
        frames.append(self._frame("content_block_delta", index=len(self.message["content"]) - 1, delta=delta))
        return frames

    def text(self, text: str) -> list[str]:
        return self._delta("text", "text", text)

    def thinking(self, text: str) -> list[str]:
        return self._delta("thinking", "thinking", text)

    def tool_use(self, tool_use_id: str | None, name: str | None, tool_input: dict[str, Any]) -> list[str]:
        frames = self._close()
        block = {"type": "tool_use", "id": tool_use_id, "name": name, "input": tool_input}
        self.message["content"].append(block)
        index = len(self.message["content"]) - 1
        delta = {"type": "input_json_delta", "partial_json": json.dumps(tool_input, ensure_ascii=False)}
        frames.append(self._frame("content_block_start", index=index, content_block={**block, "input": {}}))
        frames.append(self._frame("content_block_delta", index=index, delta=delta))
        frames.append(self._frame("content_block_stop", index=index))
        return frames

    def finish(self, stop_reason: str, usage: dict[str, Any], stop_sequence: str | None = None) -> list[str]:
        """Close the open block and end with the stop reason (and the stop sequence it matched) and the final
        usage (see message_usage: a stream starts before the prompt's cached tokens are known, so message_delta
        carries all of it)."""
        frames = self._close()
        if stop_reason != "stop_sequence":  # Anthropic names the sequence only when it is why the turn ended
            stop_sequence = None
        self.message["stop_reason"] = stop_reason
        self.message["stop_sequence"] = stop_sequence
        self.message["usage"] = {**self.message["usage"], **usage}
        stop = {"stop_reason": stop_reason, "stop_sequence": stop_sequence}
        frames.append(self._frame("message_delta", delta=stop, usage=usage))
        frames.append(self._frame("message_stop"))
        return frames

    def error(self, message: str, status: int) -> list[str]:
        """The stream's end when the generation failed (with HTTP `status`) after the message started."""
        kind = _ERROR_TYPES.get(status, "overloaded_error" if status in (503, 529) else "api_error")
        return [self._frame("error", error={"type": kind, "message": message})]


def message_sse_events(message: dict[str, Any]) -> list[str]:
    """Anthropic's stream for a finished message (see MessageStream)."""
    start = {**message, "stop_reason": None, "stop_sequence": None, "usage": {**message["usage"], "output_tokens": 0}}
    stream = MessageStream(start)
    frames = stream.start()
    for block in message["content"]:
        if block["type"] == "text":
            frames += stream.text(block["text"])
        elif block["type"] == "thinking":
            frames += stream.thinking(block["thinking"])
        else:
            frames += stream.tool_use(block.get("id"), block.get("name"), block.get("input") or {})
    frames += stream.finish(message["stop_reason"], message["usage"], message.get("stop_sequence"))
    return frames
