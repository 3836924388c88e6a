"""The bounded JSON parser both servers share (pure, no server): nesting is measured outside strings, at
the documented limit, and every refusal is a JsonBodyError naming the problem."""

from __future__ import annotations

import json
import re
from array import array
from typing import Any

import pytest

from psrl.serving.json_body import (
    MAX_JSON_DEPTH,
    JsonBodyError,
    loads_bounded,
    loads_token_ids,
    may_hold_surrogates,
    nesting_depth_exceeds,
)


def _chain(depth: int) -> str:
    value: object = 1
    for i in range(depth):
        value = [value, {"k": "[[{"}] if i % 2 else {"v": value, "s": "]]}"}
    return json.dumps(value)


@pytest.mark.parametrize("depth", [1, 100, MAX_JSON_DEPTH - 1, MAX_JSON_DEPTH])
def test_depth_up_to_the_limit_is_accepted(depth: int) -> None:
    text = "[" * depth + "]" * depth
    assert not nesting_depth_exceeds(text)
    assert loads_bounded(text.encode()) is not None


def test_depth_counts_brackets_outside_strings_only() -> None:
    assert not nesting_depth_exceeds(json.dumps({"s": "[" * 5000, "t": '\\"[' * 5000}))
    assert not nesting_depth_exceeds("[]" * 50_000)  # many brackets, shallow
    assert nesting_depth_exceeds("[]" * 50_000 + "[" * (MAX_JSON_DEPTH + 1))
    # one level per step, brackets in strings at every level, sibling objects as deep as the innermost value
    assert not nesting_depth_exceeds(_chain(MAX_JSON_DEPTH))
    assert nesting_depth_exceeds(_chain(MAX_JSON_DEPTH + 1))


@pytest.mark.parametrize(
    ("raw", "words"),
    [
        (b"[" * 200_000, f"nested deeper than {MAX_JSON_DEPTH}"),
        (b"[" * 2000 + b"]" * 2000, f"nested deeper than {MAX_JSON_DEPTH}"),
        (b"1" * 5000, "longer than 4300 digits"),
        (b"{not json", "not valid JSON"),
        (b"\xff\xfe\xfd", "not valid JSON"),
        (b"", "not valid JSON"),
    ],
)
def test_refusals_name_the_problem(raw: bytes, words: str) -> None:
    with pytest.raises(JsonBodyError, match=words):
        loads_bounded(raw)


def test_values_parse_as_json_loads_does() -> None:
    for value in ({"a": [1, 2.5, None, True, "é\ud800"]}, [], "x", 10**4000):
        raw = json.dumps(value).encode()
        assert loads_bounded(raw) == json.loads(raw)
    assert loads_bounded('{"a": 1}'.encode("utf-16")) == {"a": 1}


@pytest.mark.parametrize(
    "raw",
    [
        b'{"input_ids": [1, 2, 3], "sampling_params": {"temperature": 0.7, "top_p": 1e-3}}',
        b'{"a": -0.0, "b": 1.0000000000000002, "c": 0.1e-400, "d": 1.5e308, "e": 1E+2}',
        b'{"a": 123456789012345678901234567890, "b": 18446744073709551616, "c": -9223372036854775809}',
        b'{"a": 1, "a": 2}',  # the last one wins
        b'{"a": "\\u0000 \\" \\t", "b": "\xc3\xa9 \\ud83d\\ude00"}',
        # refused by the fast decoder, accepted by json: the same value still
        b'{"a": "\\ud800"}',
        b'{"a": NaN, "b": Infinity, "c": 1e400}',
        b'\xef\xbb\xbf{"a": 1}',
    ],
)
def test_both_decoders_give_json_loads_value(raw: bytes) -> None:
    expected = json.loads(raw.decode(json.detect_encoding(raw), "surrogatepass"))
    got = loads_bounded(raw)
    assert repr(got) == repr(expected)  # repr: NaN, -0.0 and int-vs-float all count


def test_a_fast_decoder_refusal_is_json_refusal() -> None:
    """Malformed bodies fail in both decoders; the message is json's, as before the fast path."""
    for raw in (b'{"a": 01}', b'{"a": 1}  x', b'{"a": .5}', b'{"a": "\t"}', b"[1,]"):
        for loads in (loads_bounded, lambda raw: loads_token_ids(raw, "a")):
            with pytest.raises(JsonBodyError) as ours:
                loads(raw)
            with pytest.raises(json.JSONDecodeError) as theirs:
                json.loads(raw)
            assert str(ours.value) == f"request body is not valid JSON: {theirs.value}"


def _as_lists(value: Any) -> Any:
    return (
        {k: v.tolist() if isinstance(v, array) else v for k, v in value.items()} if isinstance(value, dict) else value
    )


@pytest.mark.parametrize(
    ("raw", "read_as_array"),
    [
        (b'{"model": "m", "input_ids": [1, 2, 4294967295], "sampling_params": {"max_new_tokens": 1}}', True),
        (b'{ "input_ids" : [ 0 ] , "x" : [1.5, "\\u00e9", null] }', True),
        (b'{"input_ids": [7, 8], "a": 123456789012345678901234567890}', True),
        (b'{"input_ids": "text", "input_ids": [7, 8]}', False),  # twice: json's way, where the last one wins
        (b'{"input_ids": [7, 8], "input_ids": "text"}', False),
        (b'{"input_ids": [[1, 2], [3]], "a": 1}', False),  # a batch: decoded as JSON
        (b'{"input_ids": [1, -2, 3.0, 1e2]}', False),
        (b'{"input_ids": [4294967296], "b": 18446744073709551616}', False),
        (b'{"input_ids": [], "text": "hi"}', False),
        (b'{"text": "no ids"}', False),
        # refused by msgspec, so decoded by json as loads_bounded does: the ids as a list
        (b'{"input_ids": [1], "a": "\\ud800", "b": NaN}', False),
        (b'{"input_ids": [1], "s": "\xff"}', False),
        (b'\xef\xbb\xbf{"input_ids": [1]}', False),
        ('{"input_ids": [1, 2]}'.encode("utf-16"), False),
        (b"[1, 2, 3]", False),
        (b'"input_ids"', False),
        (b'{"input_ids": [01]}', False),
    ],
)
def test_token_ids_field_has_json_loads_value(raw: bytes, read_as_array: bool) -> None:
    """The ids field as an array('I') where it is a flat array of ids; everything else, and the value as a
    whole, as loads_bounded gives it (so as json.loads does), or the same refusal."""
    try:
        expected = loads_bounded(raw)
    except JsonBodyError as e:
        with pytest.raises(JsonBodyError, match=re.escape(str(e))):
            loads_token_ids(raw, "input_ids")
        assert not read_as_array
        return
    got = loads_token_ids(raw, "input_ids")
    assert repr(_as_lists(got)) == repr(expected)
    assert _holds_array(got) == read_as_array
    if read_as_array:
        assert isinstance(got["input_ids"], array) and got["input_ids"].typecode == "I"


def _holds_array(value: Any) -> bool:
    return isinstance(value, dict) and any(isinstance(v, array) for v in value.values())


def test_token_ids_field_is_bounded_as_any_body() -> None:
    deep = b'{"input_ids": [1], "x": ' + b"[" * 300 + b"]" * 300 + b"}"
    with pytest.raises(JsonBodyError, match=f"nested deeper than {MAX_JSON_DEPTH}"):
        loads_token_ids(deep, "input_ids")
    with pytest.raises(JsonBodyError, match="longer than 4300 digits"):
        loads_token_ids(b'{"input_ids": [1], "x": ' + b"1" * 5000 + b"}", "input_ids")


def test_only_a_surrogate_escape_makes_a_body_need_its_strings_checked() -> None:
    assert may_hold_surrogates(b'{"content": "ok \\ud800"}') and may_hold_surrogates(b'["\\uDFFF"]')
    assert may_hold_surrogates(b'["\\ud83d\\ude00"]')  # a pair: checked, and found valid
    assert not may_hold_surrogates('{"content": "caf\u00e9 \U0001f600 \\u00e9 \\uE000"}'.encode())


def test_token_ids_of_text_already_decoded_are_loads_bounded_value() -> None:
    """A str (a JSON-holding field's text) takes loads_bounded's way: the ids as a list."""
    assert loads_token_ids('{"input_ids": [1, 2], "a": "é"}', "input_ids") == {"input_ids": [1, 2], "a": "é"}
