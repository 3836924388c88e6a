"""Text the tokenizer cannot take, template variables the template call owns, and the context-overflow error."""

from __future__ import annotations

import json

import pytest

from psrl.router.errors import ERROR_CODE_HEADER, BadRequest, PromptOverflow
from psrl.router.pipeline.context import SamplingSpec
from psrl.router.pipeline.parse import check_json_text, parse_chat, parse_completion
from psrl.router.pipeline.prepare import check_prompt, text_prompt_ids
from psrl.tokenizer import (
    TEMPLATE_CALL_ARGS,
    ChatTemplateError,
    InvalidTextError,
    Tokenizer,
    build_tiny_tokenizer,
    lone_surrogate_at,
)

MSG = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer.from_folder(build_tiny_tokenizer(tmp_path_factory.mktemp("tok")))


def test_lone_surrogate_at() -> None:
    assert lone_surrogate_at("plain ascii") is None
    assert lone_surrogate_at("héllo 日本 \U0001f600") is None
    assert lone_surrogate_at("ab\ud800") == 2
    assert lone_surrogate_at("é\udfff") == 1
    # what JSON makes of an escaped pair is one character; a half of it stays a lone surrogate
    assert lone_surrogate_at(json.loads('"\\ud83d\\ude00"')) is None
    assert lone_surrogate_at(json.loads('"\\ud83d x"')) == 0


@pytest.mark.parametrize("text", ["a\ud800b", "x" * 40_000 + "\udc00"])  # cached and uncached encodes
def test_encode_refuses_a_lone_surrogate_with_a_typed_error(tok: Tokenizer, text: str) -> None:
    with pytest.raises(InvalidTextError, match="lone surrogate"):
        tok.encode(text)
    assert tok.encode("fine") == tok.encode("fine")


async def test_a_text_prompt_with_a_surrogate_is_refused_when_parsed_and_when_tokenized(tok: Tokenizer) -> None:
    with pytest.raises(BadRequest) as exc:  # parsed first: before any policy reads the text
        parse_completion({"prompt": ["ok", "x\ud800"]})
    assert exc.value.param == "prompt[1]"
    ok, bad = "ok", "x\ud800"
    assert (await text_prompt_ids(ok, tok)).tolist() == tok.encode("ok")
    with pytest.raises(BadRequest) as exc:
        await text_prompt_ids(bad, tok)
    assert exc.value.param == "prompt" and "lone surrogate" in exc.value.message
    with pytest.raises(BadRequest) as exc:
        await text_prompt_ids(bad, tok, "text")  # /generate's field
    assert exc.value.param == "text"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": [{"role": "user", "content": "a\ud800"}]}, "messages[0].content"),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "\udc00"}]}]},
            "messages[0].content[0].text",
        ),
        (
            {
                "messages": [
                    *MSG,
                    {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": '{"a": "\ud800"}'}}]},
                ]
            },
            "messages[1].tool_calls[0].function.arguments",
        ),
        ({"messages": [{"role": "tool", "content": "ok", "name": "n\ud800"}]}, "messages[0].name"),
        ({"messages": MSG, "tools": [{"function": {"parameters": {"\ud800": {}}}}]}, "tools[0].function.parameters"),
        ({"messages": MSG, "chat_template_kwargs": {"k": ["\ud800"]}}, "chat_template_kwargs.k[0]"),
        ({"messages": MSG, "stop": "\ud800"}, "stop"),
    ],
)
def test_parse_chat_names_the_string_with_a_lone_surrogate(body: dict, param: str) -> None:
    with pytest.raises(BadRequest) as exc:
        parse_chat(body)
    assert exc.value.param == param and "lone surrogate" in exc.value.message


def test_check_json_text_walks_deep_values_without_recursion() -> None:
    deep: list = ["\ud800"]
    for _ in range(5000):
        deep = [deep]
    with pytest.raises(BadRequest) as exc:
        check_json_text(deep, "v")
    assert exc.value.param == "v" + "[0]" * 5001
    check_json_text({"a": [1, 2.5, None, True, {"b": "ok 日本"}]}, "v")


@pytest.mark.parametrize("key", sorted(TEMPLATE_CALL_ARGS))
def test_parse_chat_refuses_template_kwargs_the_call_sets(key: str) -> None:
    with pytest.raises(BadRequest) as exc:
        parse_chat({"messages": MSG, "chat_template_kwargs": {"enable_thinking": True, key: None}})
    assert exc.value.param == f"chat_template_kwargs.{key}" and repr(key) in exc.value.message


def test_apply_chat_template_refuses_them_too(tok: Tokenizer) -> None:
    for key in TEMPLATE_CALL_ARGS - {"messages", "tools", "add_generation_prompt"}:  # the others are Python's
        with pytest.raises(ChatTemplateError, match=key):
            tok.apply_chat_template(MSG, **{key: "x"})
    assert tok.apply_chat_template(MSG, enable_thinking=False)


def _overflow(prompt_len: int, max_tokens: int | None, context: int) -> PromptOverflow:
    with pytest.raises(PromptOverflow) as exc:
        check_prompt([1] * prompt_len, SamplingSpec(max_tokens=max_tokens), context)
    return exc.value


def test_overflow_reads_as_openai_and_as_psrl() -> None:
    e = _overflow(5000, 16, 4096)
    assert e.message.startswith(
        "This model's maximum context length is 4096 tokens. However, you requested 5016 tokens (5000 in the "
        "messages, 16 in the completion). Please reduce the length of the messages or completion."
    )
    assert "The prompt (length 5000) is longer than the maximum model length of 4096." in e.message
    assert e.param == "messages"
    response = e.to_response()
    body = json.loads(response.body)["error"]
    assert body["code"] == "context_length_exceeded" and body["type"] == "invalid_request_error"
    assert response.headers[ERROR_CODE_HEADER] == "prompt_overflow"


def test_overflow_by_max_tokens_and_at_the_limit() -> None:
    e = _overflow(100, 4000, 4096)
    assert "you requested 4100 tokens (100 in the messages, 4000 in the completion)" in e.message
    assert "longer than the maximum model length of 4096" in e.message and e.param == "max_tokens"
    e = _overflow(4096, None, 4096)  # no room for the one token a generation makes
    assert "you requested 4097 tokens (4096 in the messages, 1 in the completion)" in e.message
    assert "longer than the maximum model length" in e.message


def test_prompts_that_fit_pass() -> None:
    check_prompt([1] * 4095, SamplingSpec(max_tokens=None), 4096)
    check_prompt([1] * 96, SamplingSpec(max_tokens=4000), 4096)
    check_prompt([1] * 10**5, SamplingSpec(max_tokens=10), 0)  # unknown context: the replica decides
