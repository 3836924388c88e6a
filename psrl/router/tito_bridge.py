"""TITO in the router's chat pipeline: the session endpoints and, for a turn carrying
`x-smg-tito-session-id`, an incrementally tokenized prompt and a record of exactly what was sampled."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from psrl.router.errors import BadRequest, Conflict, NotFound, RouterError
from psrl.router.pipeline.parse import ChatRequest
from psrl.tito import (
    InvalidTurn,
    PreparedTurn,
    SessionNotFound,
    TitoError,
    TitoStore,
    TurnNotPrepared,
    TurnNotRecorded,
)
from psrl.tokenizer import Tokenizer

SESSION_HEADER = "x-smg-tito-session-id"
TRAJECTORY_HEADER = "x-smg-tito-trajectory-id"


@dataclass
class TitoConfig:
    enable_tito: bool = True
    tito_debug: bool = False
    tito_gc_threshold: int = 0
    tito_max_sessions: int = 10000
    tito_max_turns: int = 1000
    tito_drop_dead_leaves: bool = True
    max_trim_tokens: int = 0
    # A session no request has named for this long (and with no turn in flight) expires; 0: never.
    tito_session_ttl_s: float = 3600.0
    # With an api_key, each bearer credential may hold this many live sessions; 0: no per-client cap.
    tito_max_sessions_per_client: int = 0

    def validate(self) -> None:
        limits = (self.tito_gc_threshold, self.tito_max_sessions, self.tito_max_turns, self.max_trim_tokens)
        if min(*limits, self.tito_max_sessions_per_client) < 0 or not self.tito_session_ttl_s >= 0:
            raise ValueError("TITO limits (and tito_session_ttl_s) must be >= 0")


def as_router_error(e: TitoError) -> RouterError:
    """One place where TITO's typed errors become HTTP answers."""
    if isinstance(e, SessionNotFound):
        return NotFound(str(e), code=e.code)
    if isinstance(e, TurnNotRecorded | TurnNotPrepared):
        return Conflict(str(e), code=e.code)
    return BadRequest(str(e), code=e.code)  # TooManySessions, TooManyTurns and the other refusals


class TitoBridge:
    """Owns the TITO store (built with the default model's tokenizer at first use) and the last instance that
    served each session (returned as `header_info`)."""

    def __init__(self, config: TitoConfig, default_tokenizer: Callable[[], Awaitable[Tokenizer]]) -> None:
        config.validate()
        self.config = config
        self._default_tokenizer = default_tokenizer
        self._store: TitoStore | None = None
        self._lock = asyncio.Lock()
        self._instances: dict[str, tuple[str, int]] = {}

    async def store(self) -> TitoStore:
        if self._store is None:
            async with self._lock:
                if self._store is None:
                    c = self.config
                    self._store = TitoStore(
                        await self._default_tokenizer(),
                        max_sessions=c.tito_max_sessions,
                        max_turns_per_session=c.tito_max_turns,
                        gc_threshold=c.tito_gc_threshold,
                        max_trim_tokens=c.max_trim_tokens,
                        debug=c.tito_debug,
                        drop_dead_leaves=c.tito_drop_dead_leaves,
                        session_ttl_s=c.tito_session_ttl_s,
                        max_sessions_per_client=c.tito_max_sessions_per_client,
                    )
        return self._store

    def num_sessions(self) -> int:
        return 0 if self._store is None else len(self._store)

    def sessions_expired(self) -> int:
        return 0 if self._store is None else self._store.sessions_expired

    @staticmethod
    def client_of(authorization: str | None) -> str | None:
        """The per-client cap's key: the bearer credential the client presented (hashed, so the store never holds
        a secret). None (no cap) without one."""
        if not authorization:
            return None
        return hashlib.sha256(authorization.encode("latin-1", "replace")).hexdigest()[:32]

    # ---- endpoints ----------------------------------------------------------------------------------

    async def create(self, client: str | None = None) -> str:
        store = await self.store()
        try:
            sid = store.create_session(client)
        except TitoError as e:
            raise as_router_error(e) from e
        if len(self._instances) > 2 * len(store) + 64:  # sessions expired: forget their instances (amortized)
            self._instances = {k: v for k, v in self._instances.items() if k in store}
        return sid

    async def snapshot(self, sid: str) -> dict[str, Any]:
        try:
            snap = (await self.store()).snapshot(sid)
        except TitoError as e:
            raise as_router_error(e) from e
        if sid in self._instances:
            base, rank = self._instances[sid]
            snap["header_info"] = {"base_worker_id": base, "target_dp_rank": str(rank)}
        return snap

    async def delete(self, sid: str) -> None:
        try:
            (await self.store()).delete_session(sid)
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

    async def prepare(self, sid: str, trajectory: int, chat: ChatRequest) -> PreparedTurn:
        store = await self.store()
        try:
            return await asyncio.to_thread(
                store.prepare_turn,
                sid,
                trajectory,
                chat.messages,
                tools=chat.tools,
                template_kwargs=chat.template_kwargs or None,
            )
        except TitoError as e:
            raise as_router_error(e) from e

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
    ) -> None:
        store = await self.store()
        try:
            store.record_turn(
                prepared.session_id,
                prepared.trajectory_id,
                prepared,
                output_ids=output_ids,
                output_logprobs=output_logprobs,
                finish_reason=finish_reason,
                weight_version=weight_version,
                token_versions=token_versions,
                assistant_message=assistant_message,
            )
        except InvalidTurn as e:  # refused as it is (it was the pending turn): it must not stay pending
            with contextlib.suppress(TitoError):
                store.abandon_turn(prepared.session_id, prepared.trajectory_id)
            raise as_router_error(e) from e
        except TitoError as e:
            raise as_router_error(e) from e
        self._instances[prepared.session_id] = instance

    async def abandon(self, prepared: PreparedTurn) -> None:
        store = await self.store()
        try:
            store.abandon_turn(prepared.session_id, prepared.trajectory_id)
        except TitoError:
            pass  # the session went away meanwhile: nothing left to undo
