"""tool_choice as vLLM 0.32 serves it (pipeline/tool_choice.py): validation, what the template is offered, the
structural tag a forced call sends the replica (compared with vLLM's own builder), a loop-back without it, and
the 400 a replica's refusal becomes. Also the reply text kept as vLLM's hermes parser keeps it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from smg_grpc_proto.generated import vllm_engine_pb2

from psrl.router.errors import BadRequest, PromptOverflow
from psrl.router.pipeline import respond as R
from psrl.router.pipeline.context import GenerationInput
from psrl.router.pipeline.parse import parse_chat
from psrl.router.pipeline.partial_rollout import RolloutState
from psrl.router.pipeline.tool_calls import HermesToolParser
from psrl.router.pipeline.tool_choice import (
    ConstrainedSampling,
    ToolChoice,
    hermes_structural_tag,
    parse_tool_choice,
    refusal_of,
)
from psrl.worker.model_folder import build_tiny_model_folder

MSG = [{"role": "user", "content": "Weather?"}]
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    },
    {"type": "function", "function": {"name": "noargs"}},
]
NAMED = {"type": "function", "function": {"name": "noargs"}}


def _chat(**body: Any):
    return parse_chat({"messages": MSG, **body})


def _request(gen: GenerationInput) -> vllm_engine_pb2.GenerateRequest:
    return vllm_engine_pb2.GenerateRequest.FromString(gen.to_wire(0))


def _constraint(chat) -> str | None:
    params = _request(GenerationInput("r", [1], chat.sampling)).sampling_params
    kind = params.WhichOneof("constraint")
    assert kind in (None, "structural_tag")
    return params.structural_tag if kind else None


def test_the_default_is_auto_with_tools_and_none_without() -> None:
    assert parse_tool_choice(None, TOOLS) == ToolChoice("auto")
    assert parse_tool_choice(None, None) == ToolChoice("none")
    chat = _chat(tools=TOOLS)
    assert chat.tool_choice == ToolChoice("auto") and chat.tools == TOOLS and _constraint(chat) is None


def test_none_offers_the_template_no_tools() -> None:
    chat = _chat(tools=TOOLS, tool_choice="none")
    assert chat.tool_choice == ToolChoice("none") and chat.tools is None and _constraint(chat) is None


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"tool_choice": "sometimes", "tools": TOOLS}, "invalid tool_choice 'sometimes'"),
        ({"tool_choice": {"type": "function"}, "tools": TOOLS}, "invalid tool_choice object"),
        ({"tool_choice": {"type": "function", "function": {"name": ""}}, "tools": TOOLS}, "invalid tool_choice"),
        ({"tool_choice": 3, "tools": TOOLS}, "must be a string or an object"),
        ({"tool_choice": "required"}, "needs 'tools'"),
        ({"tool_choice": NAMED}, "needs 'tools'"),
        ({"tool_choice": "required", "tools": [{"type": "function"}]}, "needs 'tools' with named functions"),
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": TOOLS}, "not one of"),
    ],
)
def test_bad_tool_choices_are_400s_naming_it(body: dict[str, Any], message: str) -> None:
    with pytest.raises(BadRequest, match=message) as e:
        _chat(**body)
    assert e.value.param == "tool_choice"


def test_auto_without_tools_is_accepted() -> None:
    assert _chat(tool_choice="auto").tool_choice == ToolChoice("auto")


def test_a_forced_call_sends_the_replica_a_structural_tag() -> None:
    chat = _chat(tools=TOOLS, tool_choice="required", logprobs=True, top_logprobs=2, max_tokens=9)
    assert isinstance(chat.sampling, ConstrainedSampling) and chat.tools == TOOLS
    assert chat.sampling.logprobs == 2 and chat.sampling.max_tokens == 9  # the rest of the sampling is kept
    tag = json.loads(_constraint(chat) or "")
    assert tag == hermes_structural_tag(ToolChoice("required"), TOOLS, True)
    assert tag["format"]["at_least_one"] is True and tag["format"]["stop_after_first"] is False
    assert [t["begin"] for t in tag["format"]["tags"]] == [
        '<tool_call>\n{"name": "get_weather", "arguments": ',
        '<tool_call>{"name": "get_weather", "arguments": ',
        '<tool_call>\n{"name": "noargs", "arguments": ',
        '<tool_call>{"name": "noargs", "arguments": ',
    ]
    named = json.loads(_constraint(_chat(tools=TOOLS, tool_choice=NAMED)) or "")
    assert {t["begin"].split('"')[3] for t in named["format"]["tags"]} == {"noargs"}
    assert named["format"]["stop_after_first"] is True
    single = json.loads(_constraint(_chat(tools=TOOLS, tool_choice="required", parallel_tool_calls=False)) or "")
    assert single["format"]["stop_after_first"] is True


def test_a_loop_back_continues_without_the_constraint() -> None:
    """The replica would start the grammar over at the continuation's first token, mid-call: the partial-rollout
    loop-back (dataclasses.replace of the sampling) leaves the constraint out; a retry of the same input keeps it."""
    chat = _chat(tools=TOOLS, tool_choice="required", max_tokens=10)
    original = GenerationInput("r", [1, 2, 3], chat.sampling)
    assert _request(original).sampling_params.WhichOneof("constraint") == "structural_tag"
    state = RolloutState(original)
    state.output_ids = [4, 5]
    looped = state.next_input()
    assert looped.prompt_ids == [1, 2, 3, 4, 5] and looped.sampling.max_tokens == 8
    assert _request(looped).sampling_params.WhichOneof("constraint") is None
    assert _request(original).sampling_params.WhichOneof("constraint") == "structural_tag"


def test_a_replicas_refusal_of_the_constraint_is_a_400_naming_tool_choice() -> None:
    refused = BadRequest("structured output (a constraint) is not supported by the reference replica")
    explained = refusal_of(ToolChoice("required"), refused)
    assert explained is not None and explained.param == "tool_choice" and explained.status == 400
    assert "tool_choice 'required' cannot be honoured" in explained.message and refused.message in explained.message
    assert refusal_of(ToolChoice("auto"), refused) is None  # nothing was constrained
    assert refusal_of(ToolChoice("required"), BadRequest("'temperature' must be <= 2")) is None
    assert refusal_of(ToolChoice("required"), PromptOverflow("longer than the maximum model length")) is None
    named = refusal_of(ToolChoice("function", "f"), refused)
    assert named is not None and "{'type': 'function', 'function': {'name': 'f'}}" in named.message


def test_a_named_choice_ends_with_stop() -> None:
    assert R.chat_finish_reason(True, "stop") == "tool_calls"
    assert R.chat_finish_reason(True, "stop", named_tool=True) == "stop"
    assert R.chat_finish_reason(True, "length", named_tool=True) == "length"


# ---- what vLLM 0.32 itself does ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vllm_hermes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Any]]:
    """vLLM's composed parser class with the hermes tool parser, and its tokenizer for the tiny model."""
    pytest.importorskip("vllm")
    from vllm.parser.parser_manager import ParserManager
    from vllm.tokenizers import get_tokenizer

    tok = get_tokenizer(str(build_tiny_model_folder(Path(tmp_path_factory.mktemp("tiny")))))
    yield ParserManager.get_parser(tool_parser_name="hermes", enable_auto_tools=True, tokenizer=tok), tok


@pytest.mark.vllm  # needs vLLM itself: runs in the vLLM stage
@pytest.mark.parametrize(
    ("tool_choice", "parallel", "strict"),
    [("required", None, False), ("required", False, False), (NAMED, None, False), ("required", None, True)],
)
def test_the_structural_tag_is_the_one_vllm_sends(vllm_hermes, tool_choice: Any, parallel: Any, strict: bool) -> None:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    parser_cls, tok = vllm_hermes
    tools = json.loads(json.dumps(TOOLS))
    tools[0]["function"]["strict"] = strict
    extra = {} if parallel is None else {"parallel_tool_calls": parallel}
    request = ChatCompletionRequest(model="m", messages=MSG, tools=tools, tool_choice=tool_choice, **extra)
    request = parser_cls(tok, tools=request.tools).adjust_request(request)
    theirs = json.loads(request.structured_outputs.structural_tag)
    ours = json.loads(_constraint(_chat(tools=tools, tool_choice=tool_choice, **extra)) or "")
    assert ours == theirs


@pytest.mark.vllm  # needs vLLM itself: runs in the vLLM stage
@pytest.mark.parametrize(
    "text", [" astersaus", "  Hello there.\n", "\n", "Hi <tool_call>{oops}</tool_call> ", "a < b", "  <think>cut"]
)
def test_a_reply_without_calls_is_the_content_vllm_returns(vllm_hermes, text: str) -> None:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    parser_cls, tok = vllm_hermes
    request = ChatCompletionRequest(model="m", messages=MSG, tools=TOOLS)
    _, content, calls = parser_cls(tok, tools=request.tools).parse(text, request, enable_auto_tools=True)
    assert not calls
    assert HermesToolParser().parse(text).content == content
