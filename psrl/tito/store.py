"""The TITO session store: per session, the exact token ids each turn was prompted with and sampled.

Sessions, their limits and expiry, and the locks; each turn is matched against the session's recorded turns by
psrl.tito.matching, and a session is exported by psrl.tito.snapshot. Pure logic, no I/O; the router calls it
from its chat pipeline.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from enum import StrEnum
from typing import Any, cast

from psrl.tito.errors import (
    InvalidTurn,
    SessionNotFound,
    TitoError,
    TooManyClientSessions,
    TooManySessions,
    TooManyTurns,
    TurnNotPrepared,
    TurnNotRecorded,
)
from psrl.tito.matching import Codec, chain_step, match_turn, normalize, plain, reply_signature
from psrl.tito.schema import RoutedExperts, Snapshot
from psrl.tito.snapshot import export
from psrl.tito.tree import Node, PreparedTurn, Session, Trajectory
from psrl.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


# At most this many idle sessions expire per call, so that one call never holds the store's lock long; each
# creation expires up to this many, far more than the one it adds, so expired sessions never pile up.
EXPIRE_BATCH = 16


class NotExported(StrEnum):
    """Why sampled turns ended up in no exported trajectory (the keys of TitoStore.turns_not_exported)."""

    DROPPED_BRANCH = "dropped_branch"  # drop_dead_leaves: the user asked to drop rewritten-away branches
    SESSION_EXPIRED = "session_expired"  # the session expired (session_ttl_s) before a snapshot included them


class TitoStore:
    """Sessions of token-exact turns; every method is synchronous and bounded.

    Locking: each session has its own lock, held for that session's work (a turn's template render and
    tokenization included), so sessions never wait on each other; the store's lock guards only the session
    table, the idle order and the counters, and is held for O(1) dict operations (plus a bounded expiry batch).
    A caller on an event loop runs the calls that take a session's lock (prepare_turn, record_turn,
    abandon_turn, snapshot, num_nodes) off the loop: they can wait for that session's render.

    Every turn the model sampled is exported: snapshot() lists each branch of a session's tree that holds
    sampled turns as its own trajectory entry, and says which one is each trajectory's final history. Only
    `drop_dead_leaves` (asked for explicitly) or an expired session (`session_ttl_s`) lose sampled turns, and
    `turns_not_exported` counts those, by reason, with a log line each time.

    Turns are templated and tokenized with the tokenizer given to prepare_turn (each model's own; the store's
    `tokenizer` when none is given); turns of different `model`s never share token ids.

    With `session_ttl_s`, a session no call has named for that long expires (a session with a turn in flight
    never does): expired sessions are swept when sessions are created, a bounded batch each time, and one that
    is named after its TTL is gone (SessionNotFound). `max_sessions_per_client` caps the live sessions of each
    `client` that create_session is given.
    """

    def __init__(
        self,
        tokenizer: Tokenizer | None = None,
        *,
        max_sessions: int = 10000,
        max_turns_per_session: int = 1000,
        gc_threshold: int = 0,
        max_trim_tokens: int = 0,
        debug: bool = False,
        drop_dead_leaves: bool = False,
        session_ttl_s: float = 0.0,
        max_sessions_per_client: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        for name, value in (
            ("max_sessions", max_sessions),
            ("max_turns_per_session", max_turns_per_session),
            ("gc_threshold", gc_threshold),
            ("max_trim_tokens", max_trim_tokens),
            ("max_sessions_per_client", max_sessions_per_client),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a non-negative int, got {value!r}")
        if isinstance(session_ttl_s, bool) or not isinstance(session_ttl_s, int | float) or not session_ttl_s >= 0:
            raise ValueError(f"session_ttl_s must be a non-negative number (0: no expiry), got {session_ttl_s!r}")
        self.tokenizer = tokenizer
        self.max_sessions = max_sessions
        self.session_ttl_s = float(session_ttl_s)
        self.max_sessions_per_client = max_sessions_per_client
        self.sessions_expired = 0  # since the store was built (the router's expiry counter reads it)
        # Sampled turns in no exported trajectory, by reason, since the store was built (the router's metric).
        self.turns_not_exported: dict[str, int] = {reason: 0 for reason in NotExported}
        self._clock = clock
        self.max_turns_per_session = max_turns_per_session
        self.gc_threshold = gc_threshold
        self.max_trim_tokens = max_trim_tokens
        self.debug = debug
        self.drop_dead_leaves = drop_dead_leaves
        self._sessions: dict[str, Session] = {}
        # The sessions without a turn in flight, least recently used first: expiry looks only at the front.
        self._idle: OrderedDict[str, None] = OrderedDict()
        self._per_client: dict[str, int] = {}
        self._lock = threading.Lock()
        self._codecs: dict[Tokenizer, Codec] = {}  # per model's tokenizer (a router has one per model served)
        self._default_codec = Codec.of(tokenizer) if tokenizer is not None else None

    # ---- sessions ---------------------------------------------------------------------------------------

    def create_session(self, client: str | None = None) -> str:
        """A new session; `client` (an opaque id, e.g. a credential's hash) counts against its own cap."""
        with self._lock:
            self._expire_idle(EXPIRE_BATCH)
            if len(self._sessions) >= self.max_sessions:
                raise TooManySessions(
                    f"the TITO store already holds max_sessions={self.max_sessions} sessions"
                    + (f" (idle ones expire after {self.session_ttl_s:g} s)" if self.session_ttl_s else "")
                )
            cap = self.max_sessions_per_client
            if client is not None and cap and self._per_client.get(client, 0) >= cap:
                raise TooManyClientSessions(
                    f"this client already holds max_sessions_per_client={cap} TITO sessions; delete finished ones"
                )
            sid = secrets.token_urlsafe(18)
            session = self._sessions[sid] = Session(sid, client=client)
            if client is not None:
                self._per_client[client] = self._per_client.get(client, 0) + 1
            self._touch(session)
            return sid

    def delete_session(self, sid: str) -> None:
        """Forget the session (its owner asked: nothing it held counts as lost)."""
        with self._lock:
            self._drop(self._session(sid))

    def expire_idle(self, limit: int | None = None) -> int:
        """Drop the sessions idle for longer than session_ttl_s (at most `limit`); how many were dropped."""
        with self._lock:
            return self._expire_idle(limit)

    def __len__(self) -> int:
        return len(self._sessions)

    def __contains__(self, sid: object) -> bool:
        return sid in self._sessions

    def num_nodes(self, sid: str) -> int:
        session = self._lookup(sid)
        with session.lock:
            return len(session.nodes)

    def client_sessions(self, client: str) -> int:
        return self._per_client.get(client, 0)

    # ---- turns ------------------------------------------------------------------------------------------

    def prepare_turn(
        self,
        sid: str,
        trajectory_id: int,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
        tokenizer: Tokenizer | None = None,
        model: str | None = None,
    ) -> PreparedTurn:
        """The prompt ids for the next turn of `trajectory_id`; it stays pending until record_turn.

        The prompt is rendered and tokenized with `tokenizer` (the model's; default: the store's), and `model`
        is part of the history: a turn continues only turns recorded for the same model.

        Per turn the work that grows with the conversation is one template render and C-speed comparisons:
        the messages are matched against the trajectory's recorded path (so only the new ones are hashed),
        and the render is checked against the path's recorded render; only the new suffix is tokenized. All of
        it runs under the session's lock only.
        """
        codec = self._codec(tokenizer)
        with self._lock:
            session = self._session(sid)
            # In use from now on: out of expiry's reach until the turn is recorded or abandoned.
            session.turns_in_flight += 1
            self._idle.pop(sid, None)
        try:
            with session.lock:
                return self._prepare(session, codec, trajectory_id, messages, tools, template_kwargs, model)
        except BaseException:
            with self._lock:
                self._end_turn(session)
            raise

    def _prepare(
        self,
        session: Session,
        codec: Codec,
        trajectory_id: int,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None,
        template_kwargs: Mapping[str, Any] | None,
        model: str | None,
    ) -> PreparedTurn:
        sid = session.id
        _check_trajectory_id(trajectory_id)
        traj = session.trajectories.get(trajectory_id)
        if traj is not None and traj.pending is not None:
            raise TurnNotRecorded(
                f"TITO session {sid!r} trajectory {trajectory_id}: the previous turn was prepared but not "
                "recorded; record (or abandon) it before preparing the next"
            )
        if session.turns_recorded >= self.max_turns_per_session:
            raise TooManyTurns(f"TITO session {sid!r} reached max_turns_per_session={self.max_turns_per_session}")
        prepared = match_turn(
            session,
            codec,
            trajectory_id,
            traj.leaf if traj is not None else None,
            messages,
            tools,
            template_kwargs,
            model,
            debug=self.debug,
        )
        if traj is None:
            traj = session.trajectories[trajectory_id] = Trajectory(trajectory_id)
        traj.pending = prepared
        return prepared

    def record_turn(
        self,
        sid: str,
        trajectory_id: int,
        prepared: PreparedTurn,
        *,
        output_ids: Sequence[int],
        output_logprobs: Sequence[float] | None,
        finish_reason: str | None,
        weight_version: int | None = None,
        token_versions: Sequence[int | None] | None = None,
        assistant_message: Mapping[str, Any] | None = None,
        routed_experts: Mapping[str, Any] | None = None,
    ) -> int:
        """Record what the model sampled for `prepared`; returns the new node's id.

        `assistant_message`, when given, is the message the router built from the output: a later turn then
        continues this node only if it echoes that message unchanged. `routed_experts`: the record's MoE routing
        (the snapshot's blob, as psrl.tito.training reads it), when the replica recorded it.
        """
        session = self._lookup(sid)
        with session.lock:
            traj = session.trajectories.get(trajectory_id)
            if traj is None or traj.pending is None or traj.pending is not prepared:
                raise TurnNotPrepared(
                    f"TITO session {sid!r} trajectory {trajectory_id}: this turn is not the one pending "
                    "(prepare_turn first, and record each prepared turn once)"
                )
            out = [int(i) for i in output_ids]
            lps = None if output_logprobs is None else [float(p) for p in output_logprobs]
            if lps is not None and len(lps) != len(out):
                raise InvalidTurn(f"{len(lps)} output_logprobs for {len(out)} output_ids")
            versions = None if token_versions is None else list(token_versions)
            if versions is not None and len(versions) != len(out):
                raise InvalidTurn(f"{len(versions)} token_versions for {len(out)} output_ids")

            parent = prepared.parent_node_id
            draft = prepared.draft
            node = Node(
                id=session.next_node_id,
                parent=parent,
                prompt_hash=draft.hashes[-1],
                num_messages=draft.num_messages,
                prompt_token_count=len(prepared.prompt_ids),
                new_prompt_ids=prepared.prompt_ids[prepared.reused_tokens :],
                output_ids=out,
                output_logprobs=lps,
                finish_reason=finish_reason,
                weight_version=weight_version,
                token_versions=versions,
                mismatch_report=list(prepared.mismatch_report),
                items=draft.items,
                plain=[plain(item) for item in draft.items],
                hashes=draft.hashes,
                rendered_tail=draft.rendered_tail,
                routed_experts=None if routed_experts is None else cast(RoutedExperts, dict(routed_experts)),
            )
            if assistant_message is not None:
                node.assistant = normalize(dict(assistant_message))
                node.assistant_plain = plain(node.assistant)
                node.assistant_hash = chain_step(node.prompt_hash, node.assistant)
                node.reply_signature = reply_signature(assistant_message)
            session.next_node_id += 1
            session.nodes[node.id] = node
            session.by_prompt_hash.setdefault(node.prompt_hash, []).append(node.id)
            session.turns_recorded += 1
            session.unsnapshotted += 1

            old_leaf = traj.leaf
            if old_leaf is not None and old_leaf != parent and old_leaf not in _ancestors(session, parent):
                traj.dead_leaves.append(old_leaf)
            traj.leaf = node.id
            traj.pending = None
            lost: list[Node] = []
            if self.drop_dead_leaves and traj.dead_leaves:
                dropped, traj.dead_leaves = traj.dead_leaves, []
                lost = self._newly_unreachable(session, dropped)
            if session.unreachable and len(session.nodes) > self.gc_threshold:
                self._collect_garbage(session)
        with self._lock:
            self._end_turn(session)
            self.turns_not_exported[NotExported.DROPPED_BRANCH] += len(lost)
        if lost:
            _log_not_exported(sid, lost, "dropped from every branch (tito_drop_dead_leaves)")
        return node.id

    def abandon_turn(self, sid: str, trajectory_id: int, prepared: PreparedTurn | None = None) -> None:
        """Forget the pending prepared turn (the generation failed); the trajectory stays as it was.

        With `prepared`, only that turn is forgotten (not a later one prepared meanwhile)."""
        session = self._lookup(sid)
        lost: list[Node] = []
        with session.lock:
            traj = session.trajectories.get(trajectory_id)
            if traj is None:
                return
            pending = traj.pending
            if pending is None or (prepared is not None and pending is not prepared):
                return
            traj.pending = None
            if traj.leaf is None and not traj.dead_leaves:
                del session.trajectories[trajectory_id]
            if self.drop_dead_leaves:
                # A dropped branch that only this pending turn still continued: no longer reachable.
                lost = self._newly_unreachable(session, [pending.parent_node_id])
        with self._lock:
            self._end_turn(session)
            self.turns_not_exported[NotExported.DROPPED_BRANCH] += len(lost)
        if lost:
            _log_not_exported(sid, lost, "dropped from every branch (tito_drop_dead_leaves)")

    # ---- snapshot ---------------------------------------------------------------------------------------

    def snapshot(self, sid: str) -> Snapshot:
        """The session's GET /tito/sessions/{sid} body: every branch that holds sampled turns (see export)."""
        session = self._lookup(sid)
        with session.lock:
            return export(session, self.max_trim_tokens)

    # ---- internals --------------------------------------------------------------------------------------

    def _codec(self, tokenizer: Tokenizer | None) -> Codec:
        if tokenizer is None:
            if self._default_codec is None:
                raise TitoError("this TITO store has no default tokenizer: pass the model's tokenizer")
            return self._default_codec
        if tokenizer is self.tokenizer and self._default_codec is not None:
            return self._default_codec
        with self._lock:
            codec = self._codecs.get(tokenizer)
        if codec is None:
            codec = Codec.of(tokenizer)  # a few decodes, outside the store's lock
            with self._lock:
                codec = self._codecs.setdefault(tokenizer, codec)
        return codec

    def _lookup(self, sid: str) -> Session:
        with self._lock:
            return self._session(sid)

    def _session(self, sid: str) -> Session:
        """The session, as used now (its idle time starts again); an idle one past its TTL expires here.

        Under the store's lock."""
        session = self._sessions.get(sid)
        if session is not None and self._expired(session, self._clock()):
            self._expire(session)
            session = None
        if session is None:
            raise SessionNotFound(f"TITO session {sid!r} not found")
        self._touch(session)
        return session

    def _expired(self, session: Session, now: float) -> bool:
        return bool(self.session_ttl_s) and not session.turns_in_flight and now - session.last_used > self.session_ttl_s

    def _touch(self, session: Session) -> None:
        session.last_used = self._clock()
        if not session.turns_in_flight and self._sessions.get(session.id) is session:
            self._idle[session.id] = None
            self._idle.move_to_end(session.id)

    def _end_turn(self, session: Session) -> None:
        session.turns_in_flight -= 1
        self._touch(session)  # idle from the end of its last turn on

    def _drop(self, session: Session) -> None:
        del self._sessions[session.id]
        self._idle.pop(session.id, None)
        if session.client is not None:
            left = self._per_client[session.client] - 1
            if left:
                self._per_client[session.client] = left
            else:
                del self._per_client[session.client]

    def _expire(self, session: Session) -> None:
        """Drop a session past its TTL; its turns no snapshot included are lost (counted, logged)."""
        self._drop(session)
        self.sessions_expired += 1
        # Read without the session's lock: an expired session has no turn in flight, so nothing records into
        # it; at worst a snapshot being taken right now has not subtracted its turns yet.
        lost = max(session.unsnapshotted, 0)
        if lost:
            self.turns_not_exported[NotExported.SESSION_EXPIRED] += lost
            logger.warning(
                "TITO session %s expired after %g s idle with %d sampled turns no snapshot exported; they are in "
                "no training data",
                session.id,
                self.session_ttl_s,
                lost,
            )

    def _expire_idle(self, limit: int | None) -> int:
        if not self.session_ttl_s:
            return 0
        now = self._clock()
        dropped = 0
        while self._idle and (limit is None or dropped < limit):
            oldest = self._sessions[next(iter(self._idle))]
            if not self._expired(oldest, now):
                break  # the rest were used more recently
            self._expire(oldest)
            dropped += 1
        return dropped

    def _reachable(self, session: Session) -> set[int]:
        """The nodes some leaf reaches (kept dead leaves and pending turns' parents included)."""
        roots: list[int | None] = []
        for traj in session.trajectories.values():
            roots.append(traj.leaf)
            roots += traj.dead_leaves
            if traj.pending is not None:
                roots.append(traj.pending.parent_node_id)
        keep: set[int] = set()
        for node_id in roots:
            while node_id is not None and node_id not in keep:
                keep.add(node_id)
                node_id = session.nodes[node_id].parent
        return keep

    def _newly_unreachable(self, session: Session, starts: Sequence[int | None]) -> list[Node]:
        """The nodes on the paths to `starts` that no leaf reaches any more (just dropped): they are in no
        exported branch now. Counted once: as unreachable (for GC), and out of the unsnapshotted count."""
        keep = self._reachable(session)
        lost: dict[int, Node] = {}
        for node_id in starts:
            while node_id is not None and node_id not in keep and node_id not in lost and node_id in session.nodes:
                node = session.nodes[node_id]
                if node.unexported:
                    break  # already counted when an earlier drop cut it off
                lost[node_id] = node
                node_id = node.parent
        for node in lost.values():
            node.unexported = True
            if not node.snapshotted:
                session.unsnapshotted -= 1
        session.unreachable += len(lost)
        session.turns_not_exported += len(lost)
        return sorted(lost.values(), key=lambda n: n.id)

    def _collect_garbage(self, session: Session) -> None:
        """Free the nodes no leaf reaches (dropped branches; kept dead leaves and pending turns' parents stay)."""
        keep = self._reachable(session)
        for node_id in [i for i in session.nodes if i not in keep]:
            node = session.nodes.pop(node_id)
            same = session.by_prompt_hash[node.prompt_hash]
            same.remove(node_id)
            if not same:
                del session.by_prompt_hash[node.prompt_hash]
        session.unreachable = 0


def _log_not_exported(sid: str, lost: list[Node], why: str) -> None:
    tokens = sum(len(n.output_ids) for n in lost)
    logger.info(
        "TITO session %s: %d sampled turns (%d tokens, nodes %s) %s; they are in no exported trajectory",
        sid,
        len(lost),
        tokens,
        [n.id for n in lost],
        why,
    )


def _check_trajectory_id(trajectory_id: Any) -> None:
    if isinstance(trajectory_id, bool) or not isinstance(trajectory_id, int) or trajectory_id < 0:
        raise InvalidTurn(f"trajectory_id must be a non-negative int, got {trajectory_id!r}")


def _ancestors(session: Session, node_id: int | None) -> set[int]:
    return {n.id for n in session.path(node_id)}
