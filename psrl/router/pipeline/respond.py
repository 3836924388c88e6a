"""The respond stage: shape a generation as an OpenAI chat/completion object, SSE chunks, or /generate output."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from psrl.router.pipeline.context import Generation, TokenIds
from psrl.router.pipeline.tool_calls import ParsedOutput, StreamPiece
from psrl.router.web import encode_json
from psrl.tokenizer import Tokenizer

if TYPE_CHECKING:
    from psrl.router.selector import Ticket


def instance_headers(ticket: Ticket) -> dict[str, str]:
    """What PSRL reads back and replays as the next turn's hint and version floor."""
    return {
        "x-base-worker-id": ticket.instance.id.base_worker_id,
        "x-target-dp-rank": str(ticket.instance.id.dp_rank),
        "x-version-tag": str(ticket.pinned_version),
    }


def usage(choices: Sequence[Generation]) -> dict[str, Any]:
    """One prompt's usage, as vLLM counts it: its prompt once, every choice's output tokens."""
    prompt = choices[0].prompt_tokens
    completion = sum(g.completion_tokens for g in choices)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": choices[0].cached_tokens},
    }


def sum_usage(prompts: Sequence[Sequence[Generation]]) -> dict[str, Any]:
    """A batch of prompts' usage: the sum of each prompt's."""
    each = [usage(choices) for choices in prompts]
    prompt = sum(u["prompt_tokens"] for u in each)
    completion = sum(u["completion_tokens"] for u in each)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(u["prompt_tokens_details"]["cached_tokens"] for u in each)},
    }


def sse(payload: dict[str, Any]) -> bytes:
    """One SSE event, written by json (an error: rare, and it may echo what msgspec cannot write)."""
    return b"data: %b\n\n" % encode_json(payload)


class SseChunks:
    """A chat or completion stream's events: `{**envelope, "choices": [...]}`, with `usage` last when given.
    The envelope (id, object, created, model) is written once; each event writes only its choice, by msgspec
    unless it carries log-probs (the only floats a chunk holds: see `encode_json`)."""

    def __init__(self, envelope: dict[str, Any]) -> None:
        self._head = b'data: %b,"choices":[' % encode_json(envelope)[:-1]

    def event(self, choice: dict[str, Any] | None, usage: dict[str, Any] | None = None) -> bytes:
        body = b"" if choice is None else encode_json(choice, finite=choice.get("logprobs") is None)
        if usage is None:
            return b"%b%b]}\n\n" % (self._head, body)
        return b'%b%b],"usage":%b}\n\n' % (self._head, body, encode_json(usage, finite=True))


SSE_DONE = b"data: [DONE]\n\n"


# ---- chat ----------------------------------------------------------------------------------------------


def _token_entry(tokenizer: Tokenizer, token_id: int, logprob: float) -> dict[str, Any]:
    text = tokenizer.decode([token_id], skip_special_tokens=False)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(
    tokenizer: Tokenizer, ids: list[int], lps: list[float] | None, top: list[list[tuple[int, float]]] | None
) -> dict[str, Any] | None:
    if lps is None:
        return None
    content = []
    for i, (tid, lp) in enumerate(zip(ids, lps)):
        entry = _token_entry(tokenizer, tid, lp)
        entry["top_logprobs"] = [_token_entry(tokenizer, a, alp) for a, alp in (top[i] if top else [])]
        content.append(entry)
    return {"content": content}


def chat_finish_reason(called_tools: bool, finish_reason: str | None, named_tool: bool = False) -> str | None:
    """OpenAI reports a turn that ended by calling tools as finish_reason "tool_calls", except when the request
    named the tool to call (`named_tool`): then "stop", as OpenAI and vLLM report it."""
    return "tool_calls" if called_tools and finish_reason == "stop" and not named_tool else finish_reason


def chat_stream_delta(piece: StreamPiece, call_index: int) -> dict[str, Any]:
    """A chat chunk's `delta` for one piece of a streamed message (`call_index`: the tool call's number)."""
    if piece.kind == "content":
        return {"content": piece.text}
    if piece.kind == "reasoning":
        return {"reasoning_content": piece.text}
    assert piece.call is not None
    return {"tool_calls": [{"index": call_index, **piece.call}]}


def chat_choice(
    index: int, output: ParsedOutput, gen: Generation, logprobs: dict[str, Any] | None, named_tool: bool = False
) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": output.content, "tool_calls": output.tool_calls}
    if output.reasoning_content is not None:
        message["reasoning_content"] = output.reasoning_content
    return {
        "index": index,
        "message": message,
        "logprobs": logprobs,
        "finish_reason": chat_finish_reason(bool(output.tool_calls), gen.finish_reason, named_tool),
        "stop_reason": gen.stop_reason,
    }


def chat_completion(
    *, request_id: str, created: int, model: str, choices: list[dict[str, Any]], gens: Sequence[Generation]
) -> dict[str, Any]:
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage(gens),
    }


# ---- completions ---------------------------------------------------------------------------------------


def completion_logprobs(
    tokenizer: Tokenizer,
    ids: list[int],
    lps: list[float] | None,
    top: list[list[tuple[int, float]]] | None,
    text_offset: int = 0,
) -> dict[str, Any] | None:
    if lps is None:
        return None
    tokens = [tokenizer.decode([t], skip_special_tokens=False) for t in ids]
    offsets = []
    pos = text_offset
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return {
        "tokens": tokens,
        "token_logprobs": list(lps),
        "top_logprobs": [{tokenizer.decode([a], skip_special_tokens=False): alp for a, alp in alts} for alts in top]
        if top
        else None,
        "text_offset": offsets,
    }


def completion_choice(index: int, text: str, gen: Generation, logprobs: dict[str, Any] | None) -> dict[str, Any]:
    return {
        "index": index,
        "text": text,
        "logprobs": logprobs,
        "finish_reason": gen.finish_reason,
        "stop_reason": gen.stop_reason,
    }


def completion(
    *,
    request_id: str,
    created: int,
    model: str,
    choices: list[dict[str, Any]],
    prompts: Sequence[Sequence[Generation]],
) -> dict[str, Any]:
    return {
        "id": request_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": sum_usage(prompts),
    }


# ---- /generate -----------------------------------------------------------------------------------------


def generate_finish_reason(gen: Generation) -> dict[str, Any]:
    if gen.finish_reason == "length":
        return {"type": "length", "length": gen.completion_tokens}
    if gen.finish_reason == "stop":
        out: dict[str, Any] = {"type": "stop"}
        if gen.stop_reason is not None:
            out["matched"] = gen.stop_reason  # SGLang's: the stop string, or the stop token id
        return out
    return {"type": gen.finish_reason or "abort"}


def generate_output(
    *,
    request_id: str,
    gen: Generation,
    weight_version: int,
    prompt_ids: TokenIds,
    return_logprob: bool,
    return_prompt_token_ids: bool,
    text: str | None,
    token_versions: list[int],
    return_routed_experts: bool = False,
) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "id": request_id,
        "finish_reason": generate_finish_reason(gen),
        "prompt_tokens": gen.prompt_tokens or len(prompt_ids),
        "completion_tokens": gen.completion_tokens,
        "cached_tokens": gen.cached_tokens,
        "weight_version": weight_version,
        # Beyond SGLang's shape: the weight version that produced each output token (partial rollout can
        # span versions), for per-token staleness correction.
        "output_token_versions": token_versions,
    }
    if return_logprob:
        lps = gen.logprobs or []
        meta["output_token_logprobs"] = [[lp, tid] for lp, tid in zip(lps, gen.output_ids)]
        if gen.top_logprobs is not None:
            meta["output_top_logprobs"] = [[[alp, a] for a, alp in alts] for alts in gen.top_logprobs]
    if return_prompt_token_ids:
        meta["prompt_token_ids"] = prompt_ids if isinstance(prompt_ids, list) else prompt_ids.tolist()
    if return_routed_experts:
        # SGLang's fields, the array as a base64 .npy [n, num_layers, top_k] (None: no replica recorded them).
        routed = gen.routed_experts
        meta["routed_experts"] = None if routed is None else routed.b64_npy()
        if routed is not None:
            meta["routed_experts_start_len"] = routed.prompt_start
    out: dict[str, Any] = {"output_ids": gen.output_ids, "meta_info": meta}
    if text is not None:
        out["text"] = text
    return out
