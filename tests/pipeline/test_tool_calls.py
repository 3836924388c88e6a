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
    StreamPiece,
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


def test_a_reply_without_calls_is_its_content_as_sampled() -> None:
    # vLLM's hermes parser returns such text verbatim: a re-tokenizer gets back the ids the model sampled.
    assert _parser().parse(" astersaus") == ParsedOutput(content=" astersaus")
    assert _parser().parse("  Hello there.\n") == ParsedOutput(content="  Hello there.\n")
    assert _parser().parse("  \n") == ParsedOutput(content="  \n")
    assert _parser().parse("") == ParsedOutput(content=None)
    bad = " <tool_call>\n{oops}\n</tool_call> "  # no call in it: verbatim too
    assert _parser().parse(bad) == ParsedOutput(content=bad)


def test_only_the_separator_next_to_a_call_is_dropped() -> None:
    out = _parser().parse(f"  Let me check.\n{_block('a', {})}")
    assert out.content == "  Let me check." and [n for n, _ in _names_and_args(out)] == ["a"]
    assert _parser().parse(f" \n{_block('a', {})}\n").content is None
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
    assert out.reasoning_content == "\nThe user wants weather.\n<tool_call>not a call</tool_call>\n"
    assert _names_and_args(out) == [("w", {})]
    assert out.content is None
    assert _parser().parse("<think></think>Hi") == ParsedOutput(content="Hi")
    # What follows the block is as sampled, as vLLM's reasoning parsers leave it.
    assert _parser().parse("<think>\nr\n</think>\n\nHi ") == ParsedOutput("\n\nHi ", reasoning_content="\nr\n")


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
    assert isinstance(make_tool_parser(None), HermesToolParser)  # a null parser in PSRL's YAML means qwen
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


def test_chat_choice_reports_tool_calls_as_the_finish_reason() -> None:
    from psrl.router.pipeline.context import Generation
    from psrl.router.pipeline.respond import chat_choice

    parsed = HermesToolParser(id_factory=lambda: "call_x").parse(
        'ok\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    )
    choice = chat_choice(0, parsed, Generation(output_ids=[1, 2], finish_reason="stop"), None)
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "ok"
    assert choice["message"]["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"a": 1}'}
    cut = chat_choice(0, parsed, Generation(output_ids=[1, 2], finish_reason="length"), None)
    assert cut["finish_reason"] == "length"


# ---- streaming ----------------------------------------------------------------------------------------

STREAM_TEXTS = [
    "",
    "plain text, no calls",
    _block("a", {"x": 1}),
    f"Let me check.\n{_block('a', {})}\nand also\n{_block('b', {'q': 'é'})}\nDone. ",
    f"<think>\nweigh it\n</think>\n\n{_block('a', {})}",
    "  <think>cut off mid-thought",
    "<thin is not a think tag",
    "<tool_call>\nnot json\n</tool_call> then text",
    '<tool_call>{"name": "a"}</tool_call><tool_call>{"name": "b"}</tool_call>',
    f'{_block("a", {})}\n<tool_call>\n{{"name": "cut',
    "a < b and <tool_ is not a tag </tool_call>",
    f"A{_block('a', {})}B",
    f"Let me look.\n\n{_block('a', {})}\n",
    "A \n<tool_call>bad</tool_call> B\n",
    f"<think>\nplan\n</think>\n\nHello\n{_block('a', {})}",
    f"<think>x {_block('a', {})}",
    f"<think>{_block('a', {})}</think>{_block('b', {})}",
    " astersaus and more ",
    "\n\nHello\n",
    f"  Lead \n{_block('a', {})}  ",
    "<think> r </think>  ",
    "  ",
    " <tool_call>\n{oops}\n</tool_call> tail ",
]


def _streamed(text: str, cuts: list[int]) -> list[StreamPiece]:
    counter = itertools.count()
    stream = HermesToolParser(id_factory=lambda: f"call_{next(counter)}").stream()
    bounds = [0, *cuts, len(text)]
    pieces = [p for a, b in itertools.pairwise(bounds) for p in stream.push(text[a:b])]
    return pieces + stream.finish()


def _joined(pieces: list[StreamPiece]) -> tuple[str, str, list[dict]]:
    """(content, reasoning, calls) with runs of one kind concatenated."""
    content = "".join(p.text for p in pieces if p.kind == "content")
    reasoning = "".join(p.text for p in pieces if p.kind == "reasoning")
    return content, reasoning, [p.call for p in pieces if p.call is not None]


def _words(text: str | None) -> list[str]:
    return (text or "").split()


@pytest.mark.parametrize("text", STREAM_TEXTS)
def test_streaming_gives_the_same_message_however_the_text_is_cut(text: str) -> None:
    whole = _joined(_streamed(text, []))
    for cuts in [*([i] for i in range(1, len(text))), list(range(1, len(text)))]:
        assert _joined(_streamed(text, cuts)) == whole, cuts
    parsed = _parser().parse(text)
    content, reasoning, calls = whole
    if parsed.reasoning_content is None and reasoning:  # a think block never closed: reasoning while it streamed
        assert text.lstrip().startswith("<think>") and "</think>" not in text and content == "" and calls == []
        assert reasoning == text.lstrip().removeprefix("<think>")
    else:  # exactly what the whole text parses to
        assert reasoning == (parsed.reasoning_content or "") and content == (parsed.content or "")
        assert calls == parsed.tool_calls


def test_streamed_content_comes_out_before_the_generation_ends() -> None:
    stream = _parser().stream()
    assert stream.push("Hello wor") == [StreamPiece("content", "Hello wor")]
    assert stream.push("ld <tool") == [StreamPiece("content", "ld")]  # "<tool" may open a call, " " may end
    assert stream.push("box") == [StreamPiece("content", " <toolbox")]  # neither: sent with what follows
    assert stream.push(" <tool") == []
    assert stream.push('_call>{"name": "a"') == []
    [call] = stream.push("}</tool_call>")
    assert call.kind == "tool_call" and call.call is not None and call.call["function"]["name"] == "a"
    assert stream.push("\n  ") == [] and stream.push("after") == [StreamPiece("content", "\nafter")]
    assert stream.finish(" \n") == []  # trailing whitespace at the end: dropped, as parse strips it


def test_streamed_reasoning_comes_out_as_it_is_generated() -> None:
    stream = _parser().stream()
    assert stream.push("<thi") == [] and stream.push("nk>\nstep one") == [StreamPiece("reasoning", "\nstep one")]
    assert stream.push(", two</th") == [StreamPiece("reasoning", ", two")]
    assert stream.push("ink>\n\nAnswer") == [StreamPiece("content", "\n\nAnswer")]


def test_streamed_content_keeps_its_whitespace() -> None:
    stream = _parser().stream()
    assert stream.push(" aster") == [StreamPiece("content", " aster")]
    assert stream.push("saus \n") == [StreamPiece("content", "saus")]  # may be the separator before a call
    assert stream.finish() == [StreamPiece("content", " \n")]  # it was not: the reply ends as sampled


def test_what_a_think_block_holds_is_reasoning_whatever_its_tags() -> None:
    closed = '<think>maybe <tool_call>{"name": "a"}</tool_call>? no.</think>Done.'
    stream = _parser().stream()
    pieces = [p for ch in closed for p in stream.push(ch)] + stream.finish()
    assert _joined(pieces) == ("Done.", 'maybe <tool_call>{"name": "a"}</tool_call>? no.', [])
    assert _parser().parse(closed).tool_calls == []
    # Never closed (cut off, or a model that forgot): still reasoning while it streams, as in vLLM.
    stream = _parser().stream()
    pieces = stream.push('<think>plan <tool_call>{"name": "a"}</tool_call>') + stream.finish()
    assert [p.kind for p in pieces] == ["reasoning"]


def test_a_long_call_is_scanned_once() -> None:
    stream = _parser().stream()
    stream.push('<tool_call>{"name": "a", "arguments": {"text": "')
    for _ in range(2000):
        assert stream.push("x" * 50) == []
    assert stream._scanned > 100_000  # the end marker is looked for only in what arrived since
    [piece] = stream.push('"}}</tool_call>')
    assert piece.call is not None and len(json.loads(piece.call["function"]["arguments"])["text"]) == 100_000


def test_plain_stream_passes_text_through() -> None:
    stream = NoToolParser().stream()
    assert stream.push(" <tool_call>x") == [StreamPiece("content", " <tool_call>x")]
    assert stream.push("") == [] and stream.finish("</tool_call> ") == [StreamPiece("content", "</tool_call> ")]
