"""Per-session state and the header rules of a turn. Pure: no sockets, tested directly."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Literal

SESSION_HEADER = "x-smg-tito-session-id"
TRAJECTORY_HEADER = "x-smg-tito-trajectory-id"
FORCE_PIN_ONCE_HEADER = "x-force-pin-once"
WORKER_HEADER = "x-base-worker-id"
RANK_HEADER = "x-target-dp-rank"
VERSION_HEADER = "x-version-tag"

# What POST /sessions keeps from the client's headers and replays on every turn.
SESSION_HEADER_WHITELIST = (
    "x-prompt-id",
    "x-request-id",
    "x-is-validate",
    "x-is-sticky",
    VERSION_HEADER,
    WORKER_HEADER,
    RANK_HEADER,
    "x-smg-prompt-too-long-limit",
)

# Hop-by-hop or transport headers that must not be copied from one connection to the next.
_NOT_FORWARDED = frozenset(
    {
        "host",
        "content-length",
        "connection",
        "keep-alive",
        "proxy-connection",
        "transfer-encoding",
        "te",
        "trailer",
        "upgrade",
        "accept-encoding",
        "content-encoding",
    }
)


class HangState(StrEnum):
    """Whether a session may run turns (its JSON value is the string)."""

    RUNNING = "running"
    HUNG = "hung"


TrajectoryStrategy = Literal["manual", "auto"]


def trajectory_key(raw: str | None) -> str:
    """One name per trajectory: the router reads the header as an integer, so "01" and "1" are the same."""
    key = (raw or "0").strip()
    try:
        return str(int(key))  # the router's own parse (TitoBridge.turn_of): "+1", " 1" and "01" are trajectory 1
    except ValueError:
        return key


def session_headers_from(request_headers: Mapping[str, str]) -> dict[str, str]:
    """The whitelisted headers a session keeps; a client's session id is never among them (never trusted)."""
    lowered = {k.lower(): v for k, v in request_headers.items()}
    return {name: lowered[name] for name in SESSION_HEADER_WHITELIST if name in lowered}


def forwardable(headers: Iterable[tuple[str, str]]) -> dict[str, str]:
    return {k.lower(): v for k, v in headers if k.lower() not in _NOT_FORWARDED}


@dataclass
class SessionState:
    session_id: str
    headers: dict[str, str] = field(default_factory=dict)
    closing: bool = False
    inflight: int = 0
    trajectory_turns: dict[str, int] = field(default_factory=dict)  # turns completed per trajectory id
    base_worker_id: str | None = None
    target_dp_rank: str | None = None
    version_tag: str | None = None
    total_tokens: int = 0
    hang_state: HangState = HangState.RUNNING
    marked_for_hang: bool = False
    pin_once_instance: tuple[str, str] | None = None
    # Set while the session may run turns; cleared while hung.
    continue_event: asyncio.Event = field(default_factory=asyncio.Event)
    # Set while no turn is in flight; DELETE waits on it.
    drained: asyncio.Event = field(default_factory=asyncio.Event)
    # One lock per trajectory id (None: the auto strategy's single chain).
    turn_locks: dict[str | None, asyncio.Lock] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.continue_event.set()
        self.drained.set()

    @property
    def status(self) -> str:
        return "generate" if self.inflight > 0 else "env"

    # ---- turn lifecycle -------------------------------------------------------------------------------

    def turn_lock(self, request_headers: Mapping[str, str], strategy: TrajectoryStrategy) -> asyncio.Lock:
        """Turns of one trajectory run one at a time, in arrival order: TITO records a trajectory as a chain of
        turns, so an agent that fires its next turn before the last one answered waits instead of failing."""
        key = None if strategy == "auto" else trajectory_key(request_headers.get(TRAJECTORY_HEADER))
        return self.turn_locks.setdefault(key, asyncio.Lock())

    def begin_turn(self) -> None:
        self.inflight += 1
        self.drained.clear()

    def end_turn(self) -> None:
        self.inflight -= 1
        if self.inflight == 0:
            self.drained.set()
            if self.marked_for_hang and not self.closing:
                self.hang()

    def record_success(self, response_headers: Mapping[str, str], usage: Any) -> None:
        """Remember the instance and version that served the turn; later turns replay them. `usage` is the
        answer's, in any of the APIs' shapes (chat's prompt/completion_tokens, or input/output_tokens)."""
        worker = response_headers.get(WORKER_HEADER)
        if worker:
            self.base_worker_id = worker
            rank = response_headers.get(RANK_HEADER)
            if rank is not None:
                self.target_dp_rank = rank
        version = response_headers.get(VERSION_HEADER)
        if version is not None and version.strip() != "":
            self.version_tag = version
        if isinstance(usage, Mapping):
            # Anthropic's input_tokens leave out the cache reads; OpenAI's prompt/input tokens include them.
            prompt = usage.get(
                "prompt_tokens", (usage.get("input_tokens") or 0) + usage.get("cache_read_input_tokens", 0)
            )
            completion = usage.get("completion_tokens", usage.get("output_tokens"))
            self.total_tokens = max(self.total_tokens, int(prompt or 0) + int(completion or 0))

    def advance_trajectory(self, trajectory_id: str | None) -> None:
        if trajectory_id is not None:
            key = trajectory_key(trajectory_id)
            self.trajectory_turns[key] = self.trajectory_turns.get(key, 0) + 1

    # ---- hang / continue ------------------------------------------------------------------------------

    def hang(self) -> None:
        self.hang_state = HangState.HUNG
        self.marked_for_hang = False
        self.continue_event.clear()

    def request_hang(self) -> Literal["hung", "deferred"]:
        """Hang now, or, mid-turn, once the in-flight count reaches 0."""
        if self.inflight > 0:
            self.marked_for_hang = True
            return "deferred"
        self.hang()
        return "hung"

    def resume(self, base_worker_id: str | None = None, target_dp_rank: str | None = None) -> None:
        """Continue; with both ids, the next turn (only) is force-pinned to that instance."""
        self.hang_state = HangState.RUNNING
        self.marked_for_hang = False
        if base_worker_id is not None and target_dp_rank is not None:
            self.pin_once_instance = (base_worker_id, target_dp_rank)
        self.continue_event.set()

    def start_closing(self) -> None:
        self.closing = True
        self.marked_for_hang = False
        self.hang_state = HangState.RUNNING
        self.continue_event.set()  # a waiting turn wakes up and sees `closing`

    def summary(self) -> dict[str, Any]:
        return {
            "session_id": self.session_id,
            "base_worker_id": self.base_worker_id,
            "target_dp_rank": self.target_dp_rank,
            "status": self.status,
            "hang_state": self.hang_state,
            "inflight": self.inflight,
            "total_tokens": self.total_tokens,
            "marked_for_hang": self.marked_for_hang,
            "closing": self.closing,
        }

    # ---- headers of a turn ----------------------------------------------------------------------------

    def turn_headers(
        self, request_headers: Mapping[str, str], strategy: TrajectoryStrategy
    ) -> tuple[dict[str, str], str | None]:
        """Headers for the upstream turn and the trajectory id they carry (None in auto mode).

        Precedence: session headers < request headers < this state's worker/rank/version < the one-shot pin.
        Consumes the one-shot pin.
        """
        headers = dict(self.headers)
        headers.update(forwardable(request_headers.items()))
        if self.base_worker_id is not None:
            headers[WORKER_HEADER] = self.base_worker_id
            if self.target_dp_rank is not None:
                headers[RANK_HEADER] = self.target_dp_rank
        if self.version_tag is not None:
            headers[VERSION_HEADER] = self.version_tag
        if self.pin_once_instance is not None:
            headers[WORKER_HEADER], headers[RANK_HEADER] = self.pin_once_instance
            headers[FORCE_PIN_ONCE_HEADER] = "true"
            self.pin_once_instance = None
        headers[SESSION_HEADER] = self.session_id
        trajectory: str | None = None
        if strategy == "manual":
            trajectory = headers.get(TRAJECTORY_HEADER) or "0"
            headers[TRAJECTORY_HEADER] = trajectory
        else:
            headers.pop(TRAJECTORY_HEADER, None)
        return headers, trajectory


class SessionStore:
    """The sessions this SessionRouter knows, by id."""

    def __init__(self) -> None:
        self._sessions: dict[str, SessionState] = {}

    def add(self, state: SessionState) -> None:
        self._sessions[state.session_id] = state

    def get(self, sid: str) -> SessionState | None:
        return self._sessions.get(sid)

    def remove(self, sid: str) -> None:
        self._sessions.pop(sid, None)

    def all(self) -> list[SessionState]:
        return list(self._sessions.values())


def session_ids_of(body: Any) -> list[tuple[str, dict[str, Any]]]:
    """Control bodies: `[{session_id, ...}]`, `["sid"]` or `{sessions: [...]}` -> [(sid, item)]."""
    if isinstance(body, dict) and "sessions" in body:
        body = body["sessions"]
    if not isinstance(body, list):
        raise ValueError("expected a list of sessions, or {sessions: [...]}")
    out: list[tuple[str, dict[str, Any]]] = []
    for item in body:
        if isinstance(item, str):
            out.append((item, {}))
        elif isinstance(item, dict) and isinstance(item.get("session_id"), str):
            out.append((item["session_id"], item))
        else:
            raise ValueError(f"each session must be a string or {{session_id: ...}}, got {item!r}")
    return out
