"""Stop strings: the pure matcher, the incremental detector over a real tokenizer, and the engine's use of both."""

from __future__ import annotations

from dataclasses import replace

import pytest

from psrl.engine import InvalidSamplingError, SamplingOptions
from psrl.engine.stop_strings import StopStringDetector, StopStringMatcher
from psrl.tokenizer import IncrementalDecoder, Tokenizer

from .helpers import make_engine, prompts, run

# ---- StopStringMatcher ----------------------------------------------------------------------------


def feed_all(matcher: StopStringMatcher, pieces: list[str]) -> tuple[int, str] | None:
    """(index of the piece that completed a match, the stop string), or None."""
    for i, piece in enumerate(pieces):
        found = matcher.feed(piece)
        if found is not None:
            return i, found
    return None


def test_a_match_spanning_pieces_is_found_on_the_piece_completing_it() -> None:
    assert feed_all(StopStringMatcher(["cde"]), ["ab", "c", "d", "ef"]) == (3, "cde")
    assert feed_all(StopStringMatcher(["cde"]), ["abc", "dx", "e"]) is None


def test_only_text_after_the_last_piece_is_searched_again() -> None:
    matcher = StopStringMatcher(["xy", "a"])
    assert matcher.feed("bbb") is None
    assert matcher.feed("x") is None
    assert matcher.feed("y") == "xy"


def test_the_stop_string_ending_first_wins_then_list_order() -> None:
    # One piece completes both: the one that ends earlier in the text, as if fed a character at a time.
    assert StopStringMatcher(["world", "lo w"]).feed("hello world") == "lo w"
    assert StopStringMatcher(["b", "ab"]).feed("ab") == "b"  # same end: the earlier in the list
    assert StopStringMatcher(["ab", "b"]).feed("ab") == "ab"


def test_empty_pieces_and_single_character_stops() -> None:
    matcher = StopStringMatcher(["!"])
    assert matcher.feed("") is None
    assert matcher.feed("hi") is None
    assert matcher.feed("!") == "!"


def test_empty_stop_strings_are_refused() -> None:
    with pytest.raises(ValueError):
        StopStringMatcher([])
    with pytest.raises(ValueError):
        StopStringMatcher(["a", ""])


# ---- StopStringDetector over the tiny byte-level tokenizer ---------------------------------------


def first_stop(tokenizer: Tokenizer, ids: list[int], stops: list[str], skip: bool = True) -> int | None:
    detector = StopStringDetector(tokenizer, stops, skip_special_tokens=skip)
    return next((i for i, t in enumerate(ids) if detector.push(t) is not None), None)


def test_a_multi_byte_character_matches_only_once_its_last_byte_arrives(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("héllo 日本 wörld")
    pieces = [tokenizer.decode([t]) for t in ids]
    assert "\ufffd" in pieces  # the byte-level tokenizer splits these characters over several ids
    # "日" is three bytes, three ids: the match is on the third, not before.
    at = first_stop(tokenizer, ids, ["日"])
    assert at is not None and tokenizer.decode(ids[: at + 1]).endswith("日") and "日" not in tokenizer.decode(ids[:at])
    # A stop string across the end of one character and the start of the next.
    at = first_stop(tokenizer, ids, ["本 w"])
    assert at is not None and tokenizer.decode(ids[: at + 1]).endswith("本 w")
    # The replacement character of a sequence still incomplete never matches.
    assert first_stop(tokenizer, ids, ["\ufffd"]) is None


def test_special_tokens_match_only_when_decoded(tokenizer: Tokenizer) -> None:
    im_end = tokenizer.token_to_id("<|im_end|>")
    assert im_end is not None
    ids = [*tokenizer.encode("done"), im_end, *tokenizer.encode(" more")]
    assert first_stop(tokenizer, ids, ["<|im_end|>"], skip=False) == len(tokenizer.encode("done"))
    assert first_stop(tokenizer, ids, ["<|im_end|>"], skip=True) is None
    assert first_stop(tokenizer, ids, ["e m"], skip=True) == len(ids) - len(tokenizer.encode(" more"))


# ---- the engine -----------------------------------------------------------------------------------

SAMPLED = SamplingOptions(temperature=1.0, seed=7, max_tokens=40, ignore_eos=True)


def reference(tokenizer: Tokenizer) -> tuple[list[int], list[str], list[int]]:
    """A sampled run without stop strings: its ids, its incremental text pieces, and the text offset after
    each id."""
    (p,) = prompts([6])
    ids = run(make_engine(tokenizer=tokenizer), {"ref": (p, SAMPLED)})["ref"].token_ids
    decoder = IncrementalDecoder(tokenizer, skip_special_tokens=True)
    pieces = [decoder.push([t]) for t in ids]
    ends, text = [], ""
    for piece in pieces:
        text += piece
        ends.append(len(text))
    return ids, pieces, ends


def spanning_stop(ids: list[int], pieces: list[str], ends: list[int]) -> tuple[str, int]:
    """A stop string made of the last character of one piece and the first of the next (from the middle of
    the output), and the index of the id that completes it first (an id not seen before it, so that it can
    also serve as a stop id)."""
    text = "".join(pieces)
    for k in range(10, len(pieces)):
        if pieces[k - 1] and pieces[k]:
            stop = text[ends[k - 1] - 1 : ends[k - 1] + 1]
            at = next(i for i, end in enumerate(ends) if stop in text[:end])
            if ids[at] not in ids[:at]:
                return stop, at
    raise AssertionError("no usable stop string in this output")


def test_the_engine_stops_on_the_token_completing_a_stop_string(tokenizer: Tokenizer) -> None:
    ids, pieces, ends = reference(tokenizer)
    stop, at = spanning_stop(ids, pieces, ends)
    (p,) = prompts([6])
    engine = make_engine(tokenizer=tokenizer)
    runs = {
        "plain": (p, replace(SAMPLED, stop=(stop,))),
        "incl": (p, replace(SAMPLED, stop=("never there", stop), include_stop_str_in_output=True)),
        "len": (p, replace(SAMPLED, stop=(stop,), max_tokens=at + 1)),  # the stop string beats the length limit
    }
    out = run(engine, runs)
    for name in runs:  # ids up to and including the completing token, with or without the string in the text
        assert out[name].token_ids == ids[: at + 1], name
        assert out[name].finish_reason == "stop" and out[name].matched_stop_token_id is None, name
        assert out[name].last is not None and out[name].last.matched_stop_str == stop, name
    # A stop id on the same token stays the reason, unless the stop string's text is kept.
    by_id = replace(SAMPLED, stop=(stop,), stop_token_ids=(ids[at],))
    out = run(engine, {"id": (p, by_id), "text": (p, replace(by_id, include_stop_str_in_output=True))})
    assert [o.last.matched_stop_str if o.last else "?" for o in (out["id"], out["text"])] == [None, stop]
    assert [o.matched_stop_token_id for o in (out["id"], out["text"])] == [ids[at], None]
    assert out["id"].token_ids == out["text"].token_ids == ids[: at + 1]


def test_stop_strings_need_a_tokenizer_and_non_empty_strings(tokenizer: Tokenizer) -> None:
    with pytest.raises(InvalidSamplingError, match="tokenizer"):
        make_engine().add_request("a", [1, 2], SamplingOptions(stop=("x",)))
    with pytest.raises(InvalidSamplingError, match="empty string"):
        make_engine(tokenizer=tokenizer).add_request("a", [1, 2], SamplingOptions(stop=("x", "")))
