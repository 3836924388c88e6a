"""The pipeline runner: one request context, an ordered list of named stages, run in order by one runner.

Each endpoint kind (chat-shaped, completions, /generate) has its own stage list (`psrl.router.pipeline.stages`).
A stage reads what earlier stages left in the `RequestContext` and adds its own part, as a plain function or,
when it waits, a coroutine function; the first stage that sets
`ctx.response` ends the run (a request proxied to an HTTP worker ends at `route`). When a stage fails, the
runner runs the undo steps earlier stages left (`ctx.on_failure`, newest first), names the stage in the
error and raises it, so the endpoint wrapper answers it and its log line says where the request failed.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from psrl.router.errors import RouterError
from psrl.router.metadata import NO_ROUTING_META, RoutingMeta
from psrl.router.pipeline.context import Generation, GenerationInput
from psrl.serving.http1 import AnyResponse, Request

if TYPE_CHECKING:
    from psrl.router.dispatch import Rollout
    from psrl.router.pipeline.parse import ChatRequest, CompletionRequest, GenerateRequestBody
    from psrl.router.pipeline.tool_calls import ParsedOutput
    from psrl.router.selector import Ticket
    from psrl.tito import PreparedTurn
    from psrl.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

S = TypeVar("S")  # what the stages are given besides the context (the router's services)


@dataclass(slots=True)
class RequestContext:
    """One request on its way through a pipeline. Fields are filled stage by stage, in this order."""

    http: Request  # the HTTP request as it came (headers, body, arrival time)
    route: str  # the route it came on: metrics, logs, and the path a proxied request goes to
    # read: the body, the routing headers, the served model, a fresh request id
    raw: bytes = b""
    body: dict[str, Any] = field(default_factory=dict)
    meta: RoutingMeta = NO_ROUTING_META
    turn: tuple[str, int] | None = None  # a TITO turn: (session id, trajectory id)
    model: str = ""
    request_id: str = ""
    created: int = 0
    # parse: the request, typed and checked
    chat: ChatRequest | None = None
    completion: CompletionRequest | None = None
    generate: GenerateRequestBody | None = None
    # prepare: the tokenizer and one generation input per prompt (a TITO turn's prepared record)
    tokenizer: Tokenizer | None = None
    inputs: list[GenerationInput] = field(default_factory=list)
    tito: PreparedTurn | None = None
    # execute: the rollouts (their placement and every iteration) and each one's choices
    rollouts: list[Rollout] = field(default_factory=list)
    results: list[list[Generation]] = field(default_factory=list)
    first_ticket: Ticket | None = None  # a stream's first placement: its headers go out before it ends
    # record: a TITO turn's reply, parsed once for its record and its answer
    outputs: list[ParsedOutput] | None = None
    # respond
    response: AnyResponse | None = None
    # Undo steps of stages that ran, by name, run newest first when a later stage fails (a TITO turn is
    # abandoned); the stage that makes one unnecessary takes it out.
    on_failure: dict[str, Callable[[], Awaitable[None]]] = field(default_factory=dict)

    @property
    def stream(self) -> bool:
        parsed = self.chat or self.completion
        return parsed is not None and parsed.stream

    @property
    def headers_ticket(self) -> Ticket:
        """The instance the response names (x-base-worker-id, x-version-tag): the last one that served the first
        prompt, or for a stream, whose headers go out first, the first."""
        ticket = self.first_ticket if self.stream else self.rollouts[0].ticket
        assert ticket is not None, "execute first"
        return ticket


@dataclass(frozen=True)
class Stage(Generic[S]):
    """A named step. `run` returns what to wait for when the step waits (a coroutine function's call), else None:
    most steps do not, and a coroutine for each would cost every request its frame and its send."""

    name: str
    run: Callable[[S, RequestContext], Awaitable[None] | None]


class Pipeline(Generic[S]):
    """An endpoint kind's stages, in order."""

    def __init__(self, kind: str, stages: Sequence[Stage[S]]) -> None:
        self.kind = kind
        self.stages = tuple(stages)

    @property
    def stage_names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.stages)

    async def run(self, services: S, ctx: RequestContext) -> AnyResponse:
        for stage in self.stages:
            try:
                waiting = stage.run(services, ctx)
                if waiting is not None:
                    await waiting
            except BaseException as e:
                await self._undo(ctx)
                if isinstance(e, RouterError):
                    e.stage = stage.name
                elif isinstance(e, Exception):
                    e.add_note(f"in the {self.kind} pipeline's {stage.name} stage")
                raise
            if ctx.response is not None:
                return ctx.response
        raise AssertionError(f"the {self.kind} pipeline ended without a response")

    @staticmethod
    async def _undo(ctx: RequestContext) -> None:
        while ctx.on_failure:
            _, undo = ctx.on_failure.popitem()
            try:
                await undo()
            except Exception:  # the stage's own error is the one the client gets
                logger.exception("an undo step failed")
