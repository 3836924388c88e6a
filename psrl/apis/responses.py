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


def _chat_tool_choice(choice: Any) -> Any:
    """The chat `tool_choice` of a Responses one: the modes pass as they are, `{type: "function", name}` names
    a function; what chat has no form for (allowed_tools, built-in tools) is refused."""
    if isinstance(choice, str):
        return choice  # "none", "auto", "required": the chat parser checks the value
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise ApiShapeError(
        "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'name': ...}", param="tool_choice"
    )


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
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _chat_tool_choice(body["tool_choice"])
    if body.get("parallel_tool_calls") is not None:
        chat["parallel_tool_calls"] = body["parallel_tool_calls"]
    include = body.get("include") or []
    if not isinstance(include, list):
        raise ApiShapeError("'include' must be a list", param="include")
    top = body.get("top_logprobs")
    if LOGPROBS_INCLUDE in include or top is not None:
        chat["logprobs"] = True
        if top is not None:
            chat["top_logprobs"] = top
    return chat


def response_base(request: dict[str, Any], *, response_id: str, created: int, model: str | None) -> dict[str, Any]:
    """A response to `request` (the Responses body) as it starts: in progress, no output, no usage yet."""
    return {
        "id": response_id,
        "object": "response",
        "created_at": created,
        "status": "in_progress",
        "incomplete_details": None,
        "error": None,
        "model": model,
        "instructions": request.get("instructions"),
        "output": [],
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
        "usage": None,
    }


def response_outcome(finish_reason: str | None, chat_usage: dict[str, Any]) -> dict[str, Any]:
    """The fields a finished generation sets on its response: status, incomplete_details, usage."""
    cut = finish_reason == "length"
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {
        "status": "incomplete" if cut else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
        "usage": {
            "input_tokens": chat_usage.get("prompt_tokens", 0),
            "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": chat_usage.get("completion_tokens", 0),
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": chat_usage.get("total_tokens", 0),
        },
    }


def response_id_of(chat_id: str) -> str:
    return chat_id.replace("chatcmpl", "resp", 1) or _new_id("resp")


def chat_to_response(completion: dict[str, Any], request: dict[str, Any]) -> dict[str, Any]:
    """The Responses object for a finished chat completion of `request` (the Responses body)."""
    choice = (completion.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    base = response_base(
        request,
        response_id=response_id_of(completion.get("id", "")),
        created=completion.get("created", 0),
        model=completion.get("model"),
    )
    stream = ResponseStream(base)  # builds the output items as a stream of this response would
    if message.get("reasoning_content"):
        stream.reasoning(message["reasoning_content"])
    if message.get("content"):
        stream.text(message["content"], (choice.get("logprobs") or {}).get("content"))  # the same entries
    for call in message.get("tool_calls") or []:
        function = call.get("function") or {}
        stream.function_call(call.get("id"), function.get("name"), function.get("arguments", "{}"))
    stream.finish(response_outcome(choice.get("finish_reason"), completion.get("usage") or {}))
    return stream.response


class ResponseStream:
    """The Responses event sequence, written as the output arrives: `start` (created, in_progress), then each
    output item as it opens (added), grows (text, reasoning or arguments deltas) and closes (dones), then
    `finish` (completed, or incomplete). Consecutive text goes to one message item, consecutive reasoning to
    one reasoning item; a function call is an item of its own. `response` is the object as streamed so far."""

    def __init__(self, base: dict[str, Any]) -> None:
        self.response: dict[str, Any] = {**base, "status": "in_progress", "output": []}
        self._open: dict[str, Any] | None = None  # the message or reasoning item taking deltas
        self._seq = 0

    def _emit(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return f"event: {kind}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n"

    def _ids(self) -> dict[str, Any]:
        output = self.response["output"]
        return {"item_id": output[-1]["id"], "output_index": len(output) - 1}

    def start(self) -> list[str]:
        return [
            self._emit("response.created", response=self.response),
            self._emit("response.in_progress", response=self.response),
        ]

    def _add(self, item: dict[str, Any], announced: dict[str, Any], *, take_deltas: bool = True) -> list[str]:
        """Close the open item and announce `item` (as `announced`); it takes the deltas that follow."""
        frames = self._close()
        self.response["output"].append(item)
        self._open = item if take_deltas else None
        index = len(self.response["output"]) - 1
        frames.append(self._emit("response.output_item.added", output_index=index, item=announced))
        return frames

    def _close(self) -> list[str]:
        item, self._open = self._open, None
        if item is None:
            return []
        ids = self._ids()
        part = item["content"][0]
        if item["type"] == "message":
            lps = part.get("logprobs") or []
            frames = [
                self._emit("response.output_text.done", **ids, content_index=0, text=part["text"], logprobs=lps),
                self._emit("response.content_part.done", **ids, content_index=0, part=part),
            ]
        else:
            frames = [
                self._emit("response.reasoning_text.done", **ids, content_index=0, text=part["text"]),
                self._emit("response.content_part.done", **ids, content_index=0, part=part),
            ]
        item["status"] = "completed"
        frames.append(self._emit("response.output_item.done", output_index=ids["output_index"], item=item))
        return frames

    def text(
        self, delta: str, logprobs: list[dict[str, Any]] | None = None, *, item_id: str | None = None
    ) -> list[str]:
        """Output text (with its tokens' log-probs when the request asked for them)."""
        frames: list[str] = []
        if self._open is None or self._open["type"] != "message":
            item = {"type": "message", "id": item_id or _new_id("msg"), "status": "in_progress", "role": "assistant"}
            empty = {"type": "output_text", "text": "", "annotations": []}
            frames += self._add({**item, "content": [dict(empty)]}, {**item, "content": []})
            frames.append(self._emit("response.content_part.added", **self._ids(), content_index=0, part=empty))
        part = self.response["output"][-1]["content"][0]
        part["text"] += delta
        if logprobs is not None:
            part.setdefault("logprobs", []).extend(logprobs)
        lps = logprobs or []
        frames.append(
            self._emit("response.output_text.delta", **self._ids(), content_index=0, delta=delta, logprobs=lps)
        )
        return frames

    def reasoning(self, delta: str, *, item_id: str | None = None) -> list[str]:
        frames: list[str] = []
        if self._open is None or self._open["type"] != "reasoning":
            item = {"type": "reasoning", "id": item_id or _new_id("rs"), "summary": [], "status": "in_progress"}
            empty = {"type": "reasoning_text", "text": ""}
            frames += self._add({**item, "content": [dict(empty)]}, {**item, "content": []})
            frames.append(self._emit("response.content_part.added", **self._ids(), content_index=0, part=empty))
        self.response["output"][-1]["content"][0]["text"] += delta
        frames.append(self._emit("response.reasoning_text.delta", **self._ids(), content_index=0, delta=delta))
        return frames

    def function_call(
        self, call_id: str | None, name: str | None, arguments: str, *, item_id: str | None = None
    ) -> list[str]:
        item = {"type": "function_call", "id": item_id or _new_id("fc"), "call_id": call_id, "name": name}
        done = {**item, "arguments": arguments, "status": "completed"}
        frames = self._add(done, {**item, "arguments": "", "status": "in_progress"}, take_deltas=False)
        ids = self._ids()
        frames.append(self._emit("response.function_call_arguments.delta", **ids, delta=arguments))
        frames.append(self._emit("response.function_call_arguments.done", **ids, arguments=arguments))
        frames.append(self._emit("response.output_item.done", output_index=ids["output_index"], item=done))
        return frames

    def finish(self, outcome: dict[str, Any]) -> list[str]:
        """Close the open item and end with `outcome` (see response_outcome) applied to the response."""
        frames = self._close()
        self.response.update(outcome)
        final = "response.incomplete" if self.response["status"] == "incomplete" else "response.completed"
        frames.append(self._emit(final, response=self.response))
        return frames

    def logprobs(self, logprobs: list[dict[str, Any]]) -> list[str]:
        """Log-probs of tokens that added no text (the end-of-turn token), on the message still open; none when
        the output ended with something else (they belong to a call or to reasoning, which carry none)."""
        if self._open is None or self._open["type"] != "message":
            return []
        return self.text("", logprobs)

    def error(self, message: str, code: str | None = None, param: str | None = None) -> list[str]:
        """The stream's end when the generation failed after the response started: an `error` event, then
        `response.failed` (the response's last event, as for any other end)."""
        frames = [self._emit("error", code=code, message=message, param=param)]
        # The response's error code is one of the API's own (a closed set); ours is on the error event.
        self.response.update(status="failed", error={"code": "server_error", "message": message})
        frames.append(self._emit("response.failed", response=self.response))
        return frames


def response_sse_events(response: dict[str, Any]) -> list[str]:
    """The Responses stream for a finished response (see ResponseStream), with the response's own item ids."""
    stream = ResponseStream({**response, "usage": None, "incomplete_details": None})
    frames = stream.start()
    for item in response["output"]:
        if item["type"] == "message":
            for part in item["content"]:
                frames += stream.text(part["text"], part.get("logprobs"), item_id=item["id"])
        elif item["type"] == "function_call":
            arguments = item.get("arguments", "{}")
            frames += stream.function_call(item.get("call_id"), item.get("name"), arguments, item_id=item["id"])
        else:
            for part in item.get("content") or []:
                frames += stream.reasoning(part["text"], item_id=item["id"])
    frames += stream.finish({k: response[k] for k in ("status", "incomplete_details", "usage")})
    return frames
