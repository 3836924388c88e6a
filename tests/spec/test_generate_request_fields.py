"""The GenerateRequest the router builds sets a proto3 `optional` field only when it carries a value.

vLLM's servicer reads presence (`HasField`), not the value: an `optional` string set to "" is present on the
wire and parsed as JSON there, so every generation request was refused.
"""

from __future__ import annotations

from dataclasses import fields

import pytest
from smg_grpc_proto.generated import vllm_engine_pb2

from psrl.router.pipeline.context import GenerationInput, SamplingSpec


def _present_optionals(message) -> set[str]:
    """Names of the message's proto3 `optional` fields that are present (recursing into set sub-messages)."""
    synthetic = [f for f in message.DESCRIPTOR.fields if f.containing_oneof and f.containing_oneof.name.startswith("_")]
    return {f.name for f in synthetic if message.HasField(f.name)}


def test_unset_optionals_stay_absent() -> None:
    gen = GenerationInput(request_id="r", prompt_ids=[1, 2], sampling=SamplingSpec())
    wire = vllm_engine_pb2.GenerateRequest.FromString(gen.to_wire(dp_rank=0))
    assert _present_optionals(wire) == {"data_parallel_rank"}
    assert _present_optionals(wire.sampling_params) == set()
    assert wire.sampling_params.WhichOneof("constraint") is None


def test_set_optionals_are_present() -> None:
    sampling = SamplingSpec(temperature=0.0, max_tokens=4, logprobs=0, seed=7)
    gen = GenerationInput(request_id="r", prompt_ids=[1], sampling=sampling, kv_transfer_params_json='{"a": 1}')
    wire = vllm_engine_pb2.GenerateRequest.FromString(gen.to_wire(dp_rank=1))
    assert _present_optionals(wire) == {"data_parallel_rank", "kv_transfer_params_json"}
    # temperature 0 and logprobs 0 are values, not "unset": they must be present
    assert _present_optionals(wire.sampling_params) == {"temperature", "max_tokens", "logprobs", "seed"}
    assert wire.sampling_params.temperature == 0.0 and wire.sampling_params.logprobs == 0


def test_every_sampling_setting_reaches_the_wire() -> None:
    """The request is built in place, field by field: none of SamplingSpec's settings may be left behind."""
    want = {
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 7,
        "min_p": 0.1,
        "max_tokens": 9,
        "min_tokens": 2,
        "stop": ["a", "bc"],
        "include_stop_str_in_output": True,
        "stop_token_ids": [5, 6],
        "ignore_eos": True,
        "skip_special_tokens": False,
        "logprobs": 3,
        "seed": 11,
        "repetition_penalty": 1.5,
        "presence_penalty": 0.25,
        "frequency_penalty": -0.5,
        "n": 4,
    }
    assert set(want) == {f.name for f in fields(SamplingSpec)}  # every setting is set and checked
    sampling = SamplingSpec(**want)  # type: ignore[arg-type]
    gen = GenerationInput(request_id="r", prompt_ids=[3, 1, 2], sampling=sampling, stream=True)
    wire = vllm_engine_pb2.GenerateRequest.FromString(gen.to_wire(dp_rank=2))
    assert (wire.request_id, list(wire.tokenized.input_ids), wire.stream, wire.data_parallel_rank) == (
        "r",
        [3, 1, 2],
        True,
        2,
    )
    p = wire.sampling_params
    got = {name: getattr(p, name) for name in want}
    got["stop"], got["stop_token_ids"] = list(p.stop), list(p.stop_token_ids)
    for name, value in want.items():  # approx: the proto's floats are 32-bit
        assert got[name] == (pytest.approx(value) if isinstance(value, float) else value), name
