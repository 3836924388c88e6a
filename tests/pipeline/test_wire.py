"""psrl._wire: token ids as protobuf's own packed field, every bad id refused by index; a JSON body's opening
brackets counted; a JSON array of token ids read as json reads it."""

from __future__ import annotations

import json
import random
from array import array

import pytest
from smg_grpc_proto.generated import vllm_engine_pb2

from psrl._wire import json_opens, json_take_token_ids, packed_uint32
from psrl.router.errors import BadRequest
from psrl.router.pipeline.context import GenerationInput, SamplingSpec

INPUT_IDS = vllm_engine_pb2.TokenizedInput.DESCRIPTOR.fields_by_name["input_ids"].number
TOKENIZED = vllm_engine_pb2.GenerateRequest.DESCRIPTOR.fields_by_name["tokenized"].number
# Each varint length's first and last value, up to uint32's last, and both sides of 2**30 (one int digit).
EDGES = [0, 1, 127, 128, 2**14 - 1, 2**14, 2**21 - 1, 2**21, 2**28 - 1, 2**28, 2**30 - 1, 2**30, 2**32 - 1]


@pytest.mark.parametrize("ids", [EDGES, [5], list(range(0, 300_000, 7)), []])
def test_bytes_are_protobufs_own(ids: list[int]) -> None:
    assert packed_uint32(INPUT_IDS, ids) == vllm_engine_pb2.TokenizedInput(input_ids=ids).SerializeToString()
    merged = vllm_engine_pb2.TokenizedInput()
    merged.MergeFromString(packed_uint32(INPUT_IDS, ids))
    assert list(merged.input_ids) == ids
    # wrapped in the request's `tokenized` field: present, even empty, as protobuf writes a set submessage
    wrapped = vllm_engine_pb2.GenerateRequest(tokenized=vllm_engine_pb2.TokenizedInput(input_ids=ids))
    assert packed_uint32(INPUT_IDS, ids, TOKENIZED) == wrapped.SerializeToString()


def test_high_field_numbers_take_a_longer_tag() -> None:
    parsed = vllm_engine_pb2.SamplingParams()  # stop_token_ids = 11: a one-byte tag; 2**29 - 1 takes five
    parsed.MergeFromString(packed_uint32(11, [3, 4]))
    assert list(parsed.stop_token_ids) == [3, 4]
    assert packed_uint32(2**29 - 1, [1])[:5] == bytes([0xFA, 0xFF, 0xFF, 0xFF, 0x0F])


@pytest.mark.parametrize(
    ("ids", "error", "needle"),
    [
        ([1, True], TypeError, "item 1 is bool"),
        ([1.0], TypeError, "item 0 is float"),
        ([1, 2, "3"], TypeError, "item 2 is str"),
        ([None], TypeError, "item 0 is NoneType"),
        ([-1], OverflowError, r"item 0 is not in \[0, 2\*\*32\)"),
        ([0, 2**32], OverflowError, "item 1"),
        ([2**100], OverflowError, "item 0"),
    ],
)
def test_bad_ids_are_named(ids: list, error: type[Exception], needle: str) -> None:
    with pytest.raises(error, match=needle):
        packed_uint32(INPUT_IDS, ids)


def test_bad_calls_raise() -> None:
    with pytest.raises(TypeError, match="must be a list"):
        packed_uint32(INPUT_IDS, (1, 2))
    with pytest.raises(ValueError, match="field number 0"):
        packed_uint32(0, [1])
    with pytest.raises(TypeError, match="takes 2 or 3 arguments"):
        packed_uint32(INPUT_IDS)  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="field number 536870912"):
        packed_uint32(INPUT_IDS, [1], 2**29)


@pytest.mark.parametrize("ids", [[151643, 0, 9, 2**32 - 1], list(range(0, 2**21, 3)), []])
def test_generate_request_carries_the_prompt(ids: list[int]) -> None:
    """The prompt appended after the rest (its length a multi-byte varint for a long one) reads back as the
    message protobuf would build."""
    gen = GenerationInput("r", ids, SamplingSpec(max_tokens=3), kv_transfer_params_json='{"a": 1}')
    wire = vllm_engine_pb2.GenerateRequest.FromString(gen.to_wire(1))
    expected = vllm_engine_pb2.GenerateRequest(
        request_id="r",
        tokenized=vllm_engine_pb2.TokenizedInput(input_ids=ids),
        data_parallel_rank=1,
        kv_transfer_params_json='{"a": 1}',
    )
    gen.sampling.write_to(expected.sampling_params)
    assert wire == expected and wire.sampling_params.max_tokens == 3
    assert wire.WhichOneof("input") == "tokenized"


def test_a_prompt_that_is_not_uint32s_is_a_bad_request() -> None:
    """Parse checks a client's ids; a prompt built past it (a bug) still fails as a 400, never a crash."""
    for ids in ([1, True], [2**32]):
        with pytest.raises(BadRequest, match="not uint32s"):
            GenerationInput("r", ids, SamplingSpec()).to_wire(0)


def test_json_opens_counts_both_brackets_at_every_length() -> None:
    """Every length up to a few vector widths (the loop's tail), around its blocks of 240, and bodies of every byte
    value."""
    rng = random.Random(7)
    for n in [*range(0, 130), *range(235, 245), 479, 480, 481, 4096, 100_003]:
        data = bytes(rng.choice(b'[{]}"a1 ,\x00\xff') for _ in range(n))
        assert json_opens(data) == data.count(b"[") + data.count(b"{"), n
    assert json_opens(bytes(range(256)) * 3) == 6
    assert json_opens(b'{"s": "[[{", "ids": [1, 2]}') == 5  # inside strings too: an upper bound


def test_json_opens_takes_bytes_only() -> None:
    for wrong in ("[{", bytearray(b"["), memoryview(b"[")):
        with pytest.raises(TypeError, match="must be bytes"):
            json_opens(wrong)  # type: ignore[arg-type]


@pytest.mark.parametrize("ids", [EDGES, [5], list(range(0, 300_000, 7)), []])
def test_an_array_packs_as_its_list(ids: list[int]) -> None:
    packed = array("I", ids)
    assert packed_uint32(INPUT_IDS, packed) == packed_uint32(INPUT_IDS, ids)
    assert packed_uint32(INPUT_IDS, packed, TOKENIZED) == packed_uint32(INPUT_IDS, ids, TOKENIZED)
    gen = GenerationInput("r", packed, SamplingSpec(max_tokens=3))
    assert gen.to_wire(0) == GenerationInput("r", ids, SamplingSpec(max_tokens=3)).to_wire(0)


def test_only_an_array_of_uint32_packs() -> None:
    for wrong in (array("i", [1]), array("L", [1]), array("H", [1]), b"\x01\x00\x00\x00", memoryview(b"1234")):
        with pytest.raises(TypeError, match=r"must be a list or an array\('I'\)"):
            packed_uint32(INPUT_IDS, wrong)  # type: ignore[arg-type]


# Literals in an id's place that are not a token id as JSON writes one: signed, floats, other types, not JSON.
NOT_IDS = ("-1", "-0", "+1", "1E2", "true", "null", '"1"', "[1]", "", "0x10", "1_0", "\u0661")


def _id_texts(rng: random.Random) -> list[str]:
    """JSON arrays of ids, spaced every way JSON allows, and their near misses."""
    space = ["", " ", "\n", "\t ", "\r\n  "]
    texts = []
    for _ in range(300):
        ids = [rng.choice([*EDGES, rng.randrange(2**32)]) for _ in range(rng.randrange(1, 12))]
        if rng.random() < 0.1:  # out of range
            ids[rng.randrange(len(ids))] = rng.choice([2**32, 2**64, 10**30])
        parts = [str(i) for i in ids]
        if rng.random() < 0.3:  # one literal JSON writes otherwise, or that is not JSON
            k = rng.randrange(len(parts))
            parts[k] = rng.choice([*NOT_IDS, "0" + parts[k], parts[k] + ".0", parts[k] + "e0"])
        text = "[" + ",".join(rng.choice(space) + p + rng.choice(space) for p in parts) + "]"
        if rng.random() < 0.1:
            text = rng.choice([text + ",", text[:-1], text + "]", "[" + text, "[]", "[ ]", "{}", "1"])
        texts.append(text)
    return texts


# Fields around the ids: brackets and the key's own name inside strings, escapes, nesting, other literals.
OTHER_FIELDS = (
    '"model": "m"',
    '"s": "]}, \\"input_ids\\": [9], {["',
    '"q": "\\\\"',
    '"n": {"input_ids": [1, 2], "a": [[], {}, "x"]}',
    '"f": -1.5e3',
    '"t": true, "u": null',
    '"e": "\\u00e9\\ud83d\\ude00"',
    '"input_ids_2": [1]',
)


def _bodies(rng: random.Random) -> list[bytes]:
    """Objects holding an `input_ids` among other fields, and near misses of the object around it."""
    bodies = []
    for ids in _id_texts(rng):
        fields = rng.sample(OTHER_FIELDS, rng.randrange(0, 4))
        fields.insert(rng.randrange(len(fields) + 1), f'"input_ids": {ids}')
        body = "{" + rng.choice([", ", ",", " ,\n"]).join(fields) + "}"
        if rng.random() < 0.15:
            body = rng.choice(
                [
                    body + ",",
                    body[:-1],
                    body + "}",
                    " " + body + " \n",
                    body.replace('"input_ids"', '"input\\u005fids"', 1),
                    body[:-1] + ', "input_ids": [5]}',
                    body.replace(":", "", 1),
                    body.replace('"m"', "m"),
                    "[" + body + "]",
                ]
            )
        bodies.append(body.encode())
    return bodies


def test_json_take_token_ids_reads_as_json_does() -> None:
    """Where the ids are taken out, json reads the body as an object whose `input_ids` is a flat list of ids
    (no sign written), the array holds them, and the rest reads as the same object with [] there; or, for a body
    json refuses, the rest is refused too (so the decoder after it refuses). Every well-formed body with a flat
    array of ids is taken: the way a /generate request's prompt is read."""
    taken = 0
    for raw in _bodies(random.Random(11)):
        got = json_take_token_ids(raw, "input_ids")
        try:
            value = json.loads(raw)
        except ValueError:
            value = None
        ids = value.get("input_ids") if isinstance(value, dict) else None
        flat = isinstance(ids, list) and bool(ids) and all(type(i) is int and 0 <= i < 2**32 for i in ids)
        plain = flat and raw.count(b'"input_ids"') - raw.count(b'"input_ids": [1, 2]') == 1 and b"-0" not in raw
        if got is None:
            assert not plain, raw
            continue
        taken += 1
        array_ids, rest = got
        if value is None:
            with pytest.raises(ValueError):
                json.loads(rest)
            continue
        assert flat and array_ids.typecode == "I" and array_ids.tolist() == ids, raw
        assert json.loads(rest) == {**value, "input_ids": []}, raw
    assert taken > 100


def test_json_take_token_ids_of_a_long_prompt() -> None:
    long_prompt = list(range(0, 2**32, 2**32 // 30_000))
    raw = json.dumps({"model": "m", "input_ids": long_prompt, "sampling_params": {"n": 2}}).encode()
    got = json_take_token_ids(raw, "input_ids")
    assert got is not None and got[0].tolist() == long_prompt
    assert got[1] == b'{"model": "m", "input_ids": [], "sampling_params": {"n": 2}}'
    accented = json_take_token_ids('{"prompt": "x", "é_ids": [4, 5]}'.encode(), "é_ids")  # the key's UTF-8
    assert accented is not None and accented[0].tolist() == [4, 5]
    for wrong in (("{}", "k"), (b"{}", b"k"), (b"{}",)):
        with pytest.raises(TypeError, match=r"takes data \(bytes\) and a key \(str\)"):
            json_take_token_ids(*wrong)  # type: ignore[arg-type]
