"""TITO in the router's chat pipeline: the session endpoints and, for a turn carrying
`x-smg-tito-session-id`, an incrementally tokenized prompt and a record of exactly what was sampled."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import hashlib
from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import Any

from psrl.router.config import TitoConfig
from psrl.router.errors import BadRequest, Conflict, NotFound, RouterError
from psrl.router.pipeline.context import Generation, GenerationInput
from psrl.router.pipeline.parse import ChatRequest
from psrl.router.pipeline.tool_calls import ParsedOutput
from psrl.router.registry import InstanceState
from psrl.tito.errors import InvalidTurn, SessionNotFound, TitoError, TurnNotPrepared, TurnNotRecorded
from psrl.tito.store import TitoStore
from psrl.tito.tree import PreparedTurn
from psrl.tokenizer import Tokenizer

SESSION_HEADER = "x-smg-tito-session-id"
TRAJECTORY_HEADER = "x-smg-tito-trajectory-id"
# Threads for turns being prepared (a template render and a tokenization each), and apart from them, threads for
# the short store calls (records, abandons, snapshots), so that those never queue behind long renders.
RENDER_THREADS = 8
STORE_THREADS = 8


def as_router_error(e: TitoError) -> RouterError:
    """One place where TITO's typed errors become HTTP answers."""
    if isinstance(e, SessionNotFound):
        return NotFound(str(e), code=e.code)
    if isinstance(e, TurnNotRecorded | TurnNotPrepared):
        return Conflict(str(e), code=e.code)
    return BadRequest(str(e), code=e.code)  # TooManySessions, TooManyTurns and the other refusals


class TitoBridge:
    """Owns the TITO store and the last instance that served each session (returned as `header_info`).

    Each turn is templated and tokenized with the tokenizer of the model it is sent to. The store calls that
    take a session's lock (prepare, record, abandon, snapshot) run in worker threads, never on the event loop:
    one session's long render makes only that session wait, and renders have threads of their own, so other
    sessions' records and snapshots never wait for a render. A call that has started runs to its end even if
    the request is cancelled meanwhile, so a turn is always either recorded or abandoned, never left pending.
    """

    def __init__(self, config: TitoConfig) -> None:
        config.validate()
        self.config = config
        c = config
        self.store = TitoStore(
            max_sessions=c.tito_max_sessions,
            max_turns_per_session=c.tito_max_turns,
            gc_threshold=c.tito_gc_threshold,
            max_trim_tokens=c.max_trim_tokens,
            debug=c.tito_debug,
            drop_dead_leaves=c.tito_drop_dead_leaves,
            session_ttl_s=c.tito_session_ttl_s,
            max_sessions_per_client=c.tito_max_sessions_per_client,
        )
        self._instances: dict[str, tuple[str, int]] = {}
        self._cleanups: set[asyncio.Future[Any]] = set()  # abandons of turns whose request went away
        self._renders = ThreadPoolExecutor(RENDER_THREADS, thread_name_prefix="tito-render")
        self._calls = ThreadPoolExecutor(STORE_THREADS, thread_name_prefix="tito-store")
        self.orphaned_calls = 0  # store calls whose request was cancelled while they ran (they ran to their end)

    def num_sessions(self) -> int:
        return len(self.store)

    def sessions_expired(self) -> int:
        return self.store.sessions_expired

    def turns_not_exported(self) -> dict[str, int]:
        """Sampled turns in no exported trajectory, by reason (the store's counters)."""
        return dict(self.store.turns_not_exported)

    @staticmethod
    def client_of(authorization: str | None) -> str | None:
        """The per-client cap's key: the bearer credential the client presented (hashed, so the store never holds
        a secret). None (no cap) without one."""
        if not authorization:
            return None
        return hashlib.sha256(authorization.encode("latin-1", "replace")).hexdigest()[:32]

    # ---- endpoints ----------------------------------------------------------------------------------

    async def create(self, client: str | None = None) -> str:
        store = self.store
        try:
            sid = store.create_session(client)  # the store's lock only: O(1) work
        except TitoError as e:
            raise as_router_error(e) from e
        if len(self._instances) > 2 * len(store) + 64:  # sessions expired: forget their instances (amortized)
            self._instances = {k: v for k, v in self._instances.items() if k in store}
        return sid

    async def snapshot(self, sid: str) -> dict[str, Any]:
        try:
            snap: dict[str, Any] = await self._off_loop(self._calls, self.store.snapshot, sid)
        except TitoError as e:
            raise as_router_error(e) from e
        if sid in self._instances:
            base, rank = self._instances[sid]
            snap["header_info"] = {"base_worker_id": base, "target_dp_rank": str(rank)}
        return snap

    async def delete(self, sid: str) -> None:
        try:
            self.store.delete_session(sid)  # the store's lock only
        except TitoError as e:
            raise as_router_error(e) from e
        self._instances.pop(sid, None)

    # ---- turns --------------------------------------------------------------------------------------

    @staticmethod
    def turn_of(headers: dict[str, str]) -> tuple[str, int] | None:
        sid = headers.get(SESSION_HEADER)
        if not sid:
            return None
        raw = headers.get(TRAJECTORY_HEADER, "0")
        try:
            trajectory = int(raw)
        except ValueError:
            raise BadRequest(
                f"header {TRAJECTORY_HEADER} must be an integer, got {raw!r}", param=TRAJECTORY_HEADER
            ) from None
        if trajectory < 0:
            raise BadRequest(f"header {TRAJECTORY_HEADER} must be >= 0", param=TRAJECTORY_HEADER)
        return sid, trajectory

    async def prepare(
        self, sid: str, trajectory: int, chat: ChatRequest, *, model: str, tokenizer: Tokenizer
    ) -> PreparedTurn:
        """The turn's prompt, templated and tokenized with `model`'s own `tokenizer`."""
        try:
            prepared: PreparedTurn = await self._off_loop(
                self._renders,
                self.store.prepare_turn,
                sid,
                trajectory,
                chat.messages,
                tools=chat.tools,
                template_kwargs=chat.template_kwargs or None,
                tokenizer=tokenizer,
                model=model,
                orphaned=self._abandon_later,
            )
        except TitoError as e:
            raise as_router_error(e) from e
        return prepared

    async def record(
        self,
        prepared: PreparedTurn,
        *,
        output_ids: list[int],
        output_logprobs: list[float] | None,
        finish_reason: str | None,
        weight_version: int,
        token_versions: list[int],
        instance: tuple[str, int],
        assistant_message: dict[str, Any],
        routed_experts: dict[str, Any] | None = None,
    ) -> None:
        try:
            await self._off_loop(
                self._calls,
                self._record_or_abandon,
                prepared,
                output_ids=output_ids,
                output_logprobs=output_logprobs,
                finish_reason=finish_reason,
                weight_version=weight_version,
                token_versions=token_versions,
                assistant_message=assistant_message,
                routed_experts=routed_experts,
            )
        except TitoError as e:
            raise as_router_error(e) from e
        self._instances[prepared.session_id] = instance

    async def begin_turn(
        self, turn: tuple[str, int], chat: ChatRequest, *, model: str, tokenizer: Tokenizer, request_id: str
    ) -> tuple[PreparedTurn, GenerationInput]:
        """A TITO turn's prompt, incrementally tokenized, and its generation: log-probs forced on (the record
        keeps them), and with routed experts recorded, asked for from where the reused path ends (its last id was
        never fed). The turn is pending until `finish_turn` or `abandon`."""
        if chat.stream:
            raise BadRequest(
                "TITO turns are not streamed upstream; send stream=false (the SessionRouter "
                "builds SSE from the buffered result)",
                param="stream",
            )
        if chat.sampling.n > 1:
            raise BadRequest("a TITO turn records one reply; send n=1 (one trajectory per sample)", param="n")
        prepared = await self.prepare(turn[0], turn[1], chat, model=model, tokenizer=tokenizer)
        if chat.sampling.logprobs is None:
            chat.sampling.logprobs = 0
        experts_from = max(prepared.reused_tokens - 1, 0) if self.config.tito_routed_experts else None
        gen = GenerationInput(request_id, prepared.prompt_ids, chat.sampling, False, routed_experts_start=experts_from)
        return prepared, gen

    async def finish_turn(
        self,
        prepared: PreparedTurn,
        gen: Generation,
        *,
        token_versions: list[int],
        instance: InstanceState,
        reply: ParsedOutput,
    ) -> None:
        """Record what the turn sampled on `instance` (the last that served it) with the reply the agent gets: a
        later turn continues this one only if it echoes that reply."""
        await self.record(
            prepared,
            output_ids=gen.output_ids,
            output_logprobs=gen.logprobs,
            finish_reason=gen.finish_reason,
            weight_version=instance.weight_version,
            token_versions=token_versions,
            instance=(instance.id.base_worker_id, instance.id.dp_rank),
            assistant_message={"role": "assistant", "content": reply.content, "tool_calls": reply.tool_calls},
            routed_experts=None if gen.routed_experts is None else gen.routed_experts.record(),
        )

    async def abandon(self, prepared: PreparedTurn) -> None:
        await self._off_loop(self._calls, self._abandon_quietly, prepared)

    # ---- off the loop -------------------------------------------------------------------------------

    def _record_or_abandon(self, prepared: PreparedTurn, **record: Any) -> None:
        try:
            self.store.record_turn(prepared.session_id, prepared.trajectory_id, prepared, **record)
        except InvalidTurn:  # refused as it is (it was the pending turn): it must not stay pending
            self._abandon_quietly(prepared)
            raise

    def _abandon_quietly(self, prepared: PreparedTurn) -> None:
        with contextlib.suppress(TitoError):  # the session went away meanwhile: nothing left to undo
            self.store.abandon_turn(prepared.session_id, prepared.trajectory_id, prepared)

    def _abandon_later(self, prepared: PreparedTurn) -> None:
        """A turn prepared for a request that was cancelled meanwhile: abandon it (off the loop)."""
        cleanup = asyncio.get_running_loop().run_in_executor(self._calls, self._abandon_quietly, prepared)
        self._cleanups.add(cleanup)
        cleanup.add_done_callback(self._cleanups.discard)

    async def _off_loop(
        self,
        threads: Executor,
        fn: Callable[..., Any],
        /,
        *args: Any,
        orphaned: Callable[[Any], None] | None = None,
        **kwargs: Any,
    ) -> Any:
        """fn(*args, **kwargs) in one of `threads`. If the caller is cancelled meanwhile, the call still runs to
        its end, and `orphaned` then gets its result (on the loop)."""
        call = functools.partial(contextvars.copy_context().run, fn, *args, **kwargs)  # the request id, for logs
        work = asyncio.get_running_loop().run_in_executor(threads, call)
        try:
            return await asyncio.shield(work)
        except asyncio.CancelledError:
            self.orphaned_calls += 1
            work.add_done_callback(functools.partial(_orphan_done, orphaned))
            raise


def _orphan_done(orphaned: Callable[[Any], None] | None, work: asyncio.Future[Any]) -> None:
    if work.cancelled() or work.exception() is not None:  # retrieved: nobody is left to raise it to
        return
    if orphaned is not None:
        orphaned(work.result())
