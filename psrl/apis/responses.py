"""The OpenAI Responses API (`POST /v1/responses`) over chat completions, and its SSE event sequence.

A request's `instructions` and `input` items become chat messages: message items keep their role,
`function_call` items become the assistant's `tool_calls` (consecutive calls join one assistant message),
`function_call_output` items become `tool` messages, `reasoning` items are dropped (the chat template does
not render them). The conversion is deterministic, so an agent that resends its history gets the same chat
messages every turn (what TITO's incremental tokenization matches on).
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from psrl.apis.common import ApiShapeError, chat_tools

_MESSAGE_ROLES = frozenset({"user", "system", "developer", "assistant"})
_TEXT_PARTS = frozenset({"input_text", "output_text", "text"})
# Sampling fields with the same name and meaning in both APIs.
_SHARED_FIELDS = ("model", "temperature", "top_p", "seed", "top_k", "min_p", "repetition_penalty", "stop")
LOGPROBS_INCLUDE = "message.output_text.logprobs"


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _text_of(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiShapeError(f"{where}.content must be a string or a list of text parts", param=f"{where}.content")
    out = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if not isinstance(kind, str) or kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise ApiShapeError(
                f"{where}.content[{j}] must be a text part (input_text or output_text); this model takes text only",
                param=f"{where}.content",
            )
        out.append(part["text"])
    return "".join(out)


def _input_messages(items: Any) -> list[dict[str, Any]]:
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise ApiShapeError("'input' must be a string or a non-empty list of items", param="input")
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise ApiShapeError(f"{where} must be an object", param=where)
        kind = item.get("type", "message")
        if not isinstance(kind, str):
            raise ApiShapeError(f"{where}.type must be a string", param=f"{where}.type")
        if kind == "message":
            role = item.get("role")
            if not isinstance(role, str) or role not in _MESSAGE_ROLES:
                raise ApiShapeError(f"{where}.role must be one of {sorted(_MESSAGE_ROLES)}", param=f"{where}.role")
            messages.append({"role": role, "content": _text_of(item.get("content"), where)})
        elif kind == "function_call":
            name, arguments, call_id = item.get("name"), item.get("arguments", "{}"), item.get("call_id")
            if not isinstance(name, str) or not isinstance(arguments, str) or not isinstance(call_id, str):
                raise ApiShapeError(f"{where} needs string name, arguments and call_id", param=where)
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            elif last is not None and last["role"] == "assistant":
                last["tool_calls"] = [call]
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str):
                raise ApiShapeError(f"{where}.call_id must be a string", param=f"{where}.call_id")
            text = output if isinstance(output, str) else _text_of(output, where)
            messages.append({"role": "tool", "tool_call_id": call_id, "content": text})
        elif kind == "reasoning":
            continue
        else:
            raise ApiShapeError(f"{where}.type {kind!r} is not supported", param=f"{where}.type")
    return messages


def responses_to_chat(body: dict[str, Any]) -> dict[str, Any]:
    """A chat-completions body for a Responses request (stream, store and previous_response_id excluded)."""
    if body.get("previous_response_id") is not None:
        raise ApiShapeError(
            "previous_response_id is not supported: responses are not stored; send the whole input",
            param="previous_response_id",
        )
    if "input" not in body:
        raise ApiShapeError("'input' is required", param="input")
    messages = _input_messages(body["input"])
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise ApiShapeError("'instructions' must be a string", param="instructions")
        messages.insert(0, {"role": "system", "content": instructions})
    chat: dict[str, Any] = {k: body[k] for k in _SHARED_FIELDS if body.get(k) is not None}
    chat["messages"] = messages
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    tools = chat_tools(body.get("tools"), schema_key="parameters", tool_type="function")
    if tools:
        chat["tools"] = tools
    include = body.get("include") or []
    if not isinstance(include, list):
        raise ApiShapeError("'include' must be a list", param="include")
    top = body.get("top_logprobs")
    if LOGPROBS_INCLUDE in include or top is not None:
        chat["logprobs"] = True
        if top is not None:
            chat["top_logprobs"] = top
    return chat


def _output_logprobs(choice: dict[str, Any]) -> list[dict[str, Any]] | None:
    content = (choice.get("logprobs") or {}).get("content")
    if content is None:
        return None
    return [
        {
            "token": e["token"],
            "logprob": e["logprob"],
            "bytes": e.get("bytes"),
            "top_logprobs": [
                {"token": t["token"], "logprob": t["logprob"], "bytes": t.get("bytes")}
                for t in e.get("top_logprobs") or []
            ],
        }
        for e in content
    ]


def chat_to_response(completion: dict[str, Any], request: dict[str, Any]) -> dict[str, Any]:
    """The Responses object for a finished chat completion of `request` (the Responses body)."""
    choice = (completion.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    output: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        output.append(
            {
                "type": "reasoning",
                "id": _new_id("rs"),
                "summary": [],
                "content": [{"type": "reasoning_text", "text": message["reasoning_content"]}],
                "status": "completed",
            }
        )
    if message.get("content"):
        part: dict[str, Any] = {"type": "output_text", "text": message["content"], "annotations": []}
        logprobs = _output_logprobs(choice)
        if logprobs is not None:
            part["logprobs"] = logprobs
        output.append(
            {"type": "message", "id": _new_id("msg"), "status": "completed", "role": "assistant", "content": [part]}
        )
    for call in message.get("tool_calls") or []:
        function = call.get("function") or {}
        output.append(
            {
                "type": "function_call",
                "id": _new_id("fc"),
                "call_id": call.get("id"),
                "name": function.get("name"),
                "arguments": function.get("arguments", "{}"),
                "status": "completed",
            }
        )
    cut = choice.get("finish_reason") == "length"
    usage = completion.get("usage") or {}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {
        "id": completion.get("id", "").replace("chatcmpl", "resp", 1) or _new_id("resp"),
        "object": "response",
        "created_at": completion.get("created", 0),
        "status": "incomplete" if cut else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
        "error": None,
        "model": completion.get("model"),
        "instructions": request.get("instructions"),
        "output": output,
        "parallel_tool_calls": request.get("parallel_tool_calls", True),
        "tool_choice": request.get("tool_choice", "auto"),
        "tools": request.get("tools") or [],
        "temperature": request.get("temperature"),
        "top_p": request.get("top_p"),
        "max_output_tokens": request.get("max_output_tokens"),
        "previous_response_id": None,
        "store": False,
        "text": {"format": {"type": "text"}},
        "truncation": "disabled",
        "metadata": request.get("metadata") or {},
        "usage": {
            "input_tokens": usage.get("prompt_tokens", 0),
            "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": usage.get("completion_tokens", 0),
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.get("total_tokens", 0),
        },
    }


class _Events:
    """Numbered `event: <type>` SSE frames."""

    def __init__(self) -> None:
        self.frames: list[str] = []

    def emit(self, kind: str, **fields: Any) -> None:
        payload = {"type": kind, "sequence_number": len(self.frames), **fields}
        self.frames.append(f"event: {kind}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n")


def _opened(item: dict[str, Any]) -> dict[str, Any]:
    """An output item as `response.output_item.added` announces it: in progress, nothing generated yet."""
    if item["type"] == "message":
        return {**item, "status": "in_progress", "content": []}
    if item["type"] == "function_call":
        return {**item, "status": "in_progress", "arguments": ""}
    return {**item, "status": "in_progress", "content": []}


def response_sse_events(response: dict[str, Any]) -> list[str]:
    """The Responses stream for a finished response: created, in_progress, each output item (added, its
    part/text/arguments deltas and dones, done), then completed (or incomplete)."""
    ev = _Events()
    pending = {**response, "status": "in_progress", "incomplete_details": None, "output": []}
    ev.emit("response.created", response=pending)
    ev.emit("response.in_progress", response=pending)
    for index, item in enumerate(response["output"]):
        ev.emit("response.output_item.added", output_index=index, item=_opened(item))
        ids = {"item_id": item["id"], "output_index": index}
        if item["type"] == "message":
            for c, part in enumerate(item["content"]):
                empty = {"type": "output_text", "text": "", "annotations": []}
                ev.emit("response.content_part.added", **ids, content_index=c, part=empty)
                lps = part.get("logprobs") or []
                ev.emit("response.output_text.delta", **ids, content_index=c, delta=part["text"], logprobs=lps)
                ev.emit("response.output_text.done", **ids, content_index=c, text=part["text"], logprobs=lps)
                ev.emit("response.content_part.done", **ids, content_index=c, part=part)
        elif item["type"] == "function_call":
            ev.emit("response.function_call_arguments.delta", **ids, delta=item["arguments"])
            ev.emit("response.function_call_arguments.done", **ids, arguments=item["arguments"])
        else:
            for c, part in enumerate(item.get("content") or []):
                ev.emit("response.reasoning_text.delta", **ids, content_index=c, delta=part["text"])
                ev.emit("response.reasoning_text.done", **ids, content_index=c, text=part["text"])
        ev.emit("response.output_item.done", output_index=index, item=item)
    final = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
    ev.emit(final, response=response)
    return ev.frames
