"""The request path, stage by stage, and each endpoint kind's stage list.

    read     the body (a JSON object) and the routing headers; the served model; a request id
    route    a model served only over HTTP is proxied as it came (the run ends here: its worker checks the
             request's fields, as it would without the router); else it needs token ids
    parse    the API's fields, parsed and checked (a 400 names the field)
    prepare  the chat template and the tokenizer (or a TITO turn's incremental prompt): one input per prompt
    execute  each prompt's rollout: placed (directly or through the routing loop), generated, looped back
             after a weight-sync abort until it ends; a stream is only started here
    record   a TITO turn's sampled ids go to its session
    respond  the API's JSON object, or its SSE events as the stream is read

For gRPC workers the instance is chosen inside `execute` (psrl.router.dispatch, psrl.router.selector), because
a looped-back request is placed again at each iteration; a request proxied over HTTP is placed once, in `route`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from psrl import apis as A
from psrl.apis import ApiShapeError
from psrl.router.config import RouterConfig
from psrl.router.dispatch import Dispatcher, Rollout
from psrl.router.errors import BadRequest, ModelNotFound, WorkerUnavailable
from psrl.router.http_backend import HttpWorkers
from psrl.router.metadata import parse_routing_meta
from psrl.router.metrics import RouterMetrics
from psrl.router.pipeline import parse as P
from psrl.router.pipeline import respond as R
from psrl.router.pipeline.context import Generation, GenerationInput
from psrl.router.pipeline.prepare import chat_prompt_ids, new_request_id, text_prompt_ids
from psrl.router.pipeline.runner import Pipeline, RequestContext, Stage
from psrl.router.pipeline.stops import output_text
from psrl.router.pipeline.stream import (
    ApiWriter,
    MessagesWriter,
    ResponsesWriter,
    StreamStart,
    chat_events,
    completion_events,
    converted_events,
)
from psrl.router.pipeline.tool_calls import NoToolParser, ParsedOutput, ToolCallParser
from psrl.router.pipeline.tool_choice import refusal_of, require_parser
from psrl.router.policies.base import Policy, SelectionRequest
from psrl.router.registry import WorkerRegistry
from psrl.router.tito_bridge import TitoBridge
from psrl.router.tokenizers import TokenizerStore
from psrl.router.web import json_response
from psrl.serving.http1 import StreamingResponse
from psrl.serving.json_body import may_hold_surrogates
from psrl.tokenizer import Tokenizer

_NO_TOOL_PARSER = NoToolParser()
TITO_UNDO = "abandon the TITO turn"  # the prepare stage's undo step for a TITO turn


@dataclass
class Services:
    """What the stages use: the router's long-lived parts."""

    config: RouterConfig
    registry: WorkerRegistry
    dispatcher: Dispatcher
    tokenizers: TokenizerStore
    http: HttpWorkers
    tito: TitoBridge
    tool_parser: ToolCallParser
    metrics: RouterMetrics
    policy: Policy

    def needs_tokens(self, model: str) -> bool:
        """Whether `model` has gRPC workers (token ids in, token ids out); else it is proxied over HTTP."""
        return bool(self.registry.view(model).grpc_instances)

    def tool_parser_for(self, chat: P.ChatRequest) -> ToolCallParser:
        # Tool calls are parsed out only when the request offered tools, as vLLM does with a parser enabled.
        return self.tool_parser if chat.tools else _NO_TOOL_PARSER

    def reply_of(self, chat: P.ChatRequest, tok: Tokenizer, gen: Generation) -> ParsedOutput:
        return self.tool_parser_for(chat).parse(output_text(tok, gen, chat.sampling))


@dataclass(frozen=True)
class ChatShape:
    """An API other than chat completions that runs the chat pipeline: its body becomes a chat body, the
    completion is shaped back, and `writer` spells its stream's events."""

    to_chat: Callable[[dict[str, Any]], dict[str, Any]]
    from_chat: Callable[[dict[str, Any], dict[str, Any]], dict[str, Any]]
    writer: Callable[[StreamStart], ApiWriter]


RESPONSES_SHAPE = ChatShape(A.responses_to_chat, A.chat_to_response, ResponsesWriter)
MESSAGES_SHAPE = ChatShape(A.messages_to_chat, lambda completion, _: A.chat_to_message(completion), MessagesWriter)

StageFn = Callable[[Services, RequestContext], Awaitable[None] | None]  # see runner.Stage


# ---- read ------------------------------------------------------------------------------------------------


def resolve_model(registry: WorkerRegistry, model: str | None) -> str:
    """The served model a request asks for; with no `model` field, the only (or first) one served."""
    served = registry.models()
    if not served:
        raise WorkerUnavailable("no workers are registered")
    if model is None:
        return served[0]
    if model not in served:
        raise ModelNotFound(f"The model `{model}` does not exist. Served: {', '.join(served)}", param="model")
    return model


def read(s: Services, ctx: RequestContext, ids_field: str | None = None) -> None:
    ctx.raw = ctx.http.body
    ctx.body = P.parse_json_body(ctx.raw, s.config.max_payload_bytes, ids_field)
    ctx.meta = parse_routing_meta(ctx.http.headers)
    ctx.created = int(time.time())
    ctx.model = resolve_model(s.registry, P.get_str(ctx.body, "model", None))


def read_chat(s: Services, ctx: RequestContext) -> None:
    read(s, ctx)
    ctx.request_id = new_request_id("chatcmpl")
    ctx.turn = TitoBridge.turn_of(ctx.http.headers) if s.config.tito.enable_tito else None


def read_generate(s: Services, ctx: RequestContext) -> None:
    """`input_ids` as an array('I') where it is one prompt's ids: read from the body's digits, never as ints."""
    read(s, ctx, "input_ids")


def read_completion(s: Services, ctx: RequestContext) -> None:
    """A `prompt` of one prompt's ids as an array('I'), as `read_generate` reads `input_ids`."""
    read(s, ctx, "prompt")
    ctx.request_id = new_request_id("cmpl")


# ---- route -----------------------------------------------------------------------------------------------


def route(s: Services, ctx: RequestContext) -> Awaitable[None] | None:
    """Nothing to do (None) for a model with gRPC workers; else the proxying, to wait for."""
    if s.needs_tokens(ctx.model):
        return None
    return _proxy(s, ctx)


async def _proxy(s: Services, ctx: RequestContext) -> None:
    if ctx.turn is not None:
        raise BadRequest(f"TITO needs gRPC workers; model {ctx.model!r} is served only over HTTP")
    stream = P.get_bool(ctx.body, "stream", False)  # before the ticket: proxy() is what releases it
    text = P.routing_text(ctx.body) if s.policy.needs_text else None  # prefix-aware policies match on it
    request = SelectionRequest(ctx.request_id, ctx.model, (), text, ctx.meta.routing_key)
    ticket = await s.dispatcher.acquire(ctx.model, ctx.meta, request)
    ctx.response = await s.http.proxy(ctx.route, ticket, ctx.raw, ctx.http.headers, stream, s.dispatcher.finish)


# ---- parse -----------------------------------------------------------------------------------------------


def parse_chat(shape: ChatShape | None) -> StageFn:
    def parse(s: Services, ctx: RequestContext) -> None:
        chat_body = ctx.body
        if shape is not None:
            try:
                chat_body = shape.to_chat(ctx.body)
            except ApiShapeError as e:
                raise BadRequest(e.message, param=e.param) from None
        chat = P.parse_chat(chat_body, check_texts=may_hold_surrogates(ctx.raw))
        if shape is not None:
            chat.stream = P.get_bool(ctx.body, "stream", False)
        ctx.chat = chat

    return parse


def parse_completion(s: Services, ctx: RequestContext) -> None:
    ctx.completion = P.parse_completion(ctx.body)


def parse_generate(s: Services, ctx: RequestContext) -> None:
    ctx.generate = P.parse_generate(ctx.body)


# ---- prepare ---------------------------------------------------------------------------------------------


async def prepare_chat(s: Services, ctx: RequestContext) -> None:
    chat = ctx.chat
    assert chat is not None
    require_parser(chat.tool_choice, not isinstance(s.tool_parser, NoToolParser))
    tok = ctx.tokenizer = await s.tokenizers.get(ctx.model)
    if ctx.turn is None:
        prompt = await chat_prompt_ids(chat, tok)
        ctx.inputs = [GenerationInput(ctx.request_id, prompt, chat.sampling, chat.stream)]
        return
    prepared, gen = await s.tito.begin_turn(ctx.turn, chat, model=ctx.model, tokenizer=tok, request_id=ctx.request_id)
    ctx.tito, ctx.inputs = prepared, [gen]
    ctx.on_failure[TITO_UNDO] = lambda: s.tito.abandon(prepared)


async def prepare_completion(s: Services, ctx: RequestContext) -> None:
    req = ctx.completion
    assert req is not None
    tok = ctx.tokenizer = await s.tokenizers.get(ctx.model)
    for i, prompt in enumerate(req.prompts):
        request_id = ctx.request_id if len(req.prompts) == 1 else f"{ctx.request_id}-{i}"
        ctx.inputs.append(GenerationInput(request_id, await text_prompt_ids(prompt, tok), req.sampling, req.stream))


async def prepare_generate(s: Services, ctx: RequestContext) -> None:
    req = ctx.generate
    assert req is not None
    if req.detokenize or any(isinstance(p, str) for p in req.prompts):
        ctx.tokenizer = await s.tokenizers.get(ctx.model)
    routed_start = req.routed_experts_start
    tok = ctx.tokenizer
    for prompt, request_id in zip(req.prompts, req.request_ids, strict=True):
        ids = await text_prompt_ids(prompt, tok, "text") if isinstance(prompt, str) and tok else prompt
        assert not isinstance(ids, str)
        if routed_start is not None and routed_start > len(ids):
            raise BadRequest(
                f"routed_experts_start_len ({routed_start}) exceeds the prompt's {len(ids)} tokens",
                param="routed_experts_start_len",
            )
        rid = request_id or new_request_id("gen")
        ctx.inputs.append(GenerationInput(rid, ids, req.sampling, False, routed_experts_start=routed_start))


# ---- execute ---------------------------------------------------------------------------------------------


async def execute(s: Services, ctx: RequestContext) -> None:
    """Each prompt's rollout, concurrently; the first failure cancels the others. A stream (one prompt) is only
    started: its deltas are read as the response is sent. A replica's refusal of the constraint a forced tool
    call needs is answered in the words of `refusal_of`."""
    try:
        if ctx.stream:
            rollout = Rollout(s.dispatcher, ctx.model, ctx.meta, ctx.inputs[0])
            ctx.first_ticket = await rollout.start()
            ctx.rollouts = [rollout]
            return
        rollouts = [Rollout(s.dispatcher, ctx.model, ctx.meta, gen) for gen in ctx.inputs]
        if len(rollouts) == 1:  # the common case: no task, no coroutine to wrap it
            [rollout] = rollouts
            await rollout.start()
            ctx.results = [await rollout.collect()]
        else:
            ctx.results = await _gather_or_raise([_run(r) for r in rollouts])
        ctx.rollouts = rollouts
    except BadRequest as e:
        explained = None if ctx.chat is None else refusal_of(ctx.chat.tool_choice, e)
        if explained is None:
            raise
        raise explained from e


async def _run(rollout: Rollout) -> list[Generation]:
    await rollout.start()
    return await rollout.collect()


async def _gather_or_raise(coros: list) -> list:
    """Run a batch concurrently; the first failure cancels the rest and is raised."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


# ---- record ----------------------------------------------------------------------------------------------


async def record(s: Services, ctx: RequestContext) -> None:
    if ctx.tito is None:
        return
    assert ctx.chat is not None and ctx.tokenizer is not None
    [rollout], [[gen]] = ctx.rollouts, ctx.results
    assert rollout.ticket is not None
    ctx.outputs = [s.reply_of(ctx.chat, ctx.tokenizer, gen)]
    # The record decides the turn's fate itself from here (recorded, or abandoned when refused): a cancellation
    # cannot stop it halfway, so the runner must not abandon a turn that may be recorded.
    ctx.on_failure.pop(TITO_UNDO)
    await s.tito.finish_turn(
        ctx.tito,
        gen,
        token_versions=rollout.states[0].token_versions,
        instance=rollout.ticket.instance,
        reply=ctx.outputs[0],
    )


# ---- respond ---------------------------------------------------------------------------------------------


def _streaming(s: Services, ctx: RequestContext, events: AsyncIterator[bytes]) -> StreamingResponse:
    """The SSE response, timing its first event and its end."""
    start = ctx.http.arrived

    async def body() -> AsyncIterator[bytes]:
        first = True
        try:
            async for event in events:
                if first:
                    s.metrics.first_token(ctx.route, time.perf_counter() - start)
                    first = False
                yield event
        finally:
            s.metrics.stream_done(ctx.route, time.perf_counter() - start)

    assert ctx.first_ticket is not None
    return StreamingResponse(body(), media_type="text/event-stream", headers=R.instance_headers(ctx.first_ticket))


def _answer(ctx: RequestContext, payload: Any, *, logprobs: bool) -> None:
    """The JSON answer, naming its instance. Logprobs are the only floats a chat, completion or /generate
    answer holds, so one without them is written by msgspec (`json_response`'s `finite`)."""
    ctx.response = json_response(payload, headers=R.instance_headers(ctx.headers_ticket), finite=not logprobs)


def respond_chat(shape: ChatShape | None) -> StageFn:
    def respond(s: Services, ctx: RequestContext) -> None:
        chat, tok = ctx.chat, ctx.tokenizer
        assert chat is not None and tok is not None
        parser = s.tool_parser_for(chat)
        if ctx.stream:
            [rollout] = ctx.rollouts
            prompt_tokens = len(ctx.inputs[0].prompt_ids)
            if shape is None:
                events = chat_events(
                    rollout,
                    tok,
                    chat,
                    parser,
                    request_id=ctx.request_id,
                    created=ctx.created,
                    model=ctx.model,
                    prompt_tokens=prompt_tokens,
                )
            else:
                start = StreamStart(ctx.body, ctx.request_id, ctx.created, ctx.model, prompt_tokens)
                events = converted_events(rollout, tok, chat, parser, shape.writer(start), ctx.request_id)
            ctx.response = _streaming(s, ctx, events)
            return
        [gens] = ctx.results
        outputs = ctx.outputs if ctx.outputs is not None else [s.reply_of(chat, tok, g) for g in gens]
        choices = []
        for i, (gen, output) in enumerate(zip(gens, outputs, strict=True)):
            lps = R.chat_logprobs(tok, gen.output_ids, gen.logprobs, gen.top_logprobs) if chat.logprobs else None
            choices.append(R.chat_choice(i, output, gen, lps, chat.tool_choice.named))
        out = R.chat_completion(
            request_id=ctx.request_id, created=ctx.created, model=ctx.model, choices=choices, gens=gens
        )
        if shape is None:
            _answer(ctx, out, logprobs=chat.logprobs)
        else:  # another API's shape may echo the client's fields, floats among them
            ctx.response = json_response(shape.from_chat(out, ctx.body), headers=R.instance_headers(ctx.headers_ticket))

    return respond


def respond_completion(s: Services, ctx: RequestContext) -> None:
    req, tok = ctx.completion, ctx.tokenizer
    assert req is not None and tok is not None
    if ctx.stream:
        [rollout] = ctx.rollouts
        events = completion_events(
            rollout,
            tok,
            req,
            request_id=ctx.request_id,
            created=ctx.created,
            model=ctx.model,
            prompt_tokens=len(ctx.inputs[0].prompt_ids),
        )
        ctx.response = _streaming(s, ctx, events)
        return
    choices: list[dict[str, Any]] = []
    for gens in ctx.results:  # prompt-major, as vLLM numbers them
        for gen in gens:
            lps = R.completion_logprobs(tok, gen.output_ids, gen.logprobs, gen.top_logprobs)
            choices.append(R.completion_choice(len(choices), output_text(tok, gen, req.sampling), gen, lps))
    out = R.completion(
        request_id=ctx.request_id, created=ctx.created, model=ctx.model, choices=choices, prompts=ctx.results
    )
    _answer(ctx, out, logprobs=req.sampling.logprobs is not None)


def respond_generate(s: Services, ctx: RequestContext) -> None:
    req, tok = ctx.generate, ctx.tokenizer
    assert req is not None
    text_of = tok is not None and req.detokenize
    outputs = []
    for gen_in, rollout, gens in zip(ctx.inputs, ctx.rollouts, ctx.results, strict=True):
        for i, (gen, state) in enumerate(zip(gens, rollout.states, strict=True)):
            out = R.generate_output(
                request_id=gen_in.request_id if len(gens) == 1 else f"{gen_in.request_id}-{i}",
                gen=gen,
                weight_version=state.weight_version,
                prompt_ids=gen_in.prompt_ids,
                return_logprob=req.return_logprob,
                return_prompt_token_ids=req.return_prompt_token_ids,
                text=output_text(tok, gen, req.sampling) if text_of and tok else None,
                token_versions=state.token_versions,
                return_routed_experts=gen_in.routed_experts_start is not None,
            )
            outputs.append(out)
    # SGLang's shape: one object per prompt; n > 1 makes a flat list of every prompt's n samples, prompt-major.
    payload: Any = outputs if req.batched or req.sampling.n > 1 else outputs[0]
    _answer(ctx, payload, logprobs=req.return_logprob)


# ---- each endpoint kind's stages -------------------------------------------------------------------------


def chat_pipeline(kind: str, shape: ChatShape | None = None) -> Pipeline[Services]:
    """Chat completions, and the APIs that convert to a chat request (Responses, Messages)."""
    return Pipeline(
        kind,
        [
            Stage("read", read_chat),
            Stage("route", route),
            Stage("parse", parse_chat(shape)),
            Stage("prepare", prepare_chat),
            Stage("execute", execute),
            Stage("record", record),
            Stage("respond", respond_chat(shape)),
        ],
    )


CHAT = chat_pipeline("chat")
RESPONSES = chat_pipeline("responses", RESPONSES_SHAPE)
MESSAGES = chat_pipeline("messages", MESSAGES_SHAPE)
COMPLETION = Pipeline(
    "completion",
    [
        Stage("read", read_completion),
        Stage("route", route),
        Stage("parse", parse_completion),
        Stage("prepare", prepare_completion),
        Stage("execute", execute),
        Stage("respond", respond_completion),
    ],
)
GENERATE = Pipeline(  # token ids in and out: gRPC workers only, so no route stage
    "generate",
    [
        Stage("read", read_generate),
        Stage("parse", parse_generate),
        Stage("prepare", prepare_generate),
        Stage("execute", execute),
        Stage("respond", respond_generate),
    ],
)
