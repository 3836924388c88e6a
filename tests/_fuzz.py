"""Fuzzing helpers shared by tests/reliability/test_fuzz_*.py and test_soak.py: hypothesis strategies for the
README's request shapes and their mutations, a sender that classifies every answer, and the leak checks.

An example never raises inside hypothesis: each answer is classified and a bad one recorded under a signature
(service, route, status, cause), so one bounded run reports every distinct failure once, with the exact request
that showed it and the traceback the server logged, instead of one shrunk failure per run.
"""

from __future__ import annotations

import copy
import json
import os
import re
import time
import urllib.parse
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

INT32_MAX, UINT32_MAX, INT64_MAX, UINT64_MAX = 2**31 - 1, 2**32 - 1, 2**63 - 1, 2**64 - 1
VOCAB = 704  # the tiny model's vocabulary
CHEAP_MAX_TOKENS = 8  # what a valid request may generate here: the fuzz is about parsing, not decoding

FUZZ_SETTINGS = {
    "deadline": None,
    "derandomize": True,
    "database": None,
    "suppress_health_check": [
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.filter_too_much,
        HealthCheck.large_base_example,
    ],
}


def fuzz_settings(max_examples: int) -> settings:
    """Fixed example counts (scaled by $PSRL_FUZZ_SCALE for a quicker or a longer local run), derandomized."""
    scale = float(os.environ.get("PSRL_FUZZ_SCALE", "1"))
    return settings(max_examples=max(1, round(max_examples * scale)), **FUZZ_SETTINGS)


# ---- JSON values and their encoding -------------------------------------------------------------------------


@dataclass(frozen=True)
class RawJson:
    """A JSON value given as its exact bytes: what json.dumps cannot write (integer literals past Python's
    digit limit, nesting past the recursion limit, invalid UTF-8, NaN spelled differently)."""

    raw: bytes

    def __repr__(self) -> str:
        head = self.raw[:40]
        return f"RawJson({head!r}{'...' if len(self.raw) > 40 else ''} {len(self.raw)} bytes)"


def encode_json(value: Any, ensure_ascii: bool = True) -> bytes:
    """JSON bytes of `value` (RawJson leaves inserted as they are). With ensure_ascii=False a lone surrogate
    goes out as its raw (invalid) UTF-8 bytes instead of a `\\ud800` escape."""
    out: list[bytes] = []
    _encode(value, ensure_ascii, out)
    return b"".join(out)


def _encode(value: Any, ensure_ascii: bool, out: list[bytes]) -> None:
    if isinstance(value, RawJson):
        out.append(value.raw)
    elif isinstance(value, dict):
        out.append(b"{")
        for i, (k, v) in enumerate(value.items()):
            if i:
                out.append(b", ")
            _encode(str(k), ensure_ascii, out)
            out.append(b": ")
            _encode(v, ensure_ascii, out)
        out.append(b"}")
    elif isinstance(value, list | tuple):
        out.append(b"[")
        for i, v in enumerate(value):
            if i:
                out.append(b", ")
            _encode(v, ensure_ascii, out)
        out.append(b"]")
    else:
        out.append(json.dumps(value, ensure_ascii=ensure_ascii).encode("utf-8", "surrogatepass"))


INT_EDGES = [
    -1,
    0,
    1,
    2,
    7,
    -(2**31) - 1,
    -(2**31),
    INT32_MAX,
    2**31,
    UINT32_MAX,
    2**32,
    2**53 + 1,
    INT64_MAX,
    2**63,
    -(2**63) - 1,
    UINT64_MAX,
    2**64,
    10**30,
    -(10**30),
]
FLOAT_EDGES = [0.0, -0.0, 5e-324, 1e-7, 0.5, 1.0, 1.0000001, 2.0, 2.5, -1.5, 1e308, -1e308]
ODD_STRINGS = [
    "",
    " ",
    "\x00",
    "\ud800",  # lone surrogates: json escapes them; ensure_ascii=False sends their raw bytes
    "\udfff",
    "a\udc80b",
    "\ufeff",
    "\u202e",
    "\U0001f600",
    "e\u0301",
    "\u00e9" * 3,
    "<|im_end|>",
    "<|im_start|>system\n",
    "<|endoftext|>",
    "<tool_call>",
    '<tool_call>{"name": "f", "arguments": {}}</tool_call>',
    "<think>",
    "</think>",
    "{{ messages }}",
    "{% for m in messages %}",
    "\n\n\n",
    "\r\n",
    "\\",
    '"',
    "null",
    "-1",
    "9" * 40,
    "model",
]
# Deep nesting, huge literals, bytes that are no UTF-8, non-standard numbers: sent exactly as written.
RAW_VALUES = [
    RawJson(b"9" * 5000),
    RawJson(b"-" + b"9" * 4400),
    RawJson(b"1" + b"0" * 400),
    RawJson(b"1e999"),
    RawJson(b"-1e999"),
    RawJson(b"1e-999"),
    RawJson(b"NaN"),
    RawJson(b"Infinity"),
    RawJson(b"-Infinity"),
    RawJson(b"[" * 100_000 + b"]" * 100_000),
    RawJson(b'{"a": ' * 3000 + b"1" + b"}" * 3000),
    RawJson(b"[" * 1200 + b"]" * 1200),
    RawJson(b"[" * 250 + b"1" + b"]" * 250),
    RawJson(b'"\xff\xfe"'),
    RawJson(b'"\xed\xa0\x80"'),  # a lone surrogate's raw bytes (CESU-8)
    RawJson(b'"\xc0\xaf"'),  # an overlong encoding
    RawJson(b'"\\ud800"'),
    RawJson(b'"\\udc00\\ud800"'),
    RawJson(b'"\\u0000"'),
    RawJson(b'"' + b"a" * 200_000 + b'"'),
    RawJson(b'"' + "\u00e9".encode() * 50_000 + b'"'),
]


def odd_text(max_size: int = 24) -> st.SearchStrategy[str]:
    """Text a client might send: mostly ordinary, sometimes surrogates, control and special-token text."""
    return st.one_of(
        st.text(max_size=max_size),
        st.text(max_size=max_size),
        st.text(max_size=max_size),
        st.sampled_from(ODD_STRINGS),
        st.lists(st.sampled_from(ODD_STRINGS), min_size=2, max_size=4).map("".join),
    )


def header_value(text: str) -> str:
    """`text` as a value HTTP/1.1 can carry (h11 refuses CR, LF, NUL, other controls and edge whitespace): its
    UTF-8 bytes with those removed, as the latin-1 string the wire sees."""
    raw = bytes(b for b in text.encode("utf-8", "surrogatepass") if 0x20 <= b <= 0x7E or b >= 0x80)
    return raw.decode("latin-1").strip(" ")


def plain_text(max_size: int = 24) -> st.SearchStrategy[str]:
    return st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=max_size)


def scalar() -> st.SearchStrategy[Any]:
    return st.one_of(
        st.none(),
        st.booleans(),
        st.sampled_from(INT_EDGES),
        st.integers(),
        st.sampled_from(FLOAT_EDGES),
        st.floats(allow_nan=True, allow_infinity=True),
        odd_text(),
    )


def weird_value() -> st.SearchStrategy[Any]:
    """What a mutation puts where a field's value was: any type, any range, or raw bytes."""
    small = st.recursive(
        scalar(),
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(odd_text(8), inner, max_size=3),
        max_leaves=6,
    )
    return st.one_of(scalar(), small, st.sampled_from(RAW_VALUES))


# ---- the README's request shapes ------------------------------------------------------------------------


def _opt(required: dict[str, st.SearchStrategy], optional: dict[str, st.SearchStrategy]) -> st.SearchStrategy[dict]:
    return st.fixed_dictionaries(required, optional=optional)


def _model(served: str, *unknown: str) -> st.SearchStrategy[str]:
    """The served model most of the time, sometimes one nobody serves."""
    return st.sampled_from([served] * 6 + list(unknown))


def token_ids(min_size: int = 1, max_size: int = 12) -> st.SearchStrategy[list[int]]:
    return st.lists(st.integers(0, VOCAB - 1), min_size=min_size, max_size=max_size)


def max_tokens() -> st.SearchStrategy[int]:
    return st.integers(1, CHEAP_MAX_TOKENS)


def _temperature() -> st.SearchStrategy[float]:
    return st.one_of(st.just(0.0), st.floats(0.0, 2.0), st.sampled_from([0.7, 1.0]))


def _stop() -> st.SearchStrategy[Any]:
    return st.one_of(plain_text(6).filter(bool), st.lists(plain_text(6).filter(bool), max_size=3))


def _sampling_extras() -> dict[str, st.SearchStrategy]:
    return {
        "temperature": _temperature(),
        "top_p": st.floats(0.01, 1.0),
        "top_k": st.one_of(st.just(-1), st.integers(1, 50)),
        "seed": st.one_of(st.just(-1), st.integers(0, INT32_MAX)),
        "stop": _stop(),
        "stop_token_ids": token_ids(0, 3),
        "ignore_eos": st.booleans(),
        "include_stop_str_in_output": st.booleans(),
        "skip_special_tokens": st.booleans(),
        "repetition_penalty": st.floats(0.5, 2.0),
        "min_p": st.floats(0.0, 1.0),
        "n": st.integers(1, 3),
    }


def _chat_content() -> st.SearchStrategy[Any]:
    return st.one_of(
        odd_text(40),
        st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": odd_text(20)}), min_size=1, max_size=3),
    )


def _tool_call() -> st.SearchStrategy[dict]:
    return st.fixed_dictionaries(
        {
            "id": plain_text(8),
            "type": st.just("function"),
            "function": st.fixed_dictionaries(
                {"name": plain_text(8), "arguments": st.one_of(st.just("{}"), st.just('{"x": 1}'), odd_text(12))}
            ),
        }
    )


def chat_messages() -> st.SearchStrategy[list[dict]]:
    user = st.fixed_dictionaries({"role": st.just("user"), "content": _chat_content()})
    system = st.fixed_dictionaries({"role": st.sampled_from(["system", "developer"]), "content": _chat_content()})
    assistant = _opt(
        {"role": st.just("assistant")},
        {"content": st.one_of(st.none(), odd_text(30)), "tool_calls": st.lists(_tool_call(), max_size=2)},
    )
    tool = _opt(
        {"role": st.just("tool"), "content": odd_text(20)}, {"tool_call_id": plain_text(8), "name": plain_text(8)}
    )
    return st.lists(st.one_of(user, user, system, assistant, tool), min_size=1, max_size=4)


def _json_schema() -> st.SearchStrategy[dict]:
    return st.fixed_dictionaries(
        {"type": st.just("object")},
        optional={"properties": st.dictionaries(plain_text(6), st.just({"type": "string"}), max_size=2)},
    )


def chat_tools() -> st.SearchStrategy[list[dict]]:
    fn = _opt({"name": plain_text(10)}, {"description": odd_text(20), "parameters": _json_schema()})
    return st.lists(st.fixed_dictionaries({"type": st.just("function"), "function": fn}), max_size=2)


def chat_body(model: str) -> st.SearchStrategy[dict]:
    return _opt(
        {"messages": chat_messages(), "max_tokens": max_tokens()},
        {
            "model": _model(model, "gpt-17", ""),
            "stream": st.booleans(),
            "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
            "logprobs": st.booleans(),
            "top_logprobs": st.integers(0, 20),
            "tools": chat_tools(),
            "tool_choice": st.sampled_from(["auto", "none", "required"]),
            "chat_template_kwargs": st.dictionaries(
                st.sampled_from(["enable_thinking", "messages", "tools", "add_generation_prompt", "foo"]),
                scalar(),
                max_size=2,
            ),
            "add_generation_prompt": st.booleans(),
            "max_completion_tokens": max_tokens(),
            "min_tokens": st.integers(0, 2),
            "presence_penalty": st.floats(-2, 2),
            "frequency_penalty": st.floats(-2, 2),
            "user": plain_text(8),
            **_sampling_extras(),
        },
    )


def completion_body(model: str) -> st.SearchStrategy[dict]:
    prompt = st.one_of(
        odd_text(40),
        st.lists(odd_text(12), min_size=1, max_size=3),
        token_ids(),
        st.lists(token_ids(), min_size=1, max_size=3),
    )
    return _opt(
        {"prompt": prompt, "max_tokens": max_tokens()},
        {
            "model": _model(model, "nope"),
            "stream": st.booleans(),
            "logprobs": st.integers(0, 20),
            "echo": st.booleans(),
            "suffix": plain_text(4),
            **_sampling_extras(),
        },
    )


def responses_body(model: str) -> st.SearchStrategy[dict]:
    message = st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "developer", "assistant"]), "content": _chat_content()},
        optional={"type": st.just("message")},
    )
    call = st.fixed_dictionaries(
        {
            "type": st.just("function_call"),
            "call_id": plain_text(8),
            "name": plain_text(8),
            "arguments": st.sampled_from(["{}", '{"a": 1}', "not json"]),
        }
    )
    output = st.fixed_dictionaries(
        {"type": st.just("function_call_output"), "call_id": plain_text(8), "output": odd_text(12)}
    )
    tool = _opt(
        {"type": st.just("function"), "name": plain_text(8)},
        {"description": odd_text(12), "parameters": _json_schema()},
    )
    return _opt(
        {
            "input": st.one_of(
                odd_text(40), st.lists(st.one_of(message, message, call, output), min_size=1, max_size=4)
            ),
            "max_output_tokens": max_tokens(),
        },
        {
            "model": _model(model, "nope"),
            "instructions": odd_text(20),
            "tools": st.lists(tool, max_size=2),
            "include": st.lists(
                st.sampled_from(["message.output_text.logprobs", "reasoning.encrypted_content", "x"]), max_size=2
            ),
            "stream": st.booleans(),
            "temperature": _temperature(),
            "top_p": st.floats(0.01, 1.0),
            "previous_response_id": plain_text(8),
            "store": st.booleans(),
            "tool_choice": st.sampled_from(["auto", "none"]),
        },
    )


def messages_body(model: str) -> st.SearchStrategy[dict]:
    text_block = st.fixed_dictionaries({"type": st.just("text"), "text": odd_text(20)})
    tool_use = st.fixed_dictionaries(
        {
            "type": st.just("tool_use"),
            "id": plain_text(8),
            "name": plain_text(8),
            "input": st.dictionaries(plain_text(4), scalar(), max_size=2),
        }
    )
    tool_result = _opt(
        {"type": st.just("tool_result"), "tool_use_id": plain_text(8)},
        {"content": st.one_of(odd_text(12), st.lists(text_block, max_size=2)), "is_error": st.booleans()},
    )
    user = st.fixed_dictionaries(
        {
            "role": st.just("user"),
            "content": st.one_of(odd_text(30), st.lists(st.one_of(text_block, tool_result), min_size=1, max_size=3)),
        }
    )
    assistant = st.fixed_dictionaries(
        {
            "role": st.just("assistant"),
            "content": st.one_of(odd_text(30), st.lists(st.one_of(text_block, tool_use), min_size=1, max_size=3)),
        }
    )
    tool = _opt({"name": plain_text(8), "input_schema": _json_schema()}, {"description": odd_text(12)})
    return _opt(
        {
            "model": _model(model, "claude-nope"),
            "max_tokens": max_tokens(),
            "messages": st.lists(st.one_of(user, user, assistant), min_size=1, max_size=4),
        },
        {
            "system": st.one_of(odd_text(20), st.lists(text_block, max_size=2)),
            "tools": st.lists(tool, max_size=2),
            "stop_sequences": st.lists(plain_text(5).filter(bool), max_size=2),
            "stream": st.booleans(),
            "temperature": st.floats(0.0, 1.0),
            "top_k": st.integers(1, 50),
            "top_p": st.floats(0.01, 1.0),
            "metadata": st.fixed_dictionaries({}, optional={"user_id": plain_text(8)}),
            "thinking": st.fixed_dictionaries(
                {"type": st.sampled_from(["enabled", "disabled"]), "budget_tokens": st.integers(0, 64)}
            ),
        },
    )


def generate_body(model: str) -> st.SearchStrategy[dict]:
    sampling = _opt(
        {"max_new_tokens": max_tokens()},
        {
            "temperature": _temperature(),
            "top_p": st.floats(0.01, 1.0),
            "top_k": st.one_of(st.just(-1), st.integers(1, 50)),
            "stop": _stop(),
            "stop_token_ids": token_ids(0, 3),
            "n": st.integers(1, 3),
            "sampling_seed": st.integers(0, INT32_MAX),
            "seed": st.integers(0, INT32_MAX),
            "no_stop_trim": st.booleans(),
            "ignore_eos": st.booleans(),
            "skip_special_tokens": st.booleans(),
            "detokenize": st.booleans(),
            "min_new_tokens": st.integers(0, 2),
        },
    )
    prompt = st.one_of(
        st.fixed_dictionaries({"input_ids": token_ids()}),
        st.fixed_dictionaries({"input_ids": st.lists(token_ids(), min_size=1, max_size=3)}),
        st.fixed_dictionaries({"text": st.one_of(odd_text(40), st.lists(odd_text(12), min_size=1, max_size=3))}),
    )
    rest = _opt(
        {"sampling_params": sampling},
        {
            "model": _model(model, "nope"),
            "return_logprob": st.booleans(),
            "top_logprobs_num": st.integers(0, 20),
            "request_id": st.one_of(plain_text(8), st.lists(plain_text(8), max_size=3)),
            "return_prompt_token_ids": st.booleans(),
            "stream": st.booleans(),
            "rid": plain_text(8),
        },
    )
    return st.tuples(prompt, rest).map(lambda pr: {**pr[0], **pr[1]})


def worker_body(real_urls: list[str]) -> st.SearchStrategy[dict]:
    url = st.one_of(
        st.sampled_from(real_urls),
        st.builds(lambda p: f"grpc://127.0.0.1:{p}", st.sampled_from([0, 1, 9, 65535, 65536, 99999, -1])),
        st.sampled_from(
            [
                "grpc://[::1:1",
                "grpc://:50051",
                "grpc://h",
                "http://127.0.0.1:1",
                "grpc://127.0.0.1:port",
                "ftp://x:1",
                "",
                "grpc://[::1]:1",
                "http://[::1",
            ]
        ),
        odd_text(20),
    )
    labels = st.dictionaries(
        st.sampled_from(
            ["max_model_len", "dp_size", "tp_size", "kv_block_size", "lmcache_instance_id", "weight_version", "x"]
        ),
        st.one_of(st.integers(-5, 10), st.sampled_from(INT_EDGES), odd_text(6)),
        max_size=4,
    )
    return _opt(
        {"url": url},
        {
            "labels": labels,
            "models": st.lists(st.one_of(st.fixed_dictionaries({"id": odd_text(8)}), odd_text(8)), max_size=2),
            "id": odd_text(8),
            "connection_mode": st.sampled_from(["grpc", "http", "tcp"]),
        },
    )


def _iso_timestamp() -> st.SearchStrategy[Any]:
    return st.one_of(
        st.datetimes().map(lambda d: d.isoformat() + "Z"),
        st.sampled_from(
            ["2024-01-01T00:00:00Z", "2024-13-45T99:99:99Z", "yesterday", "", "9999-12-31T23:59:59.999999Z"]
        ),
        st.sampled_from(INT_EDGES),
    )


def _stats_entry(worker_ids: list[str]) -> st.SearchStrategy[dict]:
    stats = _opt(
        {},
        {
            "num_running_reqs": st.one_of(st.integers(0, 5), st.sampled_from(INT_EDGES), odd_text(4)),
            "num_waiting_reqs": st.one_of(st.integers(0, 5), st.sampled_from(INT_EDGES)),
            "kv_cache_usage": st.one_of(st.floats(0, 1), st.sampled_from(FLOAT_EDGES), st.floats()),
            "req_id_to_prompt_token_num": st.dictionaries(
                odd_text(4), st.one_of(st.integers(0, 9), scalar()), max_size=2
            ),
            "req_id_to_response_token_num": st.dictionaries(odd_text(4), st.integers(0, 9), max_size=2),
        },
    )
    return _opt(
        {"worker_id": st.one_of(st.sampled_from(worker_ids), odd_text(6))},
        {
            "dp_rank": st.one_of(st.integers(-1, 3), st.sampled_from(INT_EDGES)),
            "timestamp": _iso_timestamp(),
            "scheduler_stats": stats,
        },
    )


def update_stats_body(worker_ids: list[str]) -> st.SearchStrategy[Any]:
    return st.lists(_stats_entry(worker_ids), max_size=4)


def update_weight_version_body(worker_ids: list[str]) -> st.SearchStrategy[Any]:
    entry = _opt(
        {"worker_id": st.one_of(st.sampled_from(worker_ids), odd_text(6))},
        {
            "dp_rank": st.one_of(st.integers(-1, 3), st.sampled_from(INT_EDGES)),
            "weight_version": st.one_of(st.integers(-2, 3), st.sampled_from(INT_EDGES), scalar()),
        },
    )
    entries = st.lists(entry, max_size=4)
    return st.one_of(entries, st.fixed_dictionaries({"updates": entries}))


def pause_body(worker_ids: list[str]) -> st.SearchStrategy[Any]:
    rank = st.one_of(st.integers(-1, 3), st.sampled_from(INT_EDGES), st.lists(st.integers(-1, 3), max_size=3), scalar())
    entry = _opt(
        {},
        {
            "base_worker_id": st.one_of(st.sampled_from(worker_ids), odd_text(6)),
            "worker_id": st.sampled_from(worker_ids),
            "dp_rank": rank,
        },
    )
    return st.one_of(
        st.lists(entry, max_size=3), entry, st.fixed_dictionaries({"workers": st.lists(entry, max_size=3)})
    )


def control_body(session_ids: Callable[[], list[str]]) -> st.SearchStrategy[Any]:
    """The SessionRouter's /control/hang and /control/continue bodies over the live sessions (or random ids)."""
    sid = st.one_of(
        st.builds(lambda i: (session_ids() or ["none"])[i % max(1, len(session_ids()))], st.integers(0, 7)),
        odd_text(12),
    )
    item = st.one_of(
        sid,
        _opt(
            {"session_id": sid},
            {
                "base_worker_id": st.one_of(st.just("0"), odd_text(4), scalar()),
                "target_dp_rank": st.one_of(st.integers(-1, 3), scalar()),
            },
        ),
    )
    items = st.lists(item, max_size=3)
    return st.one_of(items, st.fixed_dictionaries({"sessions": items}))


# ---- mutations ----------------------------------------------------------------------------------------------


def _slots(value: Any, depth: int = 0) -> list[tuple[Any, Any]]:
    """(container, key) for every value inside `value`, a few levels deep."""
    out: list[tuple[Any, Any]] = []
    if depth > 4:
        return out
    if isinstance(value, dict):
        for k, v in value.items():
            out.append((value, k))
            out.extend(_slots(v, depth + 1))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out.append((value, i))
            out.extend(_slots(v, depth + 1))
    return out


MUTATIONS = ("replace", "replace", "replace", "delete", "add_key", "stringify", "wrap", "null", "repeat")
EXTRA_KEYS = [
    "stream",
    "n",
    "seed",
    "max_tokens",
    "logprobs",
    "kv_transfer_params",
    "data_parallel_rank",
    "__proto__",
    "messages",
    "x",
]


@st.composite
def mutated(draw: st.DrawFn, base: st.SearchStrategy[Any]) -> Any:
    """A body from `base` with up to three of: a value replaced by anything (wrong type, out of range, raw
    bytes), a key dropped or added, a number sent as a string, a value wrapped in a list, null, a list grown."""
    body = copy.deepcopy(draw(base))  # st.just() hands out one object: mutate a copy
    for _ in range(max(0, draw(st.integers(0, 4)) - 1)):  # unmutated two times in five
        slots = _slots(body)
        if not slots:
            if isinstance(body, dict):
                body[draw(st.sampled_from(EXTRA_KEYS))] = draw(weird_value())
            break
        container, key = draw(st.sampled_from(slots))
        op = draw(st.sampled_from(MUTATIONS))
        if op == "replace":
            container[key] = draw(weird_value())
        elif op == "delete":
            del container[key]
        elif op == "add_key" and isinstance(container, dict):
            container[draw(st.one_of(st.sampled_from(EXTRA_KEYS), odd_text(6)))] = draw(weird_value())
        elif op == "stringify":
            container[key] = str(container[key]) if not isinstance(container[key], RawJson) else "x"
        elif op == "wrap":
            container[key] = [container[key]]
        elif op == "null":
            container[key] = None
        elif op == "repeat" and isinstance(container, list):
            container.extend([container[key]] * draw(st.sampled_from([1, 10, 200])))
    return body


def _body_bytes(body: Any) -> st.SearchStrategy[bytes]:
    """The body's bytes, mostly as JSON, sometimes not JSON at all or not an object."""
    encoded = encode_json(body)
    as_json = st.sampled_from([encoded, encoded, encoded, encode_json(body, ensure_ascii=False)])
    return st.integers(0, 9).flatmap(lambda k: as_json if k < 6 else _not_quite_json(body, encoded))


def _not_quite_json(body: Any, encoded: bytes) -> st.SearchStrategy[bytes]:
    return st.one_of(
        st.sampled_from(
            [
                b"",
                b" ",
                b"null",
                b"[]",
                b"{}",
                b'"a string"',
                b"42",
                b"{",
                b"{'single': 'quotes'}",
                b"\xef\xbb\xbf{}",
                b"\xff\xfe{\x00}\x00",
                b'{"a": 1,}',
                b'{"a": 1} trailing',
                b"\x00" * 8,
                b"a=1&b=2",
            ]
        ),
        st.binary(max_size=64),
        st.integers(0, max(0, len(encoded) - 1)).map(lambda n: encoded[:n]),  # truncated
        st.just(encode_json([body])),  # an array, not an object
        st.just(json.dumps(body, ensure_ascii=True, default=str).encode("utf-16") if not _has_raw(body) else encoded),
    )


def _has_raw(value: Any) -> bool:
    if isinstance(value, RawJson):
        return True
    if isinstance(value, dict):
        return any(_has_raw(v) for v in value.values())
    if isinstance(value, list):
        return any(_has_raw(v) for v in value)
    return False


CONTENT_TYPES = [
    "application/json",
    "application/json",
    "application/json",
    "application/json; charset=utf-8",
    None,
    "text/plain",
    "application/x-www-form-urlencoded",
    "multipart/form-data; boundary=x",
    "application/json; charset=latin-1",
    "application/cbor",
    "*/*",
    "garbage",
]

PSRL_HEADERS = {
    "x-request-id": ["1", "42", "0", "-1", "9223372036854775807", "9" * 30],
    "x-prompt-id": ["1", "42", "0", "-3", "9" * 30],
    # -1/0 only: a valid version above what is synced waits in the routing loop by design.
    # Never a version >= 1: nothing here is synced above 0, and such a request waits in the routing loop by
    # design. Versions beyond int64 are sent once, as explicit examples (tests/reliability/test_fuzz_http.py).
    "x-version-tag": ["-1", "0", "-2", "-9" * 5, "-" + "9" * 20, "1e3", "0x1"],
    "x-is-validate": ["1", "0", "true", "no", "maybe", "2"],
    "x-is-sticky": ["1", "0", "yes", "y", "sticky"],
    "x-force-pin-once": ["1", "true", "0", "on"],
    "x-base-worker-id": ["0", "1", "nope", "0 1", "../0"],
    "x-target-dp-rank": ["0", "1", "2", "7", "-1", "9" * 25, "x"],
    "x-smg-routing-key": ["k", "", "\u00e9"],
    "x-smg-prompt-too-long-limit": ["1", "0", "-1", "9" * 25, "x", "4"],
    "x-smg-tito-trajectory-id": ["0", "1", "-1", "9" * 25, "t"],
}
BAD_HEADER_VALUES = ["", "abc", "1.5", "0x10", "1_000", "7 7", "+7", "9" * 5000, "\xff\xfe", "\u00bd", "NaN"]


def _waits_for_a_version(value: str) -> bool:
    """Whether the router would read `value` as a version floor above what any instance here is synced to."""
    try:
        return int(value.strip()) >= 1
    except ValueError:
        return False


def psrl_headers(extra: dict[str, list[str]] | None = None) -> st.SearchStrategy[dict[str, str]]:
    """PSRL's routing headers: none, valid ones, or malformed values (non-integers, beyond int64, latin-1)."""
    names = {**PSRL_HEADERS, **(extra or {})}
    bad = st.one_of(st.sampled_from(BAD_HEADER_VALUES), odd_text(12).map(header_value))
    value = {name: st.one_of(st.sampled_from(values), st.sampled_from(values), bad) for name, values in names.items()}
    value["x-version-tag"] = value["x-version-tag"].filter(lambda v: not _waits_for_a_version(v))
    pair = st.fixed_dictionaries({"x-request-id": value["x-request-id"], "x-prompt-id": value["x-prompt-id"]})
    return st.one_of(
        st.just({}),
        pair,
        st.tuples(pair, st.fixed_dictionaries({}, optional=value)).map(lambda t: {**t[0], **t[1]}),
        st.fixed_dictionaries({}, optional=value),
    )


# ---- one request, its answer, and the record of bad answers -----------------------------------------------


@dataclass
class FuzzRequest:
    method: str
    path: str  # as sent (quoted, with its query)
    route: str  # the route template it exercises, for grouping
    content: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)
    content_type: str | None = "application/json"

    def wire_headers(self) -> list[tuple[bytes, bytes]]:
        out = [
            (k.encode(), v.encode("latin-1", "replace") if isinstance(v, str) else v) for k, v in self.headers.items()
        ]
        if self.content_type is not None:
            out.append((b"content-type", self.content_type.encode()))
        return out

    def repro(self, limit: int = 600) -> str:
        body = (
            self.content if len(self.content) <= limit else self.content[:limit] + b"...(%d bytes)" % len(self.content)
        )
        headers = {k: (v if len(v) < 80 else v[:40] + f"...({len(v)} chars)") for k, v in self.headers.items()}
        return f"{self.method} {self.path} content-type={self.content_type!r} headers={headers} body={body!r}"


def build_request(
    method: str,
    path: str,
    body: Any,
    route: str | None = None,
    mutate: bool = True,
    headers: st.SearchStrategy[dict[str, str]] | None = None,
    clamp: Callable[[Any], Any] | None = None,
) -> st.SearchStrategy[FuzzRequest]:
    """A request to `path` whose body comes from the strategy `body`, mutated, made cheap by `clamp`, and sent
    as JSON or as something else, with PSRL headers and content types drawn too."""

    @st.composite
    def make(draw: st.DrawFn) -> FuzzRequest:
        value = draw(mutated(body) if mutate else body)
        if clamp is not None:
            value = clamp(value)
        content = draw(_body_bytes(value))
        hdrs = draw(headers) if headers is not None else {}
        ctype = draw(st.sampled_from(CONTENT_TYPES))
        return FuzzRequest(method, path, route or path, content, hdrs, ctype)

    return make()


def clamp_cost(
    value: Any, keys: Iterable[str] = ("max_tokens", "max_completion_tokens", "max_output_tokens", "max_new_tokens")
) -> Any:
    """Keep a valid request cheap: a token budget that would decode thousands of tokens becomes a few, a
    missing one is set, and n is kept small; out-of-range values (0, negative, beyond uint32) stay as drawn."""
    if isinstance(value, dict):
        for k in keys:
            v = value.get(k)
            if isinstance(v, int) and not isinstance(v, bool) and CHEAP_MAX_TOKENS < v <= UINT32_MAX:
                value[k] = CHEAP_MAX_TOKENS
        for k in ("n", "best_of"):
            v = value.get(k)
            if isinstance(v, int) and not isinstance(v, bool) and 4 < v <= 16384:
                value[k] = 4
        sp = value.get("sampling_params")
        if isinstance(sp, dict):
            clamp_cost(sp, keys)
            if "max_new_tokens" not in sp:
                sp["max_new_tokens"] = CHEAP_MAX_TOKENS
        for k in keys:
            if k in value:
                break
        else:
            if "messages" in value or "prompt" in value:
                value["max_tokens"] = CHEAP_MAX_TOKENS
            elif "input" in value:
                value["max_output_tokens"] = CHEAP_MAX_TOKENS
    return value


def quoted(text: str) -> str:
    return urllib.parse.quote(text.encode("utf-8", "surrogatepass"), safe="")


_DIGITS = re.compile(r"\d+")
_QUOTED = re.compile(r"'[^']*'|\"[^\"]*\"")


def normalize(text: str, limit: int = 90) -> str:
    return _QUOTED.sub("'…'", _DIGITS.sub("N", text))[:limit]


def last_exception_line(log: str) -> str | None:
    """The exception a traceback in `log` ended with, e.g. 'ValueError: Port out of range 0-65535'."""
    lines = [ln for ln in log.splitlines() if ln.strip()]
    tb = [i for i, ln in enumerate(lines) if ln.startswith("Traceback (most recent call last)")]
    if not tb:
        return None
    for ln in lines[tb[-1] + 1 :]:
        if not ln.startswith((" ", "\t", "Traceback", "During handling", "The above exception")) and re.match(
            r"^[\w.]+:", ln
        ):
            return ln.strip()
    return None


@dataclass
class Failure:
    signature: str
    request: FuzzRequest
    detail: str
    log: str


class Log:
    """New lines of a process log since the last look (a traceback a request caused)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = path.stat().st_size if path.exists() else 0

    def new(self) -> str:
        if not self.path.exists():
            return ""
        with self.path.open("rb") as f:
            f.seek(self.offset)
            data = f.read()
        self.offset += len(data)
        return data.decode(errors="replace")


@dataclass
class Target:
    """A process under fuzz: its base URL, its log, and which error shape its 4xx answers have."""

    name: str  # "router" or "session"
    url: str
    log: Path
    alive: Callable[[], bool]


class FuzzRun:
    """Sends fuzz requests over one reused client and records every answer that is not a success or a 4xx with
    the service's JSON error, grouped by signature. `timeout_s` is far above what any request here needs (a
    few decoded tokens); an answer later than that counts as none. After `max_timeouts` the run stops sending,
    so a hang costs a bounded time."""

    def __init__(
        self, target: Target, timeout_s: float = 20.0, max_timeouts: int = 3, extra_logs: Iterable[Path] = ()
    ) -> None:
        self.target = target
        self.client = httpx.Client(base_url=target.url, timeout=httpx.Timeout(timeout_s, connect=5.0))
        self.failures: dict[str, list[Failure]] = {}
        self.timeouts = 0
        self.max_timeouts = max_timeouts
        self.sent = 0
        self.statuses: dict[str, int] = {}
        self.logs = [Log(target.log), *(Log(p) for p in extra_logs)]
        self.stopped: str | None = None

    def close(self) -> None:
        self.client.close()

    def record(self, signature: str, request: FuzzRequest, detail: str) -> None:
        time.sleep(0.2)  # a server may log the traceback just after it answered
        log = "\n".join(lg.new() for lg in self.logs).strip()
        exc = last_exception_line(log)
        if exc:
            signature += f" [{normalize(exc, 120)}]"
        bucket = self.failures.setdefault(signature, [])
        if len(bucket) < 3:
            bucket.append(Failure(signature, request, detail, log[-4000:]))

    def send(
        self, req: FuzzRequest, on_response: Callable[[FuzzRequest, httpx.Response], None] | None = None
    ) -> httpx.Response | None:
        if self.stopped:
            return None
        for lg in self.logs:
            lg.new()  # skip what earlier requests logged
        self.sent += 1
        where = f"{self.target.name} {req.method} {req.route}"
        try:
            r = self.client.request(req.method, req.path, content=req.content, headers=req.wire_headers())
        except httpx.TimeoutException as e:
            self.timeouts += 1
            self.record(f"{where}: no answer within the timeout", req, repr(e))
            if self.timeouts >= self.max_timeouts:
                self.stopped = f"stopped after {self.timeouts} requests got no answer"
            return None
        except httpx.TransportError as e:
            self.record(f"{where}: connection dropped ({type(e).__name__})", req, repr(e))
            if not self.target.alive():
                self.stopped = f"the {self.target.name} process died"
            return None
        key = f"{r.status_code} {r.headers.get('x-smg-error-code', '')}".strip()
        self.statuses[key] = self.statuses.get(key, 0) + 1
        problem = classify(self.target.name, r)
        if problem is not None:
            self.record(
                f"{where}: {problem}", req, f"{r.status_code} {r.headers.get('content-type')} {r.content[:800]!r}"
            )
        elif on_response is not None:
            on_response(req, r)
        if not self.target.alive():
            self.stopped = f"the {self.target.name} process died"
        return r

    def report(self) -> str:
        lines = [f"{self.target.name}: {self.sent} requests, statuses {dict(sorted(self.statuses.items()))}"]
        if self.stopped:
            lines.append(f"  RUN STOPPED: {self.stopped}")
        for sig, fails in self.failures.items():
            lines.append(f"- {sig}")
            for f in fails[:2]:
                lines.append(f"    request: {f.request.repro()}")
                lines.append(f"    answer:  {f.detail[:500]}")
                if f.log:
                    tail = f.log.splitlines()[-8:]
                    lines.extend(f"    log| {ln[:200]}" for ln in tail)
        return "\n".join(lines)


def classify(service: str, r: httpx.Response) -> str | None:
    """None for an acceptable answer: a success, or a 4xx whose body is the service's JSON error. The router's
    shape is {"error": {"message", "type", "param", "code"}} with the code in x-smg-error-code; the
    SessionRouter's own is {"error": "<message>"} (with x-smg-error-code), and it passes the router's on."""
    status = r.status_code
    ctype = r.headers.get("content-type", "")
    if status >= 500:
        code = None
        try:
            err = r.json().get("error")
            code = err.get("code") if isinstance(err, dict) else r.headers.get("x-smg-error-code")
        except (ValueError, AttributeError):
            pass
        return f"{status} ({code or ctype or 'no body'})"
    if 400 <= status < 500:
        try:
            body = r.json()
        except ValueError:
            return f"{status} with a non-JSON body ({ctype}: {r.content[:60]!r})"
        err = body.get("error") if isinstance(body, dict) else None
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            if r.headers.get("x-smg-error-code") != err.get("code"):
                header = r.headers.get("x-smg-error-code")
                return f"{status} error code {err.get('code')!r} but x-smg-error-code {header!r}"
            return None
        if service == "session" and isinstance(err, str):
            return None if r.headers.get("x-smg-error-code") else f"{status} without x-smg-error-code"
        return f"{status} whose JSON is not the {service}'s error shape ({normalize(r.text, 60)})"
    if 200 <= status < 300:
        if status == 204 or not r.content:
            return None
        if ctype.startswith("text/event-stream"):
            return _sse_problem(r.text)
        if ctype.startswith("application/json"):
            try:
                r.json()
            except ValueError:
                return f"{status} with invalid JSON"
        return None
    return f"unexpected status {status}"


def _sse_problem(text: str) -> str | None:
    for line in text.splitlines():
        if line.startswith("data:"):
            data = line[5:].strip()
            if data == "[DONE]":
                continue
            try:
                event = json.loads(data)
            except ValueError:
                return f"SSE data that is not JSON ({data[:40]!r})"
            if isinstance(event, dict) and (
                event.get("type") in ("error", "response.failed") or ("error" in event and event.get("type") is None)
            ):
                return f"an error event in a 200 stream ({normalize(json.dumps(event), 80)})"
    return None


# ---- leaks -----------------------------------------------------------------------------------------------------


LOOP_COUNTERS = ("queue_len", "pending_request_num", "running_tasks", "active_dispatch_handoffs")


def router_busy(client: httpx.Client, router_url: str) -> dict[str, Any]:
    """What is still counted on the router: routing-loop counters and per-instance in-flight requests (the
    non-zero ones only; empty when idle)."""
    busy: dict[str, Any] = {}
    status = client.get(f"{router_url}/routing_loop/status", timeout=10).json()
    busy.update({k: status[k] for k in LOOP_COUNTERS if status.get(k)})
    for w in client.get(f"{router_url}/workers", timeout=10).json()["workers"]:
        for inst in w["instances"]:
            if inst["inflight_requests"]:
                busy[f"inflight[{inst['worker_id']}/{inst['dp_rank']}]"] = inst["inflight_requests"]
    return busy


def session_busy(client: httpx.Client, session_url: str) -> dict[str, Any]:
    sessions = client.get(f"{session_url}/control/sessions", timeout=10).json()["sessions"]
    return {f"session {s['session_id'][:8]} inflight": s["inflight"] for s in sessions if s["inflight"]}


def leak_problems(
    router_url: str,
    replica_urls: Iterable[str],
    session_url: str | None = None,
    settle_s: float = 20.0,
) -> list[str]:
    """Waits up to `settle_s` for every counter to reach 0 (router loop and in-flight, replica running and
    waiting, SessionRouter in-flight turns), then checks `POST /routing_loop/pause?wait=true` returns (and
    resumes). Returns what is wrong, empty when nothing is."""
    from _procs import replica_busy

    problems: list[str] = []
    with httpx.Client() as client:
        deadline = time.monotonic() + settle_s
        while True:
            busy = router_busy(client, router_url)
            for url in replica_urls:
                n = replica_busy(url)
                if n:
                    busy[f"replica {url} running+waiting"] = n
            if session_url is not None:
                busy.update(session_busy(client, session_url))
            if not busy or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        if busy:
            problems.append(f"still counted {settle_s:.0f}s after the last request: {busy}")
        try:
            r = client.post(f"{router_url}/routing_loop/pause", params={"wait": "true"}, timeout=20)
            if r.status_code != 200:
                problems.append(f"POST /routing_loop/pause?wait=true answered {r.status_code}: {r.text[:200]}")
        except httpx.TimeoutException:
            problems.append("POST /routing_loop/pause?wait=true did not return within 20s")
        finally:
            try:
                client.post(f"{router_url}/routing_loop/resume", timeout=10)
            except httpx.HTTPError as e:
                problems.append(f"POST /routing_loop/resume failed: {e!r}")
    return problems
