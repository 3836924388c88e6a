"""The Responses and Messages converters, and their SSE sequences as the official clients read them."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx
import httpx2
import openai
import pytest

from psrl.apis import (
    ApiShapeError,
    chat_to_message,
    chat_to_response,
    message_sse_events,
    messages_to_chat,
    response_sse_events,
    responses_to_chat,
)

CALL = {"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": '{"q": "he"}'}}


def _completion(content: str | None, calls: list[dict[str, Any]], finish: str = "stop") -> dict[str, Any]:
    return {
        "id": "chatcmpl-abc",
        "object": "chat.completion",
        "created": 1700000000,
        "model": "tiny",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": content, "tool_calls": calls},
                "logprobs": {"content": [{"token": "Hi", "logprob": -0.5, "bytes": [72, 105], "top_logprobs": []}]},
                "finish_reason": "tool_calls" if calls else finish,
            }
        ],
        "usage": {
            "prompt_tokens": 11,
            "completion_tokens": 5,
            "total_tokens": 16,
            "prompt_tokens_details": {"cached_tokens": 4},
        },
    }


def _sse_client_transport(frames: list[str], http: Any = httpx) -> Any:
    """A transport (of `http`: httpx, or httpx2 for the anthropic SDK) that answers every request with `frames`."""
    body = "".join(frames).encode()
    return http.MockTransport(
        lambda request: http.Response(200, content=body, headers={"content-type": "text/event-stream"})
    )


# ---- Responses ---------------------------------------------------------------------------------------------


def test_responses_input_items_become_chat_messages() -> None:
    body = {
        "model": "tiny",
        "instructions": "Be brief.",
        "input": [
            {
                "role": "user",
                "content": [{"type": "input_text", "text": "Look up "}, {"type": "input_text", "text": "he"}],
            },
            {"type": "reasoning", "id": "rs_1", "summary": []},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Sure."}]},
            {"type": "function_call", "call_id": "c1", "name": "lookup", "arguments": '{"q": "he"}'},
            {"type": "function_call", "call_id": "c2", "name": "lookup", "arguments": '{"q": "she"}'},
            {"type": "function_call_output", "call_id": "c1", "output": "42"},
            {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "7"}]},
            {"type": "function_call", "call_id": "c3", "name": "lookup", "arguments": "{}"},
        ],
        "max_output_tokens": 9,
        "temperature": 0,
        "tools": [{"type": "function", "name": "lookup", "description": "d", "parameters": {"type": "object"}}],
        "include": ["message.output_text.logprobs"],
    }
    chat = responses_to_chat(body)
    assert chat["max_tokens"] == 9 and chat["temperature"] == 0 and chat["logprobs"] is True
    assert chat["tools"] == [
        {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}, "description": "d"}}
    ]
    m = chat["messages"]
    assert m[0] == {"role": "system", "content": "Be brief."}
    assert m[1] == {"role": "user", "content": "Look up he"}
    assert m[2]["role"] == "assistant" and m[2]["content"] == "Sure."
    assert [c["id"] for c in m[2]["tool_calls"]] == ["c1", "c2"]  # consecutive calls join the assistant turn
    assert m[3] == {"role": "tool", "tool_call_id": "c1", "content": "42"}
    assert m[4] == {"role": "tool", "tool_call_id": "c2", "content": "7"}
    assert m[5] == {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": "c3", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}],
    }
    assert responses_to_chat(body) == chat  # deterministic: the same history gives the same messages
    assert responses_to_chat({"input": "hi"})["messages"] == [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({}, "input"),
        ({"input": []}, "input"),
        ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
        ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
        ({"input": [{"role": ["user"], "content": "x"}]}, "input[0].role"),
        ({"input": [{"type": ["message"], "role": "user", "content": "x"}]}, "input[0].type"),
        ({"input": [{"role": "user", "content": [{"type": {"a": 1}, "text": "x"}]}]}, "input[0].content"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]}, "input[0].content"),
        ({"input": [{"type": "web_search_call"}]}, "input[0].type"),
        ({"input": [{"type": "function_call", "name": "f"}]}, "input[0]"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0]"),
        ({"input": "x", "instructions": 3}, "instructions"),
    ],
)
def test_responses_bad_bodies_name_the_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiShapeError) as e:
        responses_to_chat(body)
    assert e.value.param == param


def test_response_object_and_its_stream_through_the_official_client() -> None:
    request = {"input": "hi", "max_output_tokens": 5, "tools": [{"type": "function", "name": "lookup"}]}
    response = chat_to_response(_completion("Hi", [CALL]), request)
    assert response["object"] == "response" and response["status"] == "completed"
    assert [o["type"] for o in response["output"]] == ["message", "function_call"]
    assert response["output"][1]["call_id"] == "call_1" and response["output"][1]["arguments"] == '{"q": "he"}'
    assert response["usage"]["input_tokens"] == 11 and response["usage"]["input_tokens_details"]["cached_tokens"] == 4
    cut = chat_to_response(_completion("Hi", [], finish="length"), request)
    assert cut["status"] == "incomplete" and cut["incomplete_details"] == {"reason": "max_output_tokens"}

    frames = response_sse_events(response)
    kinds = [json.loads(f.split("data: ", 1)[1])["type"] for f in frames]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert [json.loads(f.split("data: ", 1)[1])["sequence_number"] for f in frames] == list(range(len(frames)))
    client = openai.OpenAI(
        api_key="x", base_url="http://t/v1", http_client=httpx.Client(transport=_sse_client_transport(frames))
    )
    events = list(client.responses.create(model="tiny", input="hi", stream=True))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == "Hi"
    final = events[-1].response
    assert final.output_text == "Hi" and final.output[1].name == "lookup"


# ---- Messages ----------------------------------------------------------------------------------------------


def test_messages_blocks_become_chat_messages() -> None:
    body = {
        "model": "tiny",
        "max_tokens": 7,
        "system": [{"type": "text", "text": "Be brief."}],
        "stop_sequences": ["END"],
        "tools": [{"name": "lookup", "description": "d", "input_schema": {"type": "object"}}],
        "messages": [
            {"role": "user", "content": "Look up he"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "hmm", "signature": "s"},
                    {"type": "text", "text": "Sure."},
                    {"type": "tool_use", "id": "t1", "name": "lookup", "input": {"q": "he"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "42"}]},
                    {"type": "text", "text": "thanks"},
                ],
            },
        ],
    }
    chat = messages_to_chat(body)
    assert chat["max_tokens"] == 7 and chat["stop"] == ["END"]
    assert chat["tools"][0]["function"]["parameters"] == {"type": "object"}
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Look up he"},
        {
            "role": "assistant",
            "content": "Sure.",
            "tool_calls": [
                {"id": "t1", "type": "function", "function": {"name": "lookup", "arguments": '{"q": "he"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "t1", "content": "42"},
        {"role": "user", "content": "thanks"},
    ]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
        ({"max_tokens": 4, "messages": []}, "messages"),
        ({"max_tokens": 4, "messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
        ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image"}]}]}, "messages[0].content"),
        (
            {"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "tool_result"}]}]},
            "messages[0].content[0]",
        ),
    ],
)
def test_messages_bad_bodies_name_the_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiShapeError) as e:
        messages_to_chat(body)
    assert e.value.param == param


def test_message_object_and_its_stream_through_the_official_client() -> None:
    message = chat_to_message(_completion("Hi", [CALL]))
    assert message["type"] == "message" and message["stop_reason"] == "tool_use"
    assert message["content"] == [
        {"type": "text", "text": "Hi"},
        {"type": "tool_use", "id": "call_1", "name": "lookup", "input": {"q": "he"}},
    ]
    # Anthropic counts cache reads apart from input_tokens: 11 prompt tokens, 4 of them cached.
    assert message["usage"] == {"input_tokens": 7, "output_tokens": 5, "cache_read_input_tokens": 4}
    assert chat_to_message(_completion("Hi", [], finish="length"))["stop_reason"] == "max_tokens"

    frames = message_sse_events(message)
    client = anthropic.Anthropic(
        api_key="x", base_url="http://t", http_client=httpx2.Client(transport=_sse_client_transport(frames, httpx2))
    )
    with client.messages.stream(model="tiny", max_tokens=5, messages=[{"role": "user", "content": "hi"}]) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == "Hi"
    assert final.stop_reason == "tool_use" and final.usage.output_tokens == 5
    assert final.content[1].type == "tool_use" and final.content[1].input == {"q": "he"}


@pytest.mark.parametrize(
    ("choice", "chat_choice"),
    [
        ("none", "none"),
        ("auto", "auto"),
        ("required", "required"),
        ({"type": "function", "name": "lookup"}, {"type": "function", "function": {"name": "lookup"}}),
    ],
)
def test_responses_tool_choice_becomes_the_chat_one(choice: Any, chat_choice: Any) -> None:
    body = {"input": "hi", "tools": [{"type": "function", "name": "lookup"}], "tool_choice": choice}
    chat = responses_to_chat({**body, "parallel_tool_calls": False})
    assert chat["tool_choice"] == chat_choice and chat["parallel_tool_calls"] is False
    assert "tool_choice" not in responses_to_chat({"input": "hi"})


@pytest.mark.parametrize(
    ("choice", "chat_fields"),
    [
        ({"type": "auto"}, {"tool_choice": "auto"}),
        ({"type": "any"}, {"tool_choice": "required"}),
        ({"type": "none"}, {"tool_choice": "none"}),
        (
            {"type": "tool", "name": "lookup", "disable_parallel_tool_use": True},
            {"tool_choice": {"type": "function", "function": {"name": "lookup"}}, "parallel_tool_calls": False},
        ),
    ],
)
def test_messages_tool_choice_becomes_the_chat_one(choice: dict[str, Any], chat_fields: dict[str, Any]) -> None:
    body = {"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], "tool_choice": choice}
    chat = messages_to_chat({**body, "tools": [{"name": "lookup", "input_schema": {"type": "object"}}]})
    assert {k: chat[k] for k in chat_fields} == chat_fields
    assert "parallel_tool_calls" in chat_fields or "parallel_tool_calls" not in chat


@pytest.mark.parametrize("convert", ["responses", "messages"])
@pytest.mark.parametrize("choice", [{"type": "allowed_tools"}, {"type": "tool"}, 3, {"type": "file_search"}])
def test_a_tool_choice_chat_has_no_form_for_is_refused(convert: str, choice: Any) -> None:
    with pytest.raises(ApiShapeError) as e:
        if convert == "responses":
            responses_to_chat({"input": "hi", "tool_choice": choice})
        else:
            messages_to_chat({"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], "tool_choice": choice})
    assert e.value.param == "tool_choice"


def test_a_named_tool_choices_call_is_tool_use_in_messages() -> None:
    # chat ends a named choice's call with "stop" (as OpenAI does); Anthropic says tool_use
    assert chat_to_message(_completion(None, [CALL], finish="stop"))["stop_reason"] == "tool_use"
    assert chat_to_message(_completion("hi", [], finish="stop"))["stop_reason"] == "end_turn"
