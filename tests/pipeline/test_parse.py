"""Request parsing: typed fields, vLLM/SGLang defaults, and a BadRequest naming every problem."""

from __future__ import annotations

import json
from array import array

import pytest
from smg_grpc_proto.generated import vllm_engine_pb2

from psrl.router.errors import BadRequest, PayloadTooLarge
from psrl.router.pipeline import parse as P
from psrl.router.pipeline.context import GenerationInput, SamplingSpec

MSG = [{"role": "user", "content": "hi"}]


def _wire(sampling: SamplingSpec):
    """The sampling settings as a Generate request carries them."""
    return vllm_engine_pb2.GenerateRequest.FromString(GenerationInput("r", [1], sampling).to_wire(0)).sampling_params


def test_chat_defaults_and_extras() -> None:
    chat = P.parse_chat({"messages": MSG})
    assert chat.sampling.max_tokens is None and chat.sampling.temperature is None and chat.sampling.top_k == -1
    assert chat.sampling.logprobs is None and not chat.stream
    chat = P.parse_chat(
        {
            "messages": MSG,
            "max_completion_tokens": 5,
            "max_tokens": 9,
            "logprobs": True,
            "top_logprobs": 3,
            "top_k": 4,
            "stop_token_ids": [7],
            "seed": 1,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    )
    s = chat.sampling
    assert (s.max_tokens, s.logprobs, s.top_k, s.stop_token_ids, s.seed) == (5, 3, 4, [7], 1)
    assert chat.include_usage and chat.stream
    proto = _wire(s)
    assert proto.max_tokens == 5 and proto.logprobs == 3 and proto.top_k == 4 and not proto.HasField("temperature")


def test_chat_content_parts_and_developer_role() -> None:
    chat = P.parse_chat(
        {
            "messages": [
                {"role": "developer", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {"role": "assistant", "content": None, "tool_calls": []},
            ]
        }
    )
    assert chat.messages[0] == {"role": "system", "content": "ab"}
    assert chat.messages[1]["content"] == ""


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({}, "'messages' is required"),
        ({"messages": MSG, "temperature": -1}, "temperature"),
        ({"messages": MSG, "temperature": float("nan")}, "temperature"),
        ({"messages": MSG, "top_k": 0}, "top_k"),
        ({"messages": MSG, "max_tokens": True}, "max_tokens"),
        ({"messages": MSG, "top_logprobs": 2}, "needs 'logprobs'"),
        ({"messages": MSG, "stop": [1]}, "stop"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "text part"),
        ({"messages": [{"role": "user"}]}, "content is required"),
        ({"messages": MSG, "tools": "x"}, "tools"),
        ({"messages": MSG, "stream_options": 3}, "stream_options"),
        # what the proto cannot carry: int32 seeds (choice i samples with seed + i), uint32 counts
        ({"messages": MSG, "seed": 2**31}, "seed"),
        ({"messages": MSG, "seed": 2**31 - 1, "n": 2}, "seed"),
        ({"messages": MSG, "seed": -2}, "seed"),
        ({"messages": MSG, "max_tokens": 2**32}, "max_tokens"),
        ({"messages": MSG, "min_tokens": 2**32}, "min_tokens"),
        ({"messages": MSG, "top_k": 2**32}, "top_k"),
    ],
)
def test_chat_errors_name_the_problem(body, needle) -> None:
    with pytest.raises(BadRequest, match=needle):
        P.parse_chat(body)


def test_seed_minus_one_is_no_seed_as_in_vllm() -> None:
    assert P.parse_chat({"messages": MSG, "seed": -1}).sampling.seed is None
    assert P.parse_chat({"messages": MSG, "seed": 2**31 - 2, "n": 2}).sampling.seed == 2**31 - 2
    body = {"input_ids": [1], "sampling_params": {"sampling_seed": 2**31 - 1, "n": 3}}
    with pytest.raises(BadRequest, match="sampling_seed"):
        P.parse_generate(body)


def test_completion_prompt_forms() -> None:
    assert P.parse_completion({"prompt": "x"}).prompts == ["x"]
    assert P.parse_completion({"prompt": [1, 2]}).prompts == [[1, 2]]
    # one prompt's ids as the read stage gives them (psrl.serving.loads_token_ids)
    read = P.parse_json_body(b'{"prompt": [1, 2], "max_tokens": 3}', 1 << 20, "prompt")
    assert P.parse_completion(read).prompts == [array("I", [1, 2])]
    for batch in (b'{"prompt": [[1], [2, 3]]}', b'{"prompt": ["a", "b"]}'):  # read as JSON
        assert P.parse_completion(P.parse_json_body(batch, 1 << 20, "prompt")).prompts == json.loads(batch)["prompt"]
    assert P.parse_completion({"prompt": [[1], [2, 3]]}).prompts == [[1], [2, 3]]
    assert P.parse_completion({"prompt": ["a", "b"]}).prompts == ["a", "b"]
    assert P.parse_completion({"prompt": "x"}).sampling.max_tokens == 16  # OpenAI's default
    with pytest.raises(BadRequest, match="one prompt"):
        P.parse_completion({"prompt": ["a", "b"], "stream": True})
    with pytest.raises(BadRequest, match="echo"):
        P.parse_completion({"prompt": "x", "echo": True})


def test_generate_shape() -> None:
    g = P.parse_generate(
        {
            "input_ids": [1, 2],
            "request_id": 77,
            "return_logprob": True,
            "sampling_params": {"max_new_tokens": 9, "temperature": 0.5, "top_k": -1, "sampling_seed": 4},
        }
    )
    assert g.prompts == [[1, 2]] and g.request_ids == ["77"] and not g.batched
    assert g.sampling.max_tokens == 9 and g.sampling.logprobs == 0 and g.sampling.seed == 4
    assert P.parse_generate({"input_ids": [1]}).sampling.max_tokens == P.GENERATE_DEFAULT_MAX_NEW_TOKENS
    batch = P.parse_generate({"input_ids": [[1], [2]], "request_id": ["a", "b"]})
    assert batch.batched and batch.request_ids == ["a", "b"]
    with pytest.raises(BadRequest, match="request_id"):
        P.parse_generate({"input_ids": [[1], [2]], "request_id": "a"})
    with pytest.raises(BadRequest, match="stream"):
        P.parse_generate({"input_ids": [1], "stream": True})
    with pytest.raises(BadRequest, match="empty"):
        P.parse_generate({"input_ids": []})
    sp = {"n": 2, "stop": "</a>", "no_stop_trim": True}
    assert P.parse_generate({"input_ids": [1], "sampling_params": sp}).sampling.n == 2
    assert P.parse_generate({"input_ids": [1], "sampling_params": sp}).sampling.include_stop_str_in_output
    with pytest.raises(BadRequest, match="'n' must be <= 128"):
        P.parse_generate({"input_ids": [1], "sampling_params": {"n": 129}})


@pytest.mark.parametrize(
    ("ids", "needle"),
    [
        ([1, True], "must be a list of integer token ids .item 1 is bool"),
        ([1, 2.5], "must be a list of integer token ids .item 1 is float"),
        ([[1], ["a"]], "item 0 is str"),
        ([3, -1], "negative or too large token id .item 1"),
        ([2**32], "negative or too large"),
    ],
)
def test_generate_token_ids_are_checked(ids: list, needle: str) -> None:
    with pytest.raises(BadRequest, match=needle) as e:
        P.parse_generate({"input_ids": ids})
    assert e.value.param == "input_ids"
    with pytest.raises(BadRequest, match="stop_token_ids"):
        P.parse_generate({"input_ids": [1], "sampling_params": {"stop_token_ids": ids}})


def test_sampling_fields_read_only_when_present() -> None:
    """Absent and null fields keep the spec's defaults; the seed is bounded by n whatever the body's order."""
    sp = {"seed": 2**31 - 2, "temperature": None, "top_p": None, "n": 2, "skip_special_tokens": False}
    s = P.parse_generate({"input_ids": [1], "sampling_params": sp}).sampling
    assert (s.seed, s.n, s.temperature, s.top_p, s.skip_special_tokens) == (2**31 - 2, 2, None, 1.0, False)
    assert P.parse_generate({"input_ids": [1]}).sampling == SamplingSpec(max_tokens=P.GENERATE_DEFAULT_MAX_NEW_TOKENS)
    with pytest.raises(BadRequest, match="'seed' \\+ n - 1"):
        P.parse_chat({"messages": MSG, "seed": 2**31 - 1, "top_p": 0.5, "n": 2})


def test_n_and_stop_strings() -> None:
    chat = P.parse_chat({"messages": [{"role": "user", "content": "hi"}], "n": 3, "stop": "x"})
    assert chat.sampling.n == 3 and chat.sampling.stop == ["x"] and not chat.sampling.include_stop_str_in_output
    proto = _wire(chat.sampling)
    assert proto.n == 3 and list(proto.stop) == ["x"] and not proto.include_stop_str_in_output
    cmpl = P.parse_completion({"prompt": "a", "stop": ["x", "yz"], "include_stop_str_in_output": True})
    assert cmpl.sampling.stop == ["x", "yz"] and _wire(cmpl.sampling).include_stop_str_in_output
    for bad in ({"n": 0}, {"stop": ["x", ""]}, {"stop": 3}):
        with pytest.raises(BadRequest):
            P.parse_completion({"prompt": "a", **bad})


def test_json_body() -> None:
    assert P.parse_json_body(b'{"a": 1}', 100) == {"a": 1}
    with pytest.raises(PayloadTooLarge):
        P.parse_json_body(b"{}" * 100, 10)
    with pytest.raises(BadRequest, match="not valid JSON"):
        P.parse_json_body(b"\xff\xfe", 100)


@pytest.mark.parametrize(
    ("body", "text"),
    [
        ({"prompt": "once upon"}, "once upon"),
        ({"prompt": ["first", "second"]}, "first"),
        ({"prompt": [1, 2, 3]}, None),  # token ids: no text
        ({"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]}, "be briefhi"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url"}]}]}, "a"),
        ({"system": "sys", "messages": [{"role": "user", "content": [{"type": "text", "text": "q"}]}]}, "sysq"),
        ({"instructions": "i", "input": "question"}, "iquestion"),
        ({"input": [{"role": "user", "content": [{"type": "input_text", "text": "x"}]}]}, "x"),
        ({"messages": {"role": "user"}, "input": 7}, None),  # not checked here: the worker refuses it
    ],
)
def test_routing_text_reads_what_a_prefix_aware_policy_matches_on(body, text) -> None:
    assert P.routing_text(body) == text
