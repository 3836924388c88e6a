"""What a GenerateRequest's `kv_transfer_params_json` may hold (pure, no server): parsed within psrl.serving's JSON
bounds, its numbers integers inside their ranges, and every refusal a KvTransferParamsError (a ValueError, which
the servicers answer INVALID_ARGUMENT) in vLLM's words where vLLM has them."""

from __future__ import annotations

import json
import math

import pytest

from psrl.serving.json_body import MAX_JSON_DEPTH, JsonBodyError, loads_bounded
from psrl.worker.kv_migration import KvTransferParams, KvTransferParamsError, kv_transfer_params_object

SOURCE = {"target": "h:1"}


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("[" * 5000, f"nested deeper than {MAX_JSON_DEPTH} levels"),
        ('{"a": ' * 3000 + "1" + "}" * 3000, f"nested deeper than {MAX_JSON_DEPTH} levels"),
        ('{"num_tokens": ' + "1" * 5000 + "}", "an integer literal longer than"),
        ("", "Expecting value"),  # vLLM's words: json's own message behind the field's prefix
        ("{bad", "Expecting property name"),
        ("[1]", "kv_transfer_params_json must be a JSON object"),
        ("null", "kv_transfer_params_json must be a JSON object"),
    ],
)
def test_the_field_is_parsed_within_bounds(text: str, words: str) -> None:
    with pytest.raises(KvTransferParamsError, match=r"^Invalid kv_transfer_params_json: ") as err:
        kv_transfer_params_object(text)
    assert words in str(err.value)
    assert isinstance(err.value, ValueError)  # what the servicers and the vLLM connector already catch


def test_an_object_within_bounds_parses() -> None:
    data = {"source": {"target": "h:1", "dp_rank": 1}, "request_id": "r", "nested": [[[[{}]]]]}
    assert kv_transfer_params_object(json.dumps(data)) == data
    assert kv_transfer_params_object("{}") == {}


@pytest.mark.parametrize(
    ("data", "words"),
    [
        ({"source": SOURCE, "request_id": "x", "timeout_ms": math.inf}, "timeout_ms must be an integer"),  # 1e999
        ({"source": SOURCE, "request_id": "x", "timeout_ms": -math.inf}, "timeout_ms must be an integer"),
        ({"source": SOURCE, "request_id": "x", "timeout_ms": math.nan}, "timeout_ms must be an integer"),
        ({"source": SOURCE, "request_id": "x", "timeout_ms": 2**31}, "timeout_ms must be an integer in [1, "),
        ({"source": SOURCE, "request_id": "x", "timeout_ms": 10**30}, "timeout_ms must be an integer"),
        ({"source": SOURCE, "request_id": "x", "timeout_ms": 0}, "timeout_ms must be an integer"),
        ({"source": SOURCE, "request_id": "x", "timeout_ms": 2.5}, "timeout_ms must be an integer"),
        ({"source": SOURCE, "request_id": "x", "timeout_ms": "5000"}, "timeout_ms must be an integer"),
        ({"source": SOURCE, "request_id": "x", "timeout_ms": True}, "timeout_ms must be an integer"),
        ({"source": SOURCE, "request_id": "x", "num_tokens": 2**32}, "num_tokens must be an integer"),
        ({"source": SOURCE, "request_id": "x", "num_tokens": -1}, "num_tokens must be an integer"),
        ({"source": SOURCE, "request_id": "x", "num_tokens": 1e300}, "num_tokens must be an integer"),
        ({"source": {"target": "h:1", "dp_rank": 2**31}, "request_id": "x"}, "source.dp_rank must be an integer"),
        ({"source": {"target": "h:1", "dp_rank": -1}, "request_id": "x"}, "source.dp_rank must be an integer"),
        ({"source": {"target": "h:1", "dp_rank": "1"}, "request_id": "x"}, "source.dp_rank must be an integer"),
        ({"source": "x", "request_id": "x"}, "source must be an object with a target"),
        ({"source": None, "request_id": "x"}, "source must be an object with a target"),
        ({"source": {}, "request_id": "x"}, "source must be an object with a target"),
        ({"source": SOURCE}, "request_id is required"),
        ({"source": SOURCE, "request_id": "x", "mode": ["sync"]}, "mode ['sync'] is not one of"),
    ],
)
def test_numbers_out_of_range_or_not_integers_are_refused(data: dict, words: str) -> None:
    with pytest.raises(KvTransferParamsError, match=r"^Invalid kv_transfer_params_json: ") as err:
        KvTransferParams.from_dict(data)
    assert words in str(err.value)


def test_1e999_from_the_wire_is_refused_not_an_overflow() -> None:
    raw = '{"source": {"target": "127.0.0.1:1"}, "request_id": "x", "timeout_ms": 1e999}'
    with pytest.raises(KvTransferParamsError, match=r"timeout_ms must be an integer in .* got inf$"):
        KvTransferParams.from_dict(kv_transfer_params_object(raw))


def test_integers_at_their_bounds_and_integral_floats_are_accepted() -> None:
    data = {
        "source": {"target": "h:1", "dp_rank": 2**31 - 1},
        "request_id": "r",
        "num_tokens": 2**32 - 1,
        "timeout_ms": 5000.0,  # a JSON number with an integral value
        "mode": "sync",
    }
    assert KvTransferParams.from_dict(data) == KvTransferParams("h:1", 2**31 - 1, "r", 2**32 - 1, "sync", 5000)
    low = {"source": SOURCE, "request_id": "r", "num_tokens": 0, "timeout_ms": 1}
    assert KvTransferParams.from_dict(low) == KvTransferParams("h:1", 0, "r", 0, "async", 1)


def test_bounded_loads_takes_text_and_names_the_problem_apart_from_the_body() -> None:
    assert loads_bounded('{"a": [1]}') == {"a": [1]}  # a string field's JSON, not bytes
    with pytest.raises(JsonBodyError) as err:
        loads_bounded("[" * 300)
    assert str(err.value) == f"request body is nested deeper than {MAX_JSON_DEPTH} levels"  # the HTTP wording
    assert err.value.detail == f"nested deeper than {MAX_JSON_DEPTH} levels"
    with pytest.raises(JsonBodyError) as err:
        loads_bounded(b"{x")
    assert str(err.value).startswith("request body is not valid JSON: Expecting property name")
    assert err.value.detail.startswith("Expecting property name")
