"""psrl._wire: token ids as protobuf's own packed field, every bad id refused by index; a JSON body's opening
brackets counted."""

from __future__ import annotations

import random

import pytest
from smg_grpc_proto.generated import vllm_engine_pb2

from psrl._wire import json_opens, packed_uint32
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
