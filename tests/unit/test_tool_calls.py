"""Hermes/Qwen tool-call parsing: generated text -> OpenAI tool_calls, content and reasoning_content."""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

import pytest

from psrl.router.pipeline.tool_calls import (
    HermesToolParser,
    NoToolParser,
    ParsedOutput,
    make_tool_parser,
    new_tool_call_id,
    split_reasoning,
)
from psrl.tokenizer import Tokenizer, build_tiny_tokenizer


def _parser() -> HermesToolParser:
    counter = itertools.count()
    return HermesToolParser(id_factory=lambda: f"call_{next(counter)}")


def _block(name: str, arguments: object) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def _names_and_args(out: ParsedOutput) -> list[tuple[str, object]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in out.tool_calls]


def test_one_call() -> None:
    out = _parser().parse(_block("get_weather", {"city": "Paris"}))
    assert out == ParsedOutput(
        content=None,
        tool_calls=[
            {"id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
        ],
        reasoning_content=None,
    )


def test_several_calls_keep_their_order_and_ids() -> None:
    text = "\n".join([_block("a", {"x": 1}), _block("b", {}), _block("c", {"y": [1, 2]})])
    out = _parser().parse(text)
    assert _names_and_args(out) == [("a", {"x": 1}), ("b", {}), ("c", {"y": [1, 2]})]
    assert [c["id"] for c in out.tool_calls] == ["call_0", "call_1", "call_2"]
    assert out.content is None


def test_content_before_between_and_after_calls() -> None:
    text = f"Let me check.\n{_block('a', {})}\nand also\n{_block('b', {})}\nDone. "
    out = _parser().parse(text)
    assert [name for name, _ in _names_and_args(out)] == ["a", "b"]
    assert out.content == "Let me check.\nand also\nDone."


def test_plain_text_is_stripped_content() -> None:
    assert _parser().parse("  Hello there.\n") == ParsedOutput(content="Hello there.")
    assert _parser().parse("  \n") == ParsedOutput(content=None)
    assert _parser().parse("") == ParsedOutput(content=None)


def test_arguments_as_object_or_json_string() -> None:
    as_string = '<tool_call>\n{"name": "f", "arguments": "{\\"k\\": 1}"}\n</tool_call>'
    as_object = '<tool_call>\n{"name": "f", "arguments": {"k": 1}}\n</tool_call>'
    missing = '<tool_call>{"name": "f"}</tool_call>'
    assert _parser().parse(as_string).tool_calls[0]["function"]["arguments"] == '{"k": 1}'
    assert _parser().parse(as_object).tool_calls[0]["function"]["arguments"] == '{"k": 1}'
    assert _parser().parse(missing).tool_calls[0]["function"]["arguments"] == "{}"


@pytest.mark.parametrize(
    "bad",
    [
        "<tool_call>\n{not json}\n</tool_call>",
        '<tool_call>\n["name", "f"]\n</tool_call>',
        '<tool_call>\n{"arguments": {}}\n</tool_call>',
        '<tool_call>\n{"name": 3, "arguments": {}}\n</tool_call>',
        "<tool_call>" + "[" * 100_000 + "</tool_call>",
    ],
)
def test_invalid_block_stays_content_verbatim(bad: str) -> None:
    out = _parser().parse(f"Before {bad} after")
    assert out.tool_calls == []
    assert out.content == f"Before {bad} after"


def test_invalid_block_does_not_hide_valid_ones() -> None:
    bad = "<tool_call>\n{oops\n</tool_call>"
    out = _parser().parse(f"{bad}\n{_block('ok', {'a': 1})}")
    assert _names_and_args(out) == [("ok", {"a": 1})]
    assert out.content == bad


def test_unterminated_final_block_stays_content() -> None:
    cut = '<tool_call>\n{"name": "b", "arguments": {"path": "/tm'
    out = _parser().parse(f"{_block('a', {})}\n{cut}")
    assert [name for name, _ in _names_and_args(out)] == ["a"]
    assert out.content == cut
    # Even a complete JSON body is not a call without its end marker.
    whole = '<tool_call>\n{"name": "b", "arguments": {}}'
    assert _parser().parse(whole) == ParsedOutput(content=whole)


def test_think_block_becomes_reasoning_content() -> None:
    text = f"<think>\nThe user wants weather.\n<tool_call>not a call</tool_call>\n</think>\n\n{_block('w', {})}"
    out = _parser().parse(text)
    assert out.reasoning_content == "The user wants weather.\n<tool_call>not a call</tool_call>"
    assert _names_and_args(out) == [("w", {})]
    assert out.content is None
    assert _parser().parse("<think></think>Hi") == ParsedOutput(content="Hi")


def test_think_only_counts_when_leading_and_closed() -> None:
    assert split_reasoning("  <think>a</think>b") == ("a", "b")
    assert split_reasoning("x <think>a</think>b") == (None, "x <think>a</think>b")
    assert split_reasoning("<think>cut off") == (None, "<think>cut off")
    assert _parser().parse("<think>cut off").content == "<think>cut off"


def test_unicode_arguments_are_not_escaped() -> None:
    args = {"city": "Zürich", "note": "晴れ 😀", "quote": 'say "hi"\n'}
    out = _parser().parse(_block("get_weather", args))
    arguments = out.tool_calls[0]["function"]["arguments"]
    assert "Zürich" in arguments and "晴れ 😀" in arguments
    assert json.loads(arguments) == args


def test_default_ids_look_like_openai() -> None:
    assert re.fullmatch(r"call_[0-9a-f]{24}", new_tool_call_id())
    out = HermesToolParser().parse(_block("a", {}) + _block("b", {}))
    ids = [c["id"] for c in out.tool_calls]
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", i) for i in ids) and len(set(ids)) == 2


def test_none_parser_returns_text_as_content() -> None:
    text = f"<think>r</think> {_block('a', {})} "
    parser = make_tool_parser("none")
    assert isinstance(parser, NoToolParser)
    assert parser.parse(text) == ParsedOutput(content=text)
    assert parser.parse("") == ParsedOutput(content=None)


def test_parser_names() -> None:
    assert isinstance(make_tool_parser(None), HermesToolParser)  # COMPAT: null means qwen
    assert isinstance(make_tool_parser("qwen"), HermesToolParser)
    assert isinstance(make_tool_parser("hermes"), HermesToolParser)
    with pytest.raises(ValueError, match=r"'mistral'.*hermes, none, qwen"):
        make_tool_parser("mistral")


def test_round_trip_through_the_tiny_chat_template(tmp_path: Path) -> None:
    tokenizer = Tokenizer.from_folder(build_tiny_tokenizer(tmp_path))
    calls = [
        {"name": "get_weather", "arguments": {"city": "Zürich", "unit": "celsius"}},
        {"name": "read_file", "arguments": '{"path": "/testbed/README.md"}'},
    ]
    assistant = {
        "role": "assistant",
        "content": "Checking both.",
        "tool_calls": [{"id": f"t{i}", "type": "function", "function": c} for i, c in enumerate(calls)],
    }
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Weather and readme?"}, assistant], add_generation_prompt=False
    )
    start = rendered.rindex("<|im_start|>assistant\n") + len("<|im_start|>assistant\n")
    generated = rendered[start : rendered.index("<|im_end|>", start)]
    # What the router parses is decoded from sampled ids: the markers must survive that too.
    generated = tokenizer.decode(tokenizer.encode(generated), skip_special_tokens=True)

    out = make_tool_parser(None).parse(generated)
    expected = [
        (c["name"], c["arguments"] if isinstance(c["arguments"], dict) else json.loads(c["arguments"])) for c in calls
    ]
    assert _names_and_args(out) == expected
    assert out.content == "Checking both."
    assert out.reasoning_content is None


def test_chat_completion_reports_tool_calls_as_the_finish_reason() -> None:
    from psrl.router.pipeline.context import Generation
    from psrl.router.pipeline.respond import chat_completion

    parsed = HermesToolParser(id_factory=lambda: "call_x").parse(
        'ok\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    )
    body = chat_completion(
        request_id="r",
        created=0,
        model="m",
        output=parsed,
        gen=Generation(output_ids=[1, 2], finish_reason="stop"),
        logprobs=None,
    )
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "ok"
    assert choice["message"]["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"a": 1}'}
    cut = chat_completion(
        request_id="r",
        created=0,
        model="m",
        output=parsed,
        gen=Generation(output_ids=[1, 2], finish_reason="length"),
        logprobs=None,
    )
    assert cut["choices"][0]["finish_reason"] == "length"
