"""The tiny tokenizer: deterministic build, ChatML template with tool calls, zip round trip, streaming decode (also
around a SentencePiece tokenizer's special tokens, and when the library's stream fails)."""

from __future__ import annotations

import io
import zipfile
from pathlib import Path

import pytest
from tokenizers import SentencePieceBPETokenizer
from tokenizers.decoders import DecodeStream

from psrl.tokenizer import ChatTemplateError, IncrementalDecoder, Tokenizer, TokenizerLoadError, build_tiny_tokenizer
from psrl.tokenizer import tokenizer as tokenizer_module


def test_build_is_deterministic_and_idempotent(tmp_path: Path) -> None:
    a = build_tiny_tokenizer(tmp_path / "a")
    b = build_tiny_tokenizer(tmp_path / "b")
    assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()
    mtime = (a / "tokenizer.json").stat().st_mtime_ns
    build_tiny_tokenizer(a)
    assert (a / "tokenizer.json").stat().st_mtime_ns == mtime


def test_chatml_template_and_special_tokens(tokenizer: Tokenizer) -> None:
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = tokenizer.apply_chat_template(msgs)
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer.encode(text)
    assert ids.count(tokenizer.token_to_id("<|im_start|>")) == 3
    assert tokenizer.decode(ids, skip_special_tokens=False) == text
    assert tokenizer.eos_token_ids[0] == tokenizer.token_to_id("<|im_end|>")
    assert tokenizer.apply_chat_template(msgs, add_generation_prompt=False).endswith("<|im_end|>\n")


def test_tool_calls_and_results_render_like_qwen(tokenizer: Tokenizer) -> None:
    call = {"id": "1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    msgs = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "sunny"},
        {"role": "tool", "content": "warm"},
    ]
    text = tokenizer.apply_chat_template(msgs, tools=[{"type": "function", "function": {"name": "get_weather"}}])
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>' in text
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\nwarm" in text
    assert "<tools>\n" in text
    marker = tokenizer.token_to_id("<tool_call>")
    assert marker is not None and marker in tokenizer.encode(text)
    assert "<tool_call>" in tokenizer.decode(tokenizer.encode("<tool_call>x"), skip_special_tokens=True)


def test_template_errors_are_typed(tokenizer: Tokenizer) -> None:
    with pytest.raises(ChatTemplateError):
        tokenizer.apply_chat_template([{"role": "user"}])  # no content: the template cannot concatenate


def test_zip_round_trip_and_checks(model_dir: Path, tokenizer: Tokenizer) -> None:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            zf.write(model_dir / name, name)
    data = buf.getvalue()
    assert Tokenizer.from_zip_bytes(data).encode("hello world") == tokenizer.encode("hello world")
    with pytest.raises(TokenizerLoadError, match="sha256"):
        Tokenizer.from_zip_bytes(data, "0" * 64)
    with pytest.raises(TokenizerLoadError, match="not a zip"):
        Tokenizer.from_zip_bytes(b"nope")


def test_incremental_decoder_never_splits_characters(tokenizer: Tokenizer) -> None:
    text = "héllo 😀 wörld — ok"
    ids = tokenizer.encode(text)
    decoder = IncrementalDecoder(tokenizer)
    pieces = [decoder.push([i]) for i in ids]
    assert "".join(pieces) + decoder.flush() == text
    assert all("\ufffd" not in p for p in pieces)


SPECIALS = ["<s>", "</s>"]


@pytest.fixture(scope="module")
def sentencepiece_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    """A Metaspace tokenizer (SentencePiece style: a word's leading space is part of its token), with specials."""
    hf = SentencePieceBPETokenizer()
    texts = ["special tokens and words", "naïve café déjà vu"] * 20
    hf.train_from_iterator(texts, vocab_size=120, special_tokens=SPECIALS)
    folder = tmp_path_factory.mktemp("sp")
    hf.save(str(folder / "tokenizer.json"))
    return Tokenizer.from_folder(folder)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_incremental_pieces_add_up_to_the_text_around_special_tokens(
    sentencepiece_tokenizer: Tokenizer, skip_special_tokens: bool
) -> None:
    """A skipped special token between two words leaves the next word's space in the text: the pieces streamed
    one id at a time add up to the whole output decoded at once (a window decoded from the special token on
    used to drop that space)."""
    tok = sentencepiece_tokenizer
    end = tok.encode("</s>", add_special_tokens=False)
    ids = tok.encode("special", add_special_tokens=False) + end + tok.encode("tokens déjà", add_special_tokens=False)
    decoder = IncrementalDecoder(tok, skip_special_tokens)
    pieces = [decoder.push([i]) for i in ids]
    text = tok.decode(ids, skip_special_tokens)
    assert "".join(pieces) + decoder.flush() == text and " tokens" in text


class _Refusing:
    """DecodeStream, refusing the `fail_at`th step of the first stream made as the library refuses a window."""

    made: list[_Refusing] = []
    fail_at = 0
    error = "Invalid prefix encountered while decoding stream. Token ID: 7"

    def __init__(self, **kwargs: object) -> None:
        self._real = DecodeStream(**kwargs)  # type: ignore[arg-type]
        self.steps = 0
        _Refusing.made.append(self)

    def step(self, hf: object, ids: list[int]) -> str | None:
        self.steps += 1
        if self is _Refusing.made[0] and self.steps == _Refusing.fail_at:
            raise Exception(_Refusing.error)  # tokenizers raises a plain Exception
        return self._real.step(hf, ids)


def test_incremental_decoder_starts_a_new_stream_when_one_refuses_a_window(
    tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Wherever the library's stream refuses a window (also inside a multi-byte character), the pieces still
    add up to the text, never hold half a character, and a new stream carries on (not a whole decode per id)."""
    monkeypatch.setattr(tokenizer_module, "DecodeStream", _Refusing)
    text = "héllo 😀 wörld — ok"
    ids = tokenizer.encode(text)
    for fail_at in range(1, len(ids) - 1):
        _Refusing.made, _Refusing.fail_at = [], fail_at
        decoder = IncrementalDecoder(tokenizer)
        pieces = [decoder.push([i]) for i in ids]
        assert "".join(pieces) + decoder.flush() == text
        assert all("\ufffd" not in p for p in pieces)
        assert len(_Refusing.made) == 2 and _Refusing.made[1].steps > 0  # the rest went through the new stream


def test_incremental_decoder_raises_what_is_not_a_refused_window(
    tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tokenizer_module, "DecodeStream", _Refusing)
    monkeypatch.setattr(_Refusing, "error", "something else")
    _Refusing.made, _Refusing.fail_at = [], 1
    with pytest.raises(Exception, match="something else"):
        IncrementalDecoder(tokenizer).push(tokenizer.encode("hello"))


def test_encode_cache_returns_fresh_lists(tokenizer: Tokenizer) -> None:
    first = tokenizer.encode("the same prompt, many samples")
    first.append(-1)  # callers may mutate what they get
    again = tokenizer.encode("the same prompt, many samples")
    assert -1 not in again and again == first[:-1]


def test_long_texts_bypass_the_encode_cache(tokenizer: Tokenizer) -> None:
    from psrl.tokenizer.tokenizer import ENCODE_CACHE_MAX_CHARS

    long_text = "The quick brown fox. " * (ENCODE_CACHE_MAX_CHARS // 20)
    before = tokenizer._encode_cached.cache_info().currsize
    ids = tokenizer.encode(long_text)
    assert tokenizer._encode_cached.cache_info().currsize == before  # not kept
    assert ids == tokenizer._encode_list(long_text, False)


def _with_template(tokenizer: Tokenizer, template: str) -> Tokenizer:
    return Tokenizer(tokenizer._hf, {"chat_template": template})


def test_a_repeated_chat_renders_once(tokenizer: Tokenizer) -> None:
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    tools = [{"type": "function", "function": {"name": "f"}}]
    fresh = _with_template(tokenizer, tokenizer._template_text or "")
    first = fresh.apply_chat_template(msgs, tools=tools)
    assert fresh._render_cached.cache_info().misses == 1
    for _ in range(3):
        assert fresh.apply_chat_template(msgs, tools=tools) == first
    assert fresh._render_cached.cache_info().hits == 3
    assert first == fresh._render(msgs, tools, True, {})
    # what else the template reads is part of what is kept
    assert fresh.apply_chat_template(msgs, tools=tools, add_generation_prompt=False) != first
    assert fresh.apply_chat_template(msgs) != first


def test_kept_renders_follow_the_messages_as_they_are_now(tokenizer: Tokenizer) -> None:
    msgs = [{"role": "user", "content": "one"}]
    assert "one" in tokenizer.apply_chat_template(msgs)
    msgs[0]["content"] = "two"  # a caller may change its messages after a render
    assert "two" in tokenizer.apply_chat_template(msgs)
    msgs.append({"role": "assistant", "content": "three"})
    assert "three" in tokenizer.apply_chat_template(msgs)


@pytest.mark.parametrize(
    "values",
    [
        [1, 1.0, True, "1", None],  # equal, or alike in JSON, but rendered apart
        [0.0, -0.0, False, 0, ""],
        [[1, 2], {"1": 2}, {"a": 1, "b": 2}, {"b": 2, "a": 1}],  # a dict's order is what the template iterates
    ],
)
def test_inputs_a_template_tells_apart_get_their_own_render(tokenizer: Tokenizer, values: list[object]) -> None:
    tok = _with_template(tokenizer, "{{ messages[0]['content'] }}:{{ value }}:{{ value | tojson }}")
    msgs = [{"role": "user", "content": "x"}]
    for _ in range(2):
        for value in values:
            assert tok.apply_chat_template(msgs, value=value) == tok._render(msgs, None, True, {"value": value})


def test_errors_are_not_kept(tokenizer: Tokenizer) -> None:
    refusing = "{% if messages[0]['content'] == 'no' %}{{ raise_exception('refused') }}{% endif %}ok"
    tok = _with_template(tokenizer, refusing)
    for _ in range(2):
        with pytest.raises(ChatTemplateError, match="refused"):
            tok.apply_chat_template([{"role": "user", "content": "no"}])
    assert tok.apply_chat_template([{"role": "user", "content": "yes"}]) == "ok"
    assert tok._render_cached.cache_info().currsize == 1


def test_a_template_that_reads_the_clock_renders_every_time(
    tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    from datetime import datetime

    days = iter([datetime(2026, 12, 6), datetime(2026, 12, 7)])

    class Clock:
        @staticmethod
        def now() -> datetime:
            return next(days)

    monkeypatch.setattr(tokenizer_module, "datetime", Clock)
    tok = _with_template(tokenizer, "Today: {{ strftime_now('%d %b %Y') }}. {{ messages[0]['content'] }}")
    msgs = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(msgs) == "Today: 06 Dec 2026. hi"
    assert tok.apply_chat_template(msgs) == "Today: 07 Dec 2026. hi"
    assert tok._render_cached.cache_info().currsize == 0
    for unsteady in ("{{ messages | random }}", "{{ lipsum(1) }}", "{{ messages|random}}"):
        assert not _with_template(tokenizer, unsteady)._renders_keep
    assert _with_template(tokenizer, "{# answer randomly #}{{ messages[0]['content'] }}")._renders_keep


def test_long_or_unwritable_inputs_render_without_the_cache(tokenizer: Tokenizer) -> None:
    from psrl.tokenizer.tokenizer import RENDER_CACHE_MAX_BYTES

    tok = _with_template(tokenizer, "{{ messages[0]['content'] | length }} {{ value }}")
    long_msgs = [{"role": "user", "content": "x" * RENDER_CACHE_MAX_BYTES}]
    assert tok.apply_chat_template(long_msgs, value=1) == f"{RENDER_CACHE_MAX_BYTES} 1"

    class Named:  # not a JSON value: marshal cannot write it
        def __str__(self) -> str:
            return "named"

    assert tok.apply_chat_template([{"role": "user", "content": "ab"}], value=Named()) == "2 named"
    assert tok._render_cached.cache_info().currsize == 0


def test_encode_ids_are_the_encoding_in_fresh_arrays(tokenizer: Tokenizer) -> None:
    from array import array

    from psrl.tokenizer.tokenizer import ENCODE_CACHE_MAX_CHARS

    for text in ("the same prompt, many samples", "The quick brown fox. " * (ENCODE_CACHE_MAX_CHARS // 20)):
        first = tokenizer.encode_ids(text)
        assert isinstance(first, array) and first.typecode == "I"
        assert first.tolist() == tokenizer.encode(text) == tokenizer._encode_list(text, False)
        first.append(0)  # the caller's own copy
        assert tokenizer.encode_ids(text).tolist() == tokenizer.encode(text)
