"""A chat request's `tool_choice`, served as vLLM 0.32 serves it with the hermes tool parser. Pure.

"auto" (the default when tools are offered) lets the model choose; "none" offers no tools to the template
(vLLM's `--exclude-tools-when-tool-choice-none`) and leaves the reply unparsed; "required" and a named function
(`{"type": "function", "function": {"name": ...}}`) constrain decoding to the hermes tool-call format, as
vLLM does: the replica gets the structural tag vLLM builds (`<tool_call>\\n{"name": "<tool>", "arguments": `,
JSON, `}\\n</tool_call>`, or the same without the newlines; at least one call, only the named tool's and just
one for a named choice, just one when `parallel_tool_calls` is false; the arguments free JSON unless the tool
is `strict`). A replica without structured output refuses the constraint, and the client gets a 400 naming
tool_choice (`refusal_of`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Any, Literal

from smg_grpc_proto.generated import vllm_engine_pb2

from psrl.router.errors import BadRequest
from psrl.router.pipeline.context import SamplingSpec

ToolChoiceMode = Literal["none", "auto", "required", "function"]
_NAMED_USAGE = 'use {"type": "function", "function": {"name": "<one of the tools>"}}'
# What a replica's refusal of a constraint says: the reference replica's "structured output (a constraint) is
# not supported", or vLLM's own words for a grammar it cannot build.
_REFUSAL_MARKERS = ("structured output", "structural", "grammar", "constraint", "guided")


@dataclass(frozen=True)
class ToolChoice:
    mode: ToolChoiceMode
    name: str | None = None  # the function a named choice forces

    @property
    def forces_call(self) -> bool:
        return self.mode in ("required", "function")

    @property
    def named(self) -> bool:
        """A named choice's turn ends with finish_reason "stop", not "tool_calls" (OpenAI's and vLLM's rule)."""
        return self.mode == "function"

    def describe(self) -> str:
        return f"{{'type': 'function', 'function': {{'name': {self.name!r}}}}}" if self.named else repr(self.mode)


def _tool_name(tool: dict[str, Any]) -> Any:
    function = tool.get("function")
    return function.get("name") if isinstance(function, dict) else None


def parse_tool_choice(value: Any, tools: list[dict[str, Any]] | None) -> ToolChoice:
    """`tool_choice` as vLLM validates it (unset: "auto" with tools, else "none"). "auto" and "none" need no
    tools; "required" and a named function do, and the name must be one of them."""
    if value is None:
        return ToolChoice("auto" if tools else "none")
    if isinstance(value, str):
        if value not in ("none", "auto", "required"):
            raise BadRequest(
                f"invalid tool_choice {value!r}: use 'none', 'auto', 'required' or a named function ({_NAMED_USAGE})",
                param="tool_choice",
            )
        choice = ToolChoice(value)  # type: ignore[arg-type]  # one of the literals, checked above
    elif isinstance(value, dict):
        function = value.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if value.get("type") != "function" or not isinstance(name, str) or not name:
            raise BadRequest(f"invalid tool_choice object: {_NAMED_USAGE}", param="tool_choice")
        choice = ToolChoice("function", name)
    else:
        kind = type(value).__name__
        raise BadRequest(f"'tool_choice' must be a string or an object, got {kind}", param="tool_choice")
    if choice.forces_call and not any(_tool_name(t) for t in tools or ()):
        raise BadRequest(f"tool_choice {choice.describe()} needs 'tools' with named functions", param="tool_choice")
    if choice.named and not any(_tool_name(t) == choice.name for t in tools or ()):
        raise BadRequest(
            f"tool_choice names the function {choice.name!r}, which is not one of the request's tools",
            param="tool_choice",
        )
    return choice


def _arguments_schema(function: dict[str, Any]) -> Any:
    """What a call's arguments are held to: the tool's parameters only when it is `strict`, as vLLM's default
    tool strict level does; otherwise any JSON value."""
    parameters = function.get("parameters")
    return parameters if function.get("strict") is True and parameters is not None else True


def hermes_structural_tag(choice: ToolChoice, tools: list[dict[str, Any]], parallel_tool_calls: bool) -> dict[str, Any]:
    """The structural tag (xgrammar's `structural_tag` JSON) vLLM 0.32 sends its engine for `choice`, which must
    force a call, with the hermes parser (`vllm.tool_parsers.structural_tag_registry`, tool strict level auto)."""
    assert choice.forces_call
    functions = [t["function"] for t in tools if t.get("type", "function") == "function" and _tool_name(t)]
    if choice.named:
        functions = [f for f in functions if f["name"] == choice.name]
    tags = [
        {
            "type": "tag",
            "begin": f'{start}{{"name": "{function["name"]}", "arguments": ',
            "content": {
                "type": "json_schema",
                "json_schema": _arguments_schema(function),
                "style": "json",
                "any_order": False,
                "max_whitespace_cnt": None,
                "excludes": [],
            },
            "end": end,
        }
        for function in functions
        for start, end in (("<tool_call>\n", "}\n</tool_call>"), ("<tool_call>", "}</tool_call>"))
    ]
    return {
        "type": "structural_tag",
        "format": {
            "type": "tags_with_separator",
            "tags": tags,
            "separator": "",
            "at_least_one": True,
            "stop_after_first": choice.named or not parallel_tool_calls,
        },
    }


@dataclass
class ConstrainedSampling(SamplingSpec):
    """Sampling whose decoding the replica constrains with a structural tag.

    The tag is not an init field on purpose: a partial-rollout loop-back rebuilds the sampling with
    `dataclasses.replace`, which leaves it out, so the continuation runs unconstrained. The replica would start
    the grammar over at the continuation's first token, in the middle of the call the model was writing."""

    structural_tag: str = field(default="", init=False)

    @classmethod
    def of(cls, sampling: SamplingSpec, structural_tag: dict[str, Any]) -> ConstrainedSampling:
        constrained = cls(**{f.name: getattr(sampling, f.name) for f in fields(SamplingSpec)})
        constrained.structural_tag = json.dumps(structural_tag, ensure_ascii=False)
        return constrained

    def write_to(self, p: vllm_engine_pb2.SamplingParams) -> None:
        super().write_to(p)
        if self.structural_tag:
            p.structural_tag = self.structural_tag


def refusal_of(choice: ToolChoice, error: BadRequest) -> BadRequest | None:
    """The client's 400 when a replica refused the constraint `choice` needs; None for any other 400."""
    if not choice.forces_call or type(error) is not BadRequest:  # prompt overflow, an abort: not about it
        return None
    if not any(marker in error.message.lower() for marker in _REFUSAL_MARKERS):
        return None
    return BadRequest(
        f"tool_choice {choice.describe()} cannot be honoured on this model: the router enforces it by "
        "constraining decoding to a tool call (a structural tag, as vLLM does), and the replica refused the "
        f"constraint ({error.message}). Serve the model on replicas with structured output (vLLM), or send "
        "tool_choice 'auto'.",
        param="tool_choice",
    )


def require_parser(choice: ToolChoice, parses_tool_calls: bool) -> None:
    """A forced call is only worth forcing if the reply is parsed for it."""
    if choice.forces_call and not parses_tool_calls:
        raise BadRequest(
            f"tool_choice {choice.describe()} needs a tool-call parser; this router runs with --tool-call-parser none",
            param="tool_choice",
        )
