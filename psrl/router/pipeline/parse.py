"""The read and parse stages' checks: validate a request body into typed fields. Pure; every problem is a
BadRequest naming it."""

from __future__ import annotations

import math
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from psrl._wire import packed_uint32
from psrl.router.errors import BadRequest, PayloadTooLarge
from psrl.router.pipeline.context import SamplingSpec, TokenIds
from psrl.router.pipeline.tool_choice import ConstrainedSampling, ToolChoice, hermes_structural_tag, parse_tool_choice
from psrl.serving.json_body import JsonBodyError, loads_bounded, loads_token_ids
from psrl.tokenizer import TEMPLATE_CALL_ARGS, lone_surrogate_at

_MISSING = object()
CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
# SGLang's default for /generate when max_new_tokens is not sent.
GENERATE_DEFAULT_MAX_NEW_TOKENS = 128
# OpenAI's bound on `n`; each choice is a sequence the replica runs and the router streams.
MAX_N = 128


def parse_json(raw: bytes, max_bytes: int, ids_field: str | None = None) -> Any:
    """The body's JSON value (None for an empty body); with `ids_field`, that field of an object as an
    array('I') where it is a flat array of token ids (`loads_token_ids`). The server refuses oversized bodies
    while reading them; the size check here keeps the stage correct on its own."""
    if len(raw) > max_bytes:
        raise PayloadTooLarge(f"request body is {len(raw)} bytes; the limit is {max_bytes}")
    try:
        if not raw:
            return None
        return loads_bounded(raw) if ids_field is None else loads_token_ids(raw, ids_field)
    except JsonBodyError as e:
        raise BadRequest(str(e)) from None


def parse_json_body(raw: bytes, max_bytes: int, ids_field: str | None = None) -> dict[str, Any]:
    body = parse_json(raw, max_bytes, ids_field)
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    return body


# ---- typed field readers -------------------------------------------------------------------------------


def _present(body: dict[str, Any], name: str) -> Any:
    """A field's value, or _MISSING when it is absent or null. (The typed readers below, which run for every
    field of every request, read it the same way inline: `body.get(name) is None`.)"""
    value = body.get(name, _MISSING)
    return _MISSING if value is None else value


def get_bool(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise BadRequest(f"'{name}' must be a boolean, got {type(value).__name__}", param=name)
    return value


INT32_MAX = 2**31 - 1
UINT32_MAX = 2**32 - 1  # the proto's uint32 fields: past it a request cannot be encoded


def _seed(body: dict[str, Any], n: int, name: str = "seed") -> int | None:
    """vLLM's int32 seed (-1, like unset, is no seed); choice i of an n > 1 request samples with seed + i."""
    seed = get_int(body, name, None, minimum=-1, maximum=INT32_MAX)
    if seed is None or seed == -1:
        return None
    if seed + n - 1 > INT32_MAX:
        raise BadRequest(f"'{name}' + n - 1 must fit in an int32 (choice i samples with seed + i)", param=name)
    return seed


def get_int(
    body: dict[str, Any],
    name: str,
    default: int | None,
    *,
    minimum: int | None = None,
    maximum: int | None = None,
) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"'{name}' must be an integer, got {type(value).__name__}", param=name)
    if minimum is not None and value < minimum:
        raise BadRequest(f"'{name}' must be >= {minimum}, got {value}", param=name)
    if maximum is not None and value > maximum:
        raise BadRequest(f"'{name}' must be <= {maximum}, got {value}", param=name)
    return value


def get_float(
    body: dict[str, Any],
    name: str,
    default: float | None,
    *,
    minimum: float | None = None,
    maximum: float | None = None,
    exclusive_min: bool = False,
) -> float | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise BadRequest(f"'{name}' must be a finite number, got {value!r}", param=name)
    value = float(value)
    if minimum is not None and (value <= minimum if exclusive_min else value < minimum):
        op = ">" if exclusive_min else ">="
        raise BadRequest(f"'{name}' must be {op} {minimum}, got {value}", param=name)
    if maximum is not None and value > maximum:
        raise BadRequest(f"'{name}' must be <= {maximum}, got {value}", param=name)
    return value


def get_str(body: dict[str, Any], name: str, default: str | None) -> str | None:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, str):
        raise BadRequest(f"'{name}' must be a string, got {type(value).__name__}", param=name)
    return value


def get_token_ids(value: Any, name: str) -> TokenIds:
    """Checked in C as the Generate request will carry them (psrl._wire): ints, not booleans, in [0, 2**32). An
    array('I') (`parse_json`'s `ids_field`) holds nothing else."""
    if isinstance(value, array):
        return value
    if not isinstance(value, list):
        raise BadRequest(f"'{name}' must be a list of integer token ids", param=name)
    try:
        packed_uint32(1, value)  # only the check is wanted here: any field number does
    except TypeError as e:
        raise BadRequest(f"'{name}' must be a list of integer token ids ({e})", param=name) from None
    except OverflowError as e:
        raise BadRequest(f"'{name}' holds a negative or too large token id ({e})", param=name) from None
    return value


def check_text(value: str, name: str) -> str:
    """Text bound for the tokenizer (or a proto string) must be valid Unicode. JSON can carry a lone surrogate
    ("\\ud800"), which has no UTF-8 form: the tokenizer and protobuf both refuse it."""
    position = lone_surrogate_at(value)
    if position is not None:
        raise _lone_surrogate(name, value, position, name)
    return value


def _lone_surrogate(what: str, text: str, position: int, param: str) -> BadRequest:
    return BadRequest(
        f"{what} holds a lone surrogate {text[position]!a} at character {position}, which is not valid Unicode "
        "(an escaped surrogate must be half of a pair)",
        param=param,
    )


def check_json_text(value: Any, name: str) -> None:
    """check_text over every string of a JSON value, object keys included; the error names the string's path
    (e.g. messages[2].tool_calls[0].function.arguments). Iterative: a deep value cannot exhaust the stack."""
    stack: list[tuple[Any, str]] = [(value, name)]
    while stack:
        node, path = stack.pop()
        if isinstance(node, str):
            check_text(node, path)
            continue
        children: list[tuple[Any, str]] = []
        if isinstance(node, dict):
            for key, child in node.items():
                position = lone_surrogate_at(key) if isinstance(key, str) else None
                if position is not None:
                    raise _lone_surrogate(f"a key of {path}", key, position, path)
                if isinstance(child, str | dict | list):
                    children.append((child, f"{path}.{key}"))
        elif isinstance(node, list):
            children = [(child, f"{path}[{i}]") for i, child in enumerate(node) if isinstance(child, str | dict | list)]
        stack.extend(reversed(children))  # depth first, in document order


def get_stop(body: dict[str, Any]) -> list[str]:
    value = _present(body, "stop")
    if value is _MISSING:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise BadRequest("'stop' must be a string or a list of strings", param="stop")
    if not all(stops):
        raise BadRequest("'stop' cannot contain an empty string", param="stop")
    for stop in stops:
        check_text(stop, "stop")
    return stops


# The sampling fields every text API shares, each with its reader (the value it gives a null field is the
# spec's default). Only the fields a body has are read: most requests set two or three of them.
_SAMPLING_READERS: dict[str, Callable[[dict[str, Any], str], Any]] = {
    "temperature": lambda b, k: get_float(b, k, None, minimum=0.0),
    "top_p": lambda b, k: get_float(b, k, 1.0, minimum=0.0, maximum=1.0, exclusive_min=True),
    "top_k": lambda b, k: _top_k(b),
    "min_p": lambda b, k: get_float(b, k, 0.0, minimum=0.0, maximum=1.0),
    "min_tokens": lambda b, k: get_int(b, k, 0, minimum=0, maximum=UINT32_MAX),
    "stop": lambda b, k: get_stop(b),
    "include_stop_str_in_output": lambda b, k: get_bool(b, k, False),
    "stop_token_ids": lambda b, k: [] if b[k] is None else get_token_ids(b[k], k),
    "ignore_eos": lambda b, k: get_bool(b, k, False),
    "skip_special_tokens": lambda b, k: get_bool(b, k, True),
    "repetition_penalty": lambda b, k: get_float(b, k, 1.0, minimum=0.0, exclusive_min=True),
    "presence_penalty": lambda b, k: get_float(b, k, 0.0, minimum=-2.0, maximum=2.0),
    "frequency_penalty": lambda b, k: get_float(b, k, 0.0, minimum=-2.0, maximum=2.0),
    "n": lambda b, k: get_int(b, k, 1, minimum=1, maximum=MAX_N),
}


def _common_sampling(body: dict[str, Any], max_tokens: int | None) -> SamplingSpec:
    """The shared sampling fields, checked in the body's order; `seed` after the others, as its bound depends
    on `n` (choice i samples with seed + i)."""
    spec = SamplingSpec(max_tokens=max_tokens)
    readers = _SAMPLING_READERS
    for name in body:
        read = readers.get(name)
        if read is not None:
            setattr(spec, name, read(body, name))
    if "seed" in body:
        spec.seed = _seed(body, spec.n)
    return spec


def _top_k(body: dict[str, Any]) -> int:
    top_k = get_int(body, "top_k", -1, maximum=UINT32_MAX)
    assert top_k is not None
    if top_k == 0 or top_k < -1:
        raise BadRequest(f"'top_k' must be -1 (off) or >= 1, got {top_k}", param="top_k")
    return top_k


def _stream_usage(body: dict[str, Any]) -> tuple[bool, bool]:
    """`stream_options` as vLLM reads them: (include_usage, continuous_usage_stats), the second only with the
    first (usage on every chunk as well as the final `choices: []` one)."""
    options = _present(body, "stream_options")
    if options is _MISSING:
        return False, False
    if not isinstance(options, dict):
        raise BadRequest("'stream_options' must be an object", param="stream_options")
    include = get_bool(options, "include_usage", False)
    return include, include and get_bool(options, "continuous_usage_stats", False)


def routing_text(body: dict[str, Any]) -> str | None:
    """The prompt's text, for a prefix-aware policy to match a request proxied to an HTTP worker on: a completion's
    (first) prompt, or the text of a chat, Responses or Messages body's instructions and messages. Nothing is
    checked here (the worker checks what it is sent): what is not text is left out, and None means no text."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt:
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    parts: list[str] = []
    for key in ("system", "instructions", "messages", "input"):
        _add_text(body.get(key), parts)
    return "".join(parts) or None


def _add_text(value: Any, parts: list[str]) -> None:
    """The text of a string, of a list of content parts, or of a list of messages whose content is either."""
    if isinstance(value, str):
        parts.append(value)
    elif isinstance(value, list):
        for item in value:
            if isinstance(item, str):
                parts.append(item)
            elif isinstance(item, dict):
                text = item.get("text")
                if isinstance(text, str):
                    parts.append(text)
                elif "content" in item:
                    _add_text(item["content"], parts)


# ---- OpenAI chat ----------------------------------------------------------------------------------------


@dataclass
class ChatRequest:
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    sampling: SamplingSpec
    stream: bool
    include_usage: bool
    logprobs: bool
    add_generation_prompt: bool = True
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    continuous_usage: bool = False  # stream_options.continuous_usage_stats (with include_usage)
    # `tools` holds what the template offers and the parser looks for: none for tool_choice "none".
    tool_choice: ToolChoice = field(default_factory=lambda: ToolChoice("auto"))


def _message_content(message: dict[str, Any], index: int) -> str:
    content = message.get("content")
    if content is None:
        if message.get("role") == "assistant":
            return ""
        raise BadRequest(f"messages[{index}].content is required", param=f"messages[{index}].content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise BadRequest(
                    f"messages[{index}].content[{j}] must be a text part ({{'type': 'text', 'text': ...}}); "
                    "this model takes text only",
                    param=f"messages[{index}].content",
                )
            parts.append(part["text"])
        return "".join(parts)
    raise BadRequest(
        f"messages[{index}].content must be a string or a list of parts", param=f"messages[{index}].content"
    )


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    messages = _present(body, "messages")
    if messages is _MISSING:
        raise BadRequest("'messages' is required", param="messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list", param="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise BadRequest(f"messages[{i}] must be an object", param=f"messages[{i}]")
        role = m.get("role")
        if not isinstance(role, str) or role not in CHAT_ROLES:
            raise BadRequest(
                f"messages[{i}].role must be one of {sorted(CHAT_ROLES)}, got {role!r}",
                param=f"messages[{i}].role",
            )
        normalized = dict(m)
        normalized["role"] = "system" if role == "developer" else role
        normalized["content"] = _message_content(m, i)
        tool_calls = m.get("tool_calls")
        if tool_calls is not None and (role != "assistant" or not isinstance(tool_calls, list)):
            raise BadRequest(
                f"messages[{i}].tool_calls must be a list on an assistant message",
                param=f"messages[{i}].tool_calls",
            )
        out.append(normalized)
    return out


def parse_chat(body: dict[str, Any], *, check_texts: bool = True) -> ChatRequest:
    """`check_texts`: walk every string the template may render for lone surrogates (False when the raw body
    cannot hold one: psrl.serving.may_hold_surrogates)."""
    max_tokens = get_int(body, "max_completion_tokens", None, minimum=1, maximum=UINT32_MAX)
    if max_tokens is None:
        max_tokens = get_int(body, "max_tokens", None, minimum=1, maximum=UINT32_MAX)
    logprobs = get_bool(body, "logprobs", False)
    top_logprobs = get_int(body, "top_logprobs", 0, minimum=0, maximum=20) or 0
    if top_logprobs and not logprobs:
        raise BadRequest("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    sampling = _common_sampling(body, max_tokens)
    sampling.logprobs = top_logprobs if logprobs else None
    tools = _present(body, "tools")
    if tools is _MISSING:
        tools = None
    elif not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise BadRequest("'tools' must be a list of objects", param="tools")
    tool_choice = parse_tool_choice(body.get("tool_choice"), tools)
    if tool_choice.forces_call:
        assert tools is not None  # parse_tool_choice refuses a forced call without tools
        parallel = get_bool(body, "parallel_tool_calls", True)
        sampling = ConstrainedSampling.of(sampling, hermes_structural_tag(tool_choice, tools, parallel))
    kwargs = _present(body, "chat_template_kwargs")
    if kwargs is _MISSING:
        kwargs = {}
    elif not isinstance(kwargs, dict):
        raise BadRequest("'chat_template_kwargs' must be an object", param="chat_template_kwargs")
    taken = sorted(TEMPLATE_CALL_ARGS.intersection(kwargs))
    if taken:
        raise BadRequest(
            f"chat_template_kwargs cannot set {taken[0]!r}: the router's template call sets "
            f"{', '.join(sorted(TEMPLATE_CALL_ARGS))} itself",
            param=f"chat_template_kwargs.{taken[0]}",
        )
    messages = _messages(body)
    # Every string the template may render (content, parts, tool arguments, names, tools, template variables).
    if check_texts:
        for name, value in (("messages", body["messages"]), ("tools", tools), ("chat_template_kwargs", kwargs)):
            check_json_text(value, name)
    include_usage, continuous_usage = _stream_usage(body)
    return ChatRequest(
        messages=messages,
        tools=None if tool_choice.mode == "none" else tools,
        sampling=sampling,
        stream=get_bool(body, "stream", False),
        include_usage=include_usage,
        logprobs=logprobs,
        add_generation_prompt=get_bool(body, "add_generation_prompt", True),
        template_kwargs=kwargs,
        continuous_usage=continuous_usage,
        tool_choice=tool_choice,
    )


# ---- OpenAI completions ---------------------------------------------------------------------------------


@dataclass
class CompletionRequest:
    prompts: list[str | TokenIds]
    sampling: SamplingSpec
    stream: bool
    include_usage: bool
    continuous_usage: bool = False


def parse_completion(body: dict[str, Any]) -> CompletionRequest:
    prompt = _present(body, "prompt")
    if prompt is _MISSING:
        raise BadRequest("'prompt' is required", param="prompt")
    prompts: list[str | TokenIds]
    if isinstance(prompt, str):
        prompts = [check_text(prompt, "prompt")]
    elif isinstance(prompt, array):  # one prompt's ids, read from the body's digits (`read_completion`)
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        prompts = [check_text(p, f"prompt[{i}]") for i, p in enumerate(prompt)]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
        prompts = [get_token_ids(p, "prompt") for p in prompt]
    elif isinstance(prompt, list) and prompt:
        prompts = [get_token_ids(prompt, "prompt")]
    else:
        raise BadRequest("'prompt' must be a string, a list of strings, or token ids", param="prompt")
    if get_bool(body, "echo", False):
        raise BadRequest("'echo' is not supported", param="echo")
    logprobs = get_int(body, "logprobs", None, minimum=0, maximum=20)
    sampling = _common_sampling(body, get_int(body, "max_tokens", 16, minimum=1, maximum=UINT32_MAX))
    sampling.logprobs = logprobs
    stream = get_bool(body, "stream", False)
    if stream and len(prompts) > 1:
        raise BadRequest("streaming supports one prompt per request", param="prompt")
    include_usage, continuous_usage = _stream_usage(body)
    return CompletionRequest(
        prompts=prompts,
        sampling=sampling,
        stream=stream,
        include_usage=include_usage,
        continuous_usage=continuous_usage,
    )


# ---- /generate (SGLang / PSRL shape) ----------------------------------------------------------------------


@dataclass
class GenerateRequestBody:
    prompts: list[TokenIds | str]
    request_ids: list[str | None]
    sampling: SamplingSpec
    return_logprob: bool
    return_prompt_token_ids: bool
    batched: bool
    detokenize: bool = True  # sampling_params.detokenize: the output's text is returned too
    routed_experts_start: int | None = None  # the first position whose routed experts are returned (None: not asked)


def parse_generate(body: dict[str, Any]) -> GenerateRequestBody:
    if get_bool(body, "stream", False):
        raise BadRequest("stream=true is not supported on /generate; use /v1/completions for streaming", param="stream")
    input_ids = _present(body, "input_ids")
    text = _present(body, "text")
    prompts: list[TokenIds | str]
    if input_ids is not _MISSING:
        if isinstance(input_ids, list) and input_ids and all(isinstance(p, list) for p in input_ids):
            prompts, batched = [get_token_ids(p, "input_ids") for p in input_ids], True
        else:
            prompts, batched = [get_token_ids(input_ids, "input_ids")], False
    elif text is not _MISSING:
        if isinstance(text, str):
            prompts, batched = [text], False
        elif isinstance(text, list) and text and all(isinstance(t, str) for t in text):
            prompts, batched = list(text), True
        else:
            raise BadRequest("'text' must be a string or a list of strings", param="text")
    else:
        raise BadRequest("one of 'input_ids' or 'text' is required", param="input_ids")
    if not all(prompts):
        raise BadRequest("prompt is empty", param="input_ids")

    rid = _present(body, "request_id")
    if rid is _MISSING:
        request_ids: list[str | None] = [None] * len(prompts)
    elif batched and isinstance(rid, list) and len(rid) == len(prompts) and all(isinstance(r, str) for r in rid):
        request_ids = list(rid)
    elif not batched and isinstance(rid, (str, int)) and not isinstance(rid, bool):
        request_ids = [str(rid)]
    else:
        raise BadRequest("'request_id' must be a string (a list of strings for a batch)", param="request_id")

    sp = _present(body, "sampling_params")
    if sp is _MISSING:
        sp = {}
    if not isinstance(sp, dict):
        raise BadRequest("'sampling_params' must be an object", param="sampling_params")
    max_new = get_int(sp, "max_new_tokens", GENERATE_DEFAULT_MAX_NEW_TOKENS, minimum=1, maximum=UINT32_MAX)
    sampling = _common_sampling(sp, max_new)
    if "sampling_seed" in sp:  # SGLang's name for it
        sampling.seed = _seed(sp, sampling.n, "sampling_seed")
    # SGLang's spelling of include_stop_str_in_output: the returned text keeps the stop string.
    sampling.include_stop_str_in_output = get_bool(sp, "no_stop_trim", sampling.include_stop_str_in_output)
    return_logprob = get_bool(body, "return_logprob", False)
    top_n = get_int(body, "top_logprobs_num", 0, minimum=0, maximum=20) or 0
    sampling.logprobs = top_n if return_logprob else None
    return GenerateRequestBody(
        prompts=prompts,
        request_ids=request_ids,
        sampling=sampling,
        return_logprob=return_logprob,
        return_prompt_token_ids=get_bool(body, "return_prompt_token_ids", False),
        batched=batched,
        detokenize=(body.get("sampling_params") or {}).get("detokenize", True) is not False,
        routed_experts_start=routed_experts_start(body),
    )


def routed_experts_start(body: dict[str, Any]) -> int | None:
    """SGLang's /generate fields: `return_routed_experts` (bool) and `routed_experts_start_len` (the first position
    reported, 0..prompt length, default 0). None when routed experts are not asked for."""
    asked = body.get("return_routed_experts", False)
    if not isinstance(asked, bool):
        raise BadRequest("return_routed_experts must be a boolean", param="return_routed_experts")
    start = body.get("routed_experts_start_len")
    if start is not None and (not isinstance(start, int) or isinstance(start, bool) or start < 0):
        raise BadRequest("routed_experts_start_len must be a non-negative integer", param="routed_experts_start_len")
    return (start or 0) if asked else None
