"""A model's tokenizer: `tokenizers` for ids, its Jinja chat template for messages, incremental detokenizing.

Loads `tokenizer.json` + `tokenizer_config.json` from a folder (or from the zip a worker streams with
GetTokenizer), so the router never needs `transformers` or a model hub.
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import marshal
import re
import tempfile
import zipfile
from array import array
from collections.abc import Sequence
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
import jinja2.sandbox
from tokenizers import Tokenizer as _HFTokenizer
from tokenizers.decoders import DecodeStream

ENCODE_CACHE_ENTRIES = 1024
_INVALID_PREFIX = "Invalid prefix encountered"  # how DecodeStream.step's refusal of a window begins
# Texts longer than this are encoded without the cache: 1024 long-context prompts would hold gigabytes.
ENCODE_CACHE_MAX_CHARS = 32_768
# The chat template's renders, by their inputs (written with marshal); inputs longer than this are not kept.
RENDER_CACHE_ENTRIES = 1024
RENDER_CACHE_MAX_BYTES = 32_768
# What a template can call that does not give the same text every time (the clock, jinja's random filter and
# lorem ipsum): a template that names one is rendered every time.
_UNSTEADY = re.compile(r"\b(?:strftime_now|random|lipsum)\b")
# marshal's format 2 writes every value whole (later formats refer back to objects seen twice, by reference count).
_MARSHAL_VERSION = 2


class TokenizerLoadError(RuntimeError):
    """The tokenizer folder or archive is missing files or holds something we cannot read."""


class ChatTemplateError(ValueError):
    """The chat template refused the messages (it raised) or could not be rendered."""


class InvalidTextError(ValueError):
    """The text cannot be tokenized: it holds a lone UTF-16 surrogate (e.g. from a JSON "\\ud800" escape),
    which is no Unicode character and has no UTF-8 bytes."""


# What apply_chat_template passes to the template itself: extra template variables may not name them.
TEMPLATE_CALL_ARGS = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"})


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _token_content(value: Any) -> str | None:
    """tokenizer_config.json stores special tokens either as a string or as an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value


class Tokenizer:
    """Token ids <-> text, and chat messages -> prompt text through the model's template."""

    def __init__(self, hf: _HFTokenizer, config: dict[str, Any], source: str = "") -> None:
        self._hf = hf
        self.config = config
        self.source = source
        template = config.get("chat_template")
        if isinstance(template, list):  # the named-template form: take "default"
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default") or next(iter(named.values()), None)
        self._template_text: str | None = template
        self.eos_token: str | None = _token_content(config.get("eos_token"))
        self.bos_token: str | None = _token_content(config.get("bos_token"))
        self.pad_token: str | None = _token_content(config.get("pad_token"))
        self._encode_cached = functools.lru_cache(maxsize=ENCODE_CACHE_ENTRIES)(self._encode_array)
        self._render_cached = functools.lru_cache(maxsize=RENDER_CACHE_ENTRIES)(self._render_marshalled)
        self._renders_keep = isinstance(template, str) and _UNSTEADY.search(template) is None

    # ---- loading -------------------------------------------------------------------------------

    @classmethod
    def from_folder(cls, folder: str | Path) -> Tokenizer:
        folder = Path(folder)
        tok_file = folder / "tokenizer.json"
        if not tok_file.is_file():
            raise TokenizerLoadError(f"{folder} has no tokenizer.json")
        try:
            hf = _HFTokenizer.from_file(str(tok_file))
        except Exception as e:  # the library raises its own exception type
            raise TokenizerLoadError(f"cannot read {tok_file}: {e}") from e
        config: dict[str, Any] = {}
        cfg_file = folder / "tokenizer_config.json"
        if cfg_file.is_file():
            config = json.loads(cfg_file.read_text())
        jinja_file = folder / "chat_template.jinja"
        if "chat_template" not in config and jinja_file.is_file():
            config["chat_template"] = jinja_file.read_text()
        return cls(hf, config, source=str(folder))

    @classmethod
    def from_zip_bytes(cls, data: bytes, expected_sha256: str | None = None) -> Tokenizer:
        """Build from the archive a worker's GetTokenizer streams (checked against its sha256)."""
        if expected_sha256:
            got = hashlib.sha256(data).hexdigest()
            if got != expected_sha256:
                raise TokenizerLoadError(f"tokenizer archive sha256 {got} != announced {expected_sha256}")
        try:
            with tempfile.TemporaryDirectory() as tmp, zipfile.ZipFile(io.BytesIO(data)) as zf:
                for name in zf.namelist():
                    if "/" in name or name.startswith("."):
                        raise TokenizerLoadError(f"unexpected entry {name!r} in tokenizer archive")
                zf.extractall(tmp)
                return cls.from_folder(tmp)
        except zipfile.BadZipFile as e:
            raise TokenizerLoadError(f"tokenizer archive is not a zip: {e}") from e

    # ---- ids ----------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self._hf.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._hf.token_to_id(token)

    @cached_property
    def eos_token_ids(self) -> tuple[int, ...]:
        ids = []
        for tok in (self.eos_token, "<|endoftext|>", "<|im_end|>"):
            tid = self._hf.token_to_id(tok) if tok else None
            if tid is not None and tid not in ids:
                ids.append(tid)
        return tuple(ids)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Raises InvalidTextError for text that is not valid Unicode (a lone surrogate)."""
        # RL rollouts send each prompt many times (a group of samples per prompt): remember recent encodings.
        if len(text) > ENCODE_CACHE_MAX_CHARS:
            return self._encode_list(text, add_special_tokens)
        return self._encode_cached(text, add_special_tokens).tolist()

    def encode_ids(self, text: str, add_special_tokens: bool = False) -> array[int]:
        """As `encode`, in an array('I'), 4 bytes an id: a prompt the router sends, which is packed as it is and
        never needs an int per id. A copy of the kept encoding (a memcpy): the caller may change it."""
        if len(text) > ENCODE_CACHE_MAX_CHARS:
            return self._encode_array(text, add_special_tokens)
        return array("I", self._encode_cached(text, add_special_tokens))

    def _encode_array(self, text: str, add_special_tokens: bool) -> array[int]:
        return array("I", self._encode_list(text, add_special_tokens))

    def _encode_list(self, text: str, add_special_tokens: bool) -> list[int]:
        try:
            return self._hf.encode(text, add_special_tokens=add_special_tokens).ids
        except (TypeError, ValueError):  # the library's answer to a str with no UTF-8 form: diagnosed only then
            position = lone_surrogate_at(text) if isinstance(text, str) else None
            if position is None:
                raise
            raise InvalidTextError(
                f"the text holds a lone surrogate {text[position]!a} at character {position}, which is not valid "
                "Unicode"
            ) from None

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    # ---- chat template ------------------------------------------------------------------------

    @cached_property
    def _template(self) -> jinja2.Template:
        if not self._template_text:
            raise ChatTemplateError("this tokenizer has no chat_template")
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = lambda v, indent=None, ensure_ascii=False, **_: json.dumps(
            v, indent=indent, ensure_ascii=ensure_ascii
        )
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            return env.from_string(self._template_text)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template does not compile: {e}") from e

    def apply_chat_template(
        self,
        messages: Sequence[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[dict[str, Any]] | None = None,
        **extra: Any,
    ) -> str:
        """The template's text for these messages. RL rollouts send each prompt many times (a group of samples),
        so recent renders are kept, by their inputs written with marshal: its bytes read back as the same values
        (dicts in their order, a float apart from an int, a bool from an int), so two inputs share a render only
        if the template could not tell them apart (but by identity: jinja's `sameas` on one dict given twice).
        Inputs marshal cannot write (only objects not from JSON) and long ones render each time."""
        taken = TEMPLATE_CALL_ARGS.intersection(extra)
        if taken:
            raise ChatTemplateError(f"template variables {sorted(taken)} are set by the template call itself")
        inputs = (list(messages), list(tools) if tools else None, add_generation_prompt, extra)
        if self._renders_keep:
            try:
                key = marshal.dumps(inputs, _MARSHAL_VERSION)
            except ValueError:  # an object marshal cannot write
                key = b""
            if 0 < len(key) <= RENDER_CACHE_MAX_BYTES:
                return self._render_cached(key)
        return self._render(*inputs)

    def _render_marshalled(self, key: bytes) -> str:
        return self._render(*marshal.loads(key))

    def _render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        add_generation_prompt: bool,
        extra: dict[str, Any],
    ) -> str:
        try:
            return self._template.render(
                messages=messages,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                **extra,
            )
        except ChatTemplateError:
            raise
        except (jinja2.TemplateError, TypeError, KeyError, AttributeError) as e:
            raise ChatTemplateError(f"chat template failed on these messages: {e}") from e


_SURROGATE = re.compile("[\ud800-\udfff]")


def lone_surrogate_at(text: str) -> int | None:
    """The index of the first lone surrogate in `text`, or None. ASCII text (the common case) is not scanned:
    str.isascii() is O(1) in CPython."""
    if text.isascii():
        return None
    found = _SURROGATE.search(text)
    return None if found is None else found.start()


class IncrementalDecoder:
    """Turns a growing list of ids into text deltas without emitting half of a multi-byte character.

    The library's DecodeStream does it, one call per push: it decodes a small window (the ids since the last
    clean boundary), so the cost per streamed token stays constant, and returns what the window's text adds
    (nothing while the text ends in an incomplete UTF-8 sequence). `flush` decodes the whole output once, so the
    deltas and what it returns add up to the output's text.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._hf = tokenizer._hf
        self._skip = skip_special_tokens
        self._stream: DecodeStream | None = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._ids: list[int] = []
        self._emitted = 0  # characters returned so far

    def push(self, new_ids: Sequence[int]) -> str:
        self._ids.extend(new_ids)
        delta: str | None = None
        if self._stream is not None:
            try:
                delta = self._stream.step(self._hf, new_ids)
            except Exception as e:
                if not str(e).startswith(_INVALID_PREFIX):
                    raise
                self._stream = None
        if self._stream is None:
            delta = self._restart()
        if not delta:
            return ""
        self._emitted += len(delta)
        return delta

    def _restart(self) -> str | None:
        """After the stream refused a window (its text no longer began with the text before it: a decoder that
        rewrites earlier text): what the whole output's text adds. Once that text ends in a whole character, a
        new stream starts after it (one started inside a character would return the whole text again)."""
        text = self._hf.decode(self._ids, skip_special_tokens=self._skip)
        if text.endswith("\ufffd"):
            return None
        self._stream = DecodeStream(ids=self._ids, skip_special_tokens=self._skip)
        return text[self._emitted :]

    def flush(self) -> str:
        """Whatever is left at the end of the stream (replacement chars included)."""
        text = self._hf.decode(self._ids, skip_special_tokens=self._skip)
        rest = text[self._emitted :]
        self._emitted = len(text)
        return rest
