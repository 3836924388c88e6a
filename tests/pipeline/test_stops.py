"""Stop strings on the returned text (router pipeline, stops): the text ends where the matched stop string starts
(where it ends with include_stop_str_in_output), never before min_tokens' text; streamed, every way of cutting a
text into deltas adds up to exactly that, and nothing past a possible stop string goes out early."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import pytest

from psrl.router.pipeline.context import Generation, SamplingSpec
from psrl.router.pipeline.stops import StopHoldBack, StreamedText, output_text, partial_match_start, stop_cut
from psrl.tokenizer import Tokenizer, build_tiny_tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer.from_folder(build_tiny_tokenizer(Path(tmp_path_factory.mktemp("tok"))))


def test_partial_match_start() -> None:
    assert partial_match_start("abc</an", "</answer>") == 3
    assert partial_match_start("abc<", "</answer>") == 3
    assert partial_match_start("abc", "</answer>") == 3
    assert partial_match_start("", "</answer>") == 0


def test_stop_cut() -> None:
    assert stop_cut("say </answer> and more", "</answer>", include=False) == 4
    assert stop_cut("say </answer> and more", "</answer>", include=True) == 13
    assert stop_cut("say nothing", "</answer>", include=False) is None
    # an occurrence before `search_from` (inside min_tokens' text) did not stop the replica
    assert stop_cut("ab.cd.", ".", include=False, search_from=3) == 5


# (text the ids decode to, the stop strings, the one the replica matched or None, include) -> the text returned
CASES = [
    ("Hello world. More", ["."], ".", False, "Hello world"),
    ("Hello world. More", ["."], ".", True, "Hello world."),
    ("xab-tail", ["ab", "b-"], "ab", False, "x"),  # the one completing first is what the replica matched
    ("abcd", ["abcd", "bc"], "bc", False, "a"),
    ("abcd", ["abcd", "bc"], "bc", True, "abc"),
    ("no stop here", ["STOP"], None, False, "no stop here"),
    ("ends with ST", ["STOP"], None, False, "ends with ST"),  # cut at max_tokens mid-prefix: all of it
    ("</answer>", ["</answer>"], "</answer>", False, ""),
    ("a<b<c<<stop>>", ["<<stop>>", "<b<x"], "<<stop>>", False, "a<b<c"),
    ("héllo wörld!", ["ö"], "ö", False, "héllo w"),
]


def _expected(text: str, matched: str | None, include: bool) -> str:
    cut = None if matched is None else stop_cut(text, matched, include)
    return text if cut is None else text[:cut]


@pytest.mark.parametrize(("text", "stops", "matched", "include", "want"), CASES)
def test_every_cut_into_deltas_adds_up_to_the_whole(
    text: str, stops: list[str], matched: str | None, include: bool, want: str
) -> None:
    assert _expected(text, matched, include) == want
    # every way of cutting the text into (up to four) deltas
    for k in range(min(len(text), 3) + 1):
        for cuts in itertools.combinations(range(1, len(text)), k):
            bounds = [0, *cuts, len(text)]
            deltas = [text[a:b] for a, b in itertools.pairwise(bounds)]
            held = StopHoldBack(stops, include)
            sent = ""
            for d in deltas:
                out = held.push(d)
                sent += out
                # never ahead of the answer: what went out is a prefix of it
                assert want.startswith(sent), (deltas, sent)
            assert sent + held.finish("", matched, 0) == want, deltas


def test_hold_back_is_only_what_could_still_be_a_stop_string() -> None:
    held = StopHoldBack(["</answer>"], include=False)
    assert held.push("The answer is 4 <") == "The answer is 4 "
    assert held.push("/ans") == ""
    assert held.push("wer") == ""
    assert held.push("ing") == "</answering"  # not a stop string after all
    assert held.push("</answer> trailing") == ""
    assert held.finish("", "</answer>", 0) == ""
    included = StopHoldBack(["</answer>"], include=True)
    assert included.push("4 </ans") == "4 </ans"  # kept either way
    assert included.push("wer> more") == "wer>"
    assert included.finish(" and more", "</answer>", 0) == ""


def test_a_stop_string_inside_min_tokens_does_not_cut(tok: Tokenizer) -> None:
    ids = tok.encode("a. b. c")
    sampling = SamplingSpec(stop=["."], min_tokens=len(tok.encode("a.")))
    gen = Generation(output_ids=ids, finish_reason="stop", matched_stop_str=".")
    assert output_text(tok, gen, sampling) == "a. b"
    streamed = StreamedText(tok, sampling)
    text = "".join(streamed.push([t]) for t in ids)
    assert text + streamed.finish(gen) == "a. b"


@pytest.mark.parametrize("include", [False, True])
def test_streamed_text_equals_the_non_streamed_text(tok: Tokenizer, include: bool) -> None:
    """Token by token or in random groups, with multi-byte characters: the same text as output_text."""
    rng = random.Random(7)
    texts = ["Thé answer: 42</answer>\nmore text", "plain text with no stop", "x</ans", "émoji 🙂 </answer>🙂 tail"]
    for text in texts:
        ids = tok.encode(text)
        whole = tok.decode(ids)
        matched = "</answer>" if "</answer>" in whole else None
        gen = Generation(output_ids=ids, finish_reason="stop" if matched else "length", matched_stop_str=matched)
        sampling = SamplingSpec(stop=["</answer>", "STOP"], include_stop_str_in_output=include)
        want = output_text(tok, gen, sampling)
        assert want == _expected(whole, matched, include)
        for _ in range(20):
            streamed, out, i = StreamedText(tok, sampling), "", 0
            while i < len(ids):
                n = rng.randint(1, 4)
                out += streamed.push(ids[i : i + n])
                i += n
            assert out + streamed.finish(gen) == want, text


def test_without_stop_strings_the_text_is_the_decoded_ids(tok: Tokenizer) -> None:
    ids = tok.encode("Hello there.")
    gen = Generation(output_ids=ids, finish_reason="length")
    streamed = StreamedText(tok, SamplingSpec())
    assert "".join(streamed.push([t]) for t in ids) + streamed.finish(gen) == output_text(tok, gen, SamplingSpec())
    assert output_text(tok, gen, SamplingSpec()) == "Hello there."
