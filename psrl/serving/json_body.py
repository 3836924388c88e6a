"""JSON request bodies parsed with explicit bounds, so a hostile body is a client error and never a crash:
nesting deeper than `MAX_JSON_DEPTH` and integer literals longer than Python's digit limit are refused."""

from __future__ import annotations

import json
import re
import sys
from typing import Any

import msgspec
import numpy as np

from psrl._wire import json_opens, json_take_token_ids

# Deeper than any real request (tool schemas nest a few dozen levels) and far below the interpreter's
# recursion limit, so neither json.loads nor later code that walks the value (json.dumps, templates) recurses
# out of stack.
MAX_JSON_DEPTH = 256
# A decoded str can hold a lone surrogate only through a \uD800-\uDFFF escape (UTF-8 has no bytes for one).
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")

_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
_NOT_BRACKETS = bytes(range(256)).translate(None, b"[]{}")
# Brackets as bytes one above (an opening one) or one below (a closing one) zero, for a cumulative sum.
_BRACKET_STEPS = bytes.maketrans(b"[{]}", b"\x02\x02\x00\x00")
_CHUNK = 1 << 20  # brackets per cumulative-sum step: bounds the scan's temporary memory
_FAST_DECODER = msgspec.json.Decoder()


class JsonBodyError(ValueError):
    """The body is not JSON we accept; the message names the problem for the client, and `detail` the problem
    alone (for a message about a JSON-holding field rather than a body)."""

    def __init__(self, message: str, detail: str) -> None:
        super().__init__(message)
        self.detail = detail


def _opens(text: str) -> int:
    return text.count("[") + text.count("{")


def nesting_depth_exceeds(text: str, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether the brackets of `text`, outside its strings, nest deeper than `limit`. Linear and in C: a
    body that opens at most `limit` brackets cannot nest deeper, which spares almost every request the scan."""
    if _opens(text) <= limit:
        return False
    structure = _STRING.sub("", text)  # brackets inside strings do not nest
    if _opens(structure) <= limit:
        return False
    brackets = structure.encode("utf-8", "surrogatepass").translate(_BRACKET_STEPS, _NOT_BRACKETS)
    steps = np.frombuffer(brackets, dtype=np.uint8)
    depth = 0
    for start in range(0, len(steps), _CHUNK):
        running = np.cumsum(steps[start : start + _CHUNK], dtype=np.int64)
        running -= np.arange(1, len(running) + 1)  # each step was stored one above its value
        running += depth
        if int(running.max()) > limit:
            return True
        depth = int(running[-1])
    return False


def loads_bounded(raw: bytes | str) -> Any:
    """`json.loads` of a request body (UTF-8, -16 or -32, as json detects it; or text already decoded, such as
    a string field holding JSON), or a JsonBodyError.

    A UTF-8 body that opens too few brackets to nest too deep is first given to msgspec's decoder, several
    times faster on token-id lists; it gives the same value wherever it accepts a document. What it refuses
    (other encodings, a BOM, lone surrogates, NaN, a literal beyond float range, malformed JSON) goes on to
    `json`, whose verdict and message stand."""
    if isinstance(raw, bytes) and json_opens(raw) <= MAX_JSON_DEPTH:
        try:
            return _FAST_DECODER.decode(raw)
        except (msgspec.DecodeError, msgspec.ValidationError):
            pass
    if isinstance(raw, str):
        text = raw
    else:
        try:
            text = raw.decode(json.detect_encoding(raw), "surrogatepass")
        except UnicodeDecodeError as e:
            raise JsonBodyError(f"request body is not valid JSON: {e}", str(e)) from None
    if nesting_depth_exceeds(text):
        detail = f"nested deeper than {MAX_JSON_DEPTH} levels"
        raise JsonBodyError(f"request body is {detail}", detail)
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise JsonBodyError(f"request body is not valid JSON: {e}", str(e)) from None
    except ValueError:  # the only other ValueError json raises: int() refusing a very long literal
        detail = f"an integer literal longer than {sys.get_int_max_str_digits()} digits"
        raise JsonBodyError(f"request body has {detail}", detail) from None


def loads_token_ids(raw: bytes | str, field: str) -> Any:
    """`loads_bounded(raw)`, except that where the body is an object whose `field` is a flat array of token ids
    (non-negative integer literals below 2**32), that field's value is an array('I') of them.

    The ids are read from their digits in C and taken out of the text (`json_take_token_ids`), and msgspec
    decodes the rest: the same value as one decode of the body, but the ids never become Python ints, and the
    decoder reads only the rest. A body that is anything else, or whose rest msgspec refuses, takes
    `loads_bounded`'s way and gets its value or its error."""
    if isinstance(raw, bytes) and json_opens(raw) <= MAX_JSON_DEPTH:
        taken = json_take_token_ids(raw, field)
        if taken is not None:
            try:
                body = _FAST_DECODER.decode(taken[1])
            except (msgspec.DecodeError, msgspec.ValidationError):
                pass
            else:
                body[field] = taken[0]
                return body
    return loads_bounded(raw)


def may_hold_surrogates(raw: bytes) -> bool:
    """Whether JSON `raw` may decode to a string with a surrogate: only then need its strings be checked
    (a C-speed scan of the bytes instead of a walk over every decoded string)."""
    return _SURROGATE_ESCAPE.search(raw) is not None
