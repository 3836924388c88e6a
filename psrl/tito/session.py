"""The TITO session store: per session, the exact token ids each turn was prompted with and sampled.

A third-party agent resends its whole chat history every turn; the store turns that history into a prompt
that reuses the ids already recorded for the conversation (the model's sampled ids are never re-tokenized)
and tokenizes only the new suffix. Pure logic, no I/O; the router calls it from its chat pipeline.
"""

from __future__ import annotations

import hashlib
import json
import logging
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from psrl.tokenizer import TEMPLATE_CALL_ARGS, ChatTemplateError, InvalidTextError, Tokenizer

logger = logging.getLogger(__name__)


# --- errors ------------------------------------------------------------------------------------------------


class TitoError(ValueError):
    """A TITO request the store refuses; `code` names the reason for the router's error mapping."""

    code = "tito_error"


class SessionNotFound(TitoError):
    code = "session_not_found"


class TooManySessions(TitoError):
    code = "too_many_sessions"


class TooManyClientSessions(TooManySessions):
    """One client holds max_sessions_per_client live sessions already."""

    code = "too_many_client_sessions"


class TooManyTurns(TitoError):
    code = "too_many_turns"


class TurnNotRecorded(TitoError):
    """A turn was prepared on the trajectory and neither recorded nor abandoned."""

    code = "turn_not_recorded"


class TurnNotPrepared(TitoError):
    """record_turn got a PreparedTurn that is not the trajectory's pending one."""

    code = "turn_not_prepared"


class InvalidTurn(TitoError):
    code = "invalid_turn"


class TemplateRenderError(TitoError):
    code = "template_error"


# --- what crosses the boundary -----------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class PreparedTurn:
    """The prompt for one turn, to be sent to the model and then passed back to record_turn.

    `parent_node_id` is the recorded turn this one continues (None: a new root, fully tokenized);
    `reused_tokens` ids of `prompt_ids` are that path's canonical ids, the rest is the new suffix.
    `branched` says the turn does not continue the trajectory's latest turn (a history rewrite, or a
    trajectory that starts from another one's node).
    """

    session_id: str
    trajectory_id: int
    prompt_ids: list[int]
    parent_node_id: int | None
    reused_tokens: int
    branched: bool
    draft: _Draft = field(repr=False)
    mismatch_report: list[dict[str, Any]] = field(default_factory=list)

    @property
    def new_tokens(self) -> int:
        return len(self.prompt_ids) - self.reused_tokens


@dataclass(frozen=True, eq=False)
class _Draft:
    """What record_turn needs, besides the ids, to add a prepared turn to the tree.

    The prompt has `num_messages` messages. Its chain (see _chain_hashes) hashes the items [header, *messages];
    `items` and `hashes` are the normalized items from the parent's chain on and the hashes after each (at a
    root, all of them from the header on; at a child, from the parent's assistant reply as the agent echoed it
    on), so hashes[-1] is the prompt's hash and a path's items and hashes are the concatenation of its nodes'.
    `rendered_tail` is the template's render of the prompt after the parent's render (all of it at a root), so
    that a path's render is the concatenation of its nodes' tails too.
    """

    num_messages: int
    items: list[Any]
    hashes: list[str]
    rendered_tail: str


@dataclass(eq=False)
class _Node:
    """One recorded turn: the prompt ids it added after its parent's ids, and the ids the model sampled.

    It also keeps its part of the conversation (see _Draft), so that the next turn can match the history
    against the recorded path message by message and reuse the chain hashes, and check that the history still
    renders as recorded without rendering or hashing it again. Each node holds only what it added: a path's
    items, hashes and render are split over its nodes, so memory grows linearly with the conversation.
    """

    id: int
    parent: int | None
    prompt_hash: str  # chain hash of the normalized messages the turn was prompted with
    num_messages: int
    prompt_token_count: int  # len of the whole prompt (the parent path's ids + new_prompt_ids)
    new_prompt_ids: list[int]
    output_ids: list[int]
    output_logprobs: list[float] | None
    finish_reason: str | None
    weight_version: int | None
    token_versions: list[int | None] | None
    mismatch_report: list[dict[str, Any]]
    items: list[Any]  # _Draft.items
    plain: list[bool]  # per item: _plain(item), so that `==` against it is an exact match
    hashes: list[str]  # _Draft.hashes
    rendered_tail: str  # _Draft.rendered_tail
    assistant: Any = None  # the normalized assistant message, when the router gave it
    routed_experts: dict[str, Any] | None = None  # the record's MoE routing blob, when recorded
    assistant_plain: bool = False
    assistant_hash: str | None = None  # chain hash through the assistant message, when the router gave it
    # What a later turn's echo of the reply must match for this node to be its parent (see _reply_signature);
    # None: the router gave no assistant message, so any echo is taken as this reply.
    reply_signature: tuple[str, tuple[tuple[str, str], ...]] | None = None
    snapshotted: bool = False  # a snapshot has exported it
    unexported: bool = False  # dropped (drop_dead_leaves): in no branch any more, never a parent again


@dataclass(eq=False)
class _Trajectory:
    id: int
    leaf: int | None = None
    dead_leaves: list[int] = field(default_factory=list)  # leaves left behind by history rewrites
    pending: PreparedTurn | None = None


@dataclass(eq=False)
class _Session:
    """One session's tree. `lock` guards everything below it; the store's own lock guards `last_used` and
    `turns_in_flight` (what expiry reads)."""

    id: str
    nodes: dict[int, _Node] = field(default_factory=dict)
    by_prompt_hash: dict[str, list[int]] = field(default_factory=dict)
    trajectories: dict[int, _Trajectory] = field(default_factory=dict)
    next_node_id: int = 0
    turns_recorded: int = 0
    client: str | None = None  # who created it, for the per-client cap
    last_used: float = 0.0  # the store's clock at the last call that named the session (or a turn's end)
    turns_in_flight: int = 0  # being prepared, or prepared and neither recorded nor abandoned: cannot expire
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    unsnapshotted: int = 0  # exported turns no snapshot has included yet (what expiry loses)
    unreachable: int = 0  # nodes no leaf reaches any more (dropped branches): what GC frees
    turns_not_exported: int = 0  # sampled turns dropped from every exported branch (drop_dead_leaves)

    def path(self, node_id: int | None) -> list[_Node]:
        """Nodes root -> node_id."""
        out: list[_Node] = []
        while node_id is not None:
            node = self.nodes[node_id]
            out.append(node)
            node_id = node.parent
        out.reverse()
        return out


@dataclass(frozen=True, eq=False)
class _Codec:
    """A model's tokenizer with what the store derives from it once: its end-of-turn token texts."""

    tokenizer: Tokenizer
    eot_text_of: dict[int, str]
    eot_texts: list[str]  # longest first

    @classmethod
    def of(cls, tokenizer: Tokenizer) -> _Codec:
        text_of = {i: tokenizer.decode([i], skip_special_tokens=False) for i in tokenizer.eos_token_ids}
        return cls(tokenizer, text_of, sorted({t for t in text_of.values() if t}, key=len, reverse=True))

    def render(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool,
        tools: list[dict[str, Any]] | None,
        kwargs: dict[str, Any],
    ) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tools=tools, **kwargs
            )
        except ChatTemplateError as exc:
            raise TemplateRenderError(str(exc)) from exc


# --- the store ---------------------------------------------------------------------------------------------


# At most this many idle sessions expire per call, so that one call never holds the store's lock long; each
# creation expires up to this many, far more than the one it adds, so expired sessions never pile up.
EXPIRE_BATCH = 16

# Why sampled turns ended up in no exported trajectory (the keys of TitoStore.turns_not_exported).
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
        self.turns_not_exported: dict[str, int] = {DROPPED_BRANCH: 0, SESSION_EXPIRED: 0}
        self._clock = clock
        self.max_turns_per_session = max_turns_per_session
        self.gc_threshold = gc_threshold
        self.max_trim_tokens = max_trim_tokens
        self.debug = debug
        self.drop_dead_leaves = drop_dead_leaves
        self._sessions: dict[str, _Session] = {}
        # The sessions without a turn in flight, least recently used first: expiry looks only at the front.
        self._idle: OrderedDict[str, None] = OrderedDict()
        self._per_client: dict[str, int] = {}
        self._lock = threading.Lock()
        self._codecs: dict[Tokenizer, _Codec] = {}  # per model's tokenizer (a router has one per model served)
        self._default_codec = _Codec.of(tokenizer) if tokenizer is not None else None

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
            session = self._sessions[sid] = _Session(sid, client=client)
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
        session: _Session,
        codec: _Codec,
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
        msgs = _check_messages(messages)
        tool_list = [dict(t) for t in tools] if tools else None
        kwargs = dict(template_kwargs or {})
        taken = TEMPLATE_CALL_ARGS.intersection(kwargs)
        if taken:
            raise InvalidTurn(f"template_kwargs cannot set {sorted(taken)}: the template call sets them")
        header: dict[str, Any] = {"tools": tool_list, "template_kwargs": kwargs}
        if model is not None:  # another model's ids mean other tokens: its turns are another history
            header["model"] = model
        own_path = session.path(traj.leaf) if traj is not None else []
        chain, items = _chain_hashes([header, *msgs], own_path)
        full = codec.render(msgs, True, tool_list, kwargs)

        report: list[dict[str, Any]] = []
        parent = self._find_parent(session, own_path, msgs, chain)
        prompt_ids: list[int] = []
        rendered = 0  # the length of the parent path's render, the start of this turn's part of `full`
        new_text = full
        if parent is not None:
            path = own_path if own_path and own_path[-1] is parent else session.path(parent.id)
            start = _rendered_prefix(path, full)
            reply = msgs[parent.num_messages]
            suffix = None if start is None else _suffix_text(codec, parent, full, start, reply)
            if start is None or suffix is None:
                report.append(
                    {
                        "mismatch_type": "template_not_prefix_stable",
                        "position": 0,
                        "detail": f"the render of the conversation up to node {parent.id} is not a prefix of "
                        "the full render; tokenized the whole prompt as a new root",
                    }
                )
                logger.warning("TITO session %s: template not prefix-stable, full re-tokenization", sid)
                parent = None
            else:
                rendered, new_text = start, suffix
                prompt_ids = _ids_of(path)
        reused = len(prompt_ids)
        try:
            prompt_ids += codec.tokenizer.encode(new_text)
            if self.debug:
                report += _compare_ids(prompt_ids, codec.tokenizer.encode(full))
        except InvalidTextError as e:
            raise InvalidTurn(f"the messages cannot be tokenized: {e}") from None

        parent_id = parent.id if parent is not None else None
        leaf = traj.leaf if traj is not None else None
        first = parent.num_messages + 1 if parent is not None else 0  # items[first:]: this turn's part
        prepared = PreparedTurn(
            session_id=sid,
            trajectory_id=trajectory_id,
            prompt_ids=prompt_ids,
            parent_node_id=parent_id,
            reused_tokens=reused,
            branched=parent_id != leaf and (parent_id is not None or leaf is not None),
            draft=_Draft(len(msgs), items[first:], chain[first:], full[rendered:]),
            mismatch_report=report,
        )
        if traj is None:
            traj = session.trajectories[trajectory_id] = _Trajectory(trajectory_id)
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
        (COMPAT section 6's blob, as psrl.tito.training reads it), when the replica recorded it.
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
            node = _Node(
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
                plain=[_plain(item) for item in draft.items],
                hashes=draft.hashes,
                rendered_tail=draft.rendered_tail,
                routed_experts=None if routed_experts is None else dict(routed_experts),
            )
            if assistant_message is not None:
                node.assistant = _normalize(dict(assistant_message))
                node.assistant_plain = _plain(node.assistant)
                node.assistant_hash = _chain_step(node.prompt_hash, node.assistant)
                node.reply_signature = _reply_signature(assistant_message)
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
            lost: list[_Node] = []
            if self.drop_dead_leaves and traj.dead_leaves:
                dropped, traj.dead_leaves = traj.dead_leaves, []
                lost = self._newly_unreachable(session, dropped)
            if session.unreachable and len(session.nodes) > self.gc_threshold:
                self._collect_garbage(session)
        with self._lock:
            self._end_turn(session)
            self.turns_not_exported[DROPPED_BRANCH] += len(lost)
        if lost:
            _log_not_exported(sid, lost, "dropped from every branch (tito_drop_dead_leaves)")
        return node.id

    def abandon_turn(self, sid: str, trajectory_id: int, prepared: PreparedTurn | None = None) -> None:
        """Forget the pending prepared turn (the generation failed); the trajectory stays as it was.

        With `prepared`, only that turn is forgotten (not a later one prepared meanwhile)."""
        session = self._lookup(sid)
        lost: list[_Node] = []
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
            self.turns_not_exported[DROPPED_BRANCH] += len(lost)
        if lost:
            _log_not_exported(sid, lost, "dropped from every branch (tito_drop_dead_leaves)")

    # ---- snapshot ---------------------------------------------------------------------------------------

    def snapshot(self, sid: str) -> dict[str, Any]:
        """COMPAT section 6's GET /tito/sessions/{sid} body, with every branch that holds sampled turns.

        `trajectories` has, per trajectory id (ascending), its final history first (`final: true`: the path to
        the turn it recorded last, what the agent's conversation is now), then each other branch it left
        behind (`final: false`, a history rewrite, or an agent that dropped its reply), oldest first; a branch
        that another exported one continues is not listed again. `path_node_ids` are a branch's tree nodes,
        one per record. `turns_not_exported` counts this session's sampled turns no branch holds any more.
        """
        session = self._lookup(sid)
        with session.lock:
            branches: list[tuple[int, int | None, bool]] = []  # (trajectory id, leaf, final)
            paths: dict[int | None, list[_Node]] = {}
            for tid in sorted(session.trajectories):
                traj = session.trajectories[tid]
                branches.append((tid, traj.leaf, True))
                branches += [(tid, d, False) for d in sorted(traj.dead_leaves)]
            for _, leaf, _ in branches:
                if leaf not in paths:
                    paths[leaf] = session.path(leaf)
            # A left-behind leaf that another branch continues (the agent went back to it) holds no turn of its own.
            continued = {n.id for path in paths.values() for n in path[:-1]}
            finals = {leaf for _, leaf, final in branches if final}
            exported = [
                (tid, leaf, final)
                for tid, leaf, final in branches
                if final or (leaf not in continued and leaf not in finals)
            ]

            trajectories = []
            through: dict[int, list[int]] = {}
            newly_snapshotted = 0
            for tid, leaf, final in exported:
                path = paths[leaf]
                trajectories.append(
                    {
                        "trajectory_id": tid,
                        "accumulated_token_ids": _ids_of(path),
                        "records": [_record(n) for n in path],
                        "final": final,
                        "path_node_ids": [n.id for n in path],
                    }
                )
                for node in path:
                    tids = through.setdefault(node.id, [])
                    if not tids or tids[-1] != tid:
                        tids.append(tid)
                    if not node.snapshotted:
                        node.snapshotted = True
                        newly_snapshotted += 1
            session.unsnapshotted -= newly_snapshotted
            leaves = []
            for tid in sorted(session.trajectories):
                traj = session.trajectories[tid]
                if traj.leaf is not None:
                    leaves.append(_leaf(session, tid, traj.leaf, dead=False))
                leaves += [_leaf(session, tid, d, dead=True) for d in traj.dead_leaves]
            nodes = [
                {
                    "id": n.id,
                    "hash": n.prompt_hash,
                    "parent": n.parent,
                    "finish_reason": n.finish_reason,
                    "truncated": n.finish_reason == "length",
                    "num_tokens": n.prompt_token_count + len(n.output_ids),
                    "trajectory_ids": through.get(n.id, []),
                }
                for n in sorted(session.nodes.values(), key=lambda n: n.id)
            ]
            return {
                "session_id": sid,
                "max_trim_tokens": self.max_trim_tokens,
                "trajectories": trajectories,
                "turns_not_exported": session.turns_not_exported,
                "tree": {"nodes": nodes, "leaves": leaves},
            }

    # ---- internals --------------------------------------------------------------------------------------

    def _codec(self, tokenizer: Tokenizer | None) -> _Codec:
        if tokenizer is None:
            if self._default_codec is None:
                raise TitoError("this TITO store has no default tokenizer: pass the model's tokenizer")
            return self._default_codec
        if tokenizer is self.tokenizer and self._default_codec is not None:
            return self._default_codec
        with self._lock:
            codec = self._codecs.get(tokenizer)
        if codec is None:
            codec = _Codec.of(tokenizer)  # a few decodes, outside the store's lock
            with self._lock:
                codec = self._codecs.setdefault(tokenizer, codec)
        return codec

    def _lookup(self, sid: str) -> _Session:
        with self._lock:
            return self._session(sid)

    def _session(self, sid: str) -> _Session:
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

    def _expired(self, session: _Session, now: float) -> bool:
        return bool(self.session_ttl_s) and not session.turns_in_flight and now - session.last_used > self.session_ttl_s

    def _touch(self, session: _Session) -> None:
        session.last_used = self._clock()
        if not session.turns_in_flight and self._sessions.get(session.id) is session:
            self._idle[session.id] = None
            self._idle.move_to_end(session.id)

    def _end_turn(self, session: _Session) -> None:
        session.turns_in_flight -= 1
        self._touch(session)  # idle from the end of its last turn on

    def _drop(self, session: _Session) -> None:
        del self._sessions[session.id]
        self._idle.pop(session.id, None)
        if session.client is not None:
            left = self._per_client[session.client] - 1
            if left:
                self._per_client[session.client] = left
            else:
                del self._per_client[session.client]

    def _expire(self, session: _Session) -> None:
        """Drop a session past its TTL; its turns no snapshot included are lost (counted, logged)."""
        self._drop(session)
        self.sessions_expired += 1
        # Read without the session's lock: an expired session has no turn in flight, so nothing records into
        # it; at worst a snapshot being taken right now has not subtracted its turns yet.
        lost = max(session.unsnapshotted, 0)
        if lost:
            self.turns_not_exported[SESSION_EXPIRED] += lost
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

    def _find_parent(
        self, session: _Session, own_path: list[_Node], msgs: list[dict[str, Any]], chain: list[str]
    ) -> _Node | None:
        """The deepest recorded turn whose prompt messages + its assistant reply are a prefix of `msgs`.

        `own_path` is the trajectory's latest path (root -> leaf), preferred among turns with the same prompt.
        """
        own = {n.id for n in own_path}
        for n in range(len(msgs) - 1, 0, -1):
            if msgs[n].get("role") != "assistant":
                continue
            same_prompt = session.by_prompt_hash.get(chain[n])
            if not same_prompt:
                continue
            echoed = _reply_signature(msgs[n])
            candidates = [
                node
                for node in map(session.nodes.__getitem__, same_prompt)
                if node.reply_signature in (None, echoed) and not node.unexported
            ]
            if candidates:
                # Two turns may share a prompt (samples of one prompt); prefer this trajectory's own, then the newest.
                return max(candidates, key=lambda node: (node.id in own, node.id))
        return None

    def _reachable(self, session: _Session) -> set[int]:
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

    def _newly_unreachable(self, session: _Session, starts: Sequence[int | None]) -> list[_Node]:
        """The nodes on the paths to `starts` that no leaf reaches any more (just dropped): they are in no
        exported branch now. Counted once: as unreachable (for GC), and out of the unsnapshotted count."""
        keep = self._reachable(session)
        lost: dict[int, _Node] = {}
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

    def _collect_garbage(self, session: _Session) -> None:
        """Free the nodes no leaf reaches (dropped branches; kept dead leaves and pending turns' parents stay)."""
        keep = self._reachable(session)
        for node_id in [i for i in session.nodes if i not in keep]:
            node = session.nodes.pop(node_id)
            same = session.by_prompt_hash[node.prompt_hash]
            same.remove(node_id)
            if not same:
                del session.by_prompt_hash[node.prompt_hash]
        session.unreachable = 0


def _suffix_text(codec: _Codec, parent: _Node, full: str, start: int, reply: Mapping[str, Any]) -> str | None:
    """The text of `full` after what the model sampled in `parent`; None when the template is not prefix-stable.

    `full[:start]` is the render `parent` was prompted with (see _rendered_prefix). The reply starts there;
    ChatML renders it as `...<|im_end|>\\n` while the model stops after `<|im_end|>`: the suffix starts right
    after the end-of-turn text when the output ended with it, and at the end-of-turn text when it did not (a
    length cut), so that the template's own closing is still added. A reply whose text the template renders
    as is is skipped first, so an end-of-turn text inside it (a model explaining ChatML) is not taken for
    the end.
    """
    content = reply.get("content")
    if isinstance(content, str) and content and full.startswith(content, start):
        start += len(content)
    best, eot = -1, ""
    for text in codec.eot_texts:
        pos = full.find(text, start)
        if pos >= 0 and (best < 0 or pos < best):
            best, eot = pos, text
    if best < 0:
        return None
    out = parent.output_ids
    ended = bool(out) and codec.eot_text_of.get(out[-1]) == eot
    return full[best + len(eot) if ended else best :]


def _log_not_exported(sid: str, lost: list[_Node], why: str) -> None:
    tokens = sum(len(n.output_ids) for n in lost)
    logger.info(
        "TITO session %s: %d sampled turns (%d tokens, nodes %s) %s; they are in no exported trajectory",
        sid,
        len(lost),
        tokens,
        [n.id for n in lost],
        why,
    )


# --- helpers -----------------------------------------------------------------------------------------------


def _check_trajectory_id(trajectory_id: Any) -> None:
    if isinstance(trajectory_id, bool) or not isinstance(trajectory_id, int) or trajectory_id < 0:
        raise InvalidTurn(f"trajectory_id must be a non-negative int, got {trajectory_id!r}")


def _check_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    if not messages:
        raise InvalidTurn("messages must be a non-empty list")
    out = []
    for i, message in enumerate(messages):
        # dicts are used as they are (the template's sandbox cannot change them, and the store keeps normalized
        # copies), other mappings are copied into dicts
        if type(message) is not dict and isinstance(message, Mapping):
            message = dict(message)
        if type(message) is not dict or not isinstance(message.get("role"), str):
            raise InvalidTurn(f"message {i} must be a dict with a string `role`")
        out.append(message)
    return out


def _normalize(value: Any) -> Any:
    """Drop None-valued keys: agents echo `"content": null` or leave it out, and the template reads both alike."""
    if isinstance(value, Mapping):
        return {str(k): _normalize(v) for k, v in value.items() if v is not None}
    if isinstance(value, list | tuple):
        return [_normalize(v) for v in value]
    return value


def _chain_step(previous: str, message: Any) -> str:
    if isinstance(message, dict) and all(isinstance(v, str) for v in message.values()):
        # The common message (role + text content): skip JSON's escaping, which dominated long histories.
        # Lengths first, so that no text can pass for another split into other keys and values.
        text = "".join(f"{len(k)}\x1f{k}{len(v)}\x1f{v}" for k, v in sorted(message.items()))
    else:
        text = "\x1d" + json.dumps(message, sort_keys=True, ensure_ascii=False, separators=(",", ":"), default=str)
    # surrogatepass: a lone surrogate (which the tokenizer then refuses) must not crash the hash first
    return hashlib.sha256(previous.encode() + b"\x00" + text.encode("utf-8", "surrogatepass")).hexdigest()


def _chain_hashes(items: list[Any], recorded: list[_Node]) -> tuple[list[str], list[Any]]:
    """(chain, normalized items) of the items [header, *messages], the header being the tools and template kwargs.

    chain[i] is the hash after items[i]: chain[0] identifies the header (it changes every render) and chain[i]
    the messages before index i under it. The items are matched one by one against `recorded` (a path root ->
    leaf, followed by the leaf's assistant reply when record_turn got it): as long as they match (_same: the item
    normalizes to exactly what was recorded, so hashing it again would give the recorded hash), their recorded
    hashes and normalized forms are taken as they are. Only the items after the first difference (normally just
    this turn's new messages) are normalized and hashed.
    """
    chain: list[str] = []
    normals: list[Any] = []
    if recorded:
        for item, (stored, plain, hashed) in zip(items, _recorded_items(recorded)):
            if not _same(item, stored, plain):
                break
            normals.append(stored)
            chain.append(hashed)
    for item in items[len(normals) :]:
        normals.append(_normalize(item))
        chain.append(_chain_step(chain[-1] if chain else "", normals[-1]))
    return chain, normals


def _ids_of(path: list[_Node]) -> list[int]:
    """The token ids along a path: each turn's new prompt ids, then what it sampled."""
    ids: list[int] = []
    for node in path:
        ids += node.new_prompt_ids
        ids += node.output_ids
    return ids


def _reply_signature(message: Mapping[str, Any]) -> tuple[str, tuple[tuple[str, str], ...]]:
    """What of an assistant reply the model sampled: its text (stripped, as the router's parser reports it) and
    its tool calls' names and arguments (as canonical JSON, so an agent or an API conversion that re-serializes
    them still matches). Ids and reasoning are left out: the model did not sample ids, and templates drop
    reasoning. An echo that differs here is an edited reply, so the turn branches instead of reusing ids."""
    content = message.get("content")
    if isinstance(content, list):
        content = "".join(p.get("text", "") for p in content if isinstance(p, Mapping))
    text = content.strip() if isinstance(content, str) else ""
    calls: list[tuple[str, str]] = []
    for call in message.get("tool_calls") or ():
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping):
            calls.append(("", json.dumps(call, sort_keys=True, default=str)))
            continue
        arguments = function.get("arguments")
        try:
            parsed = json.loads(arguments) if isinstance(arguments, str) else arguments
            canonical = json.dumps(parsed, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
        except (ValueError, TypeError):
            canonical = str(arguments).strip()
        calls.append((str(function.get("name")), canonical))
    return text, tuple(calls)


def _recorded_items(path: list[_Node]) -> Iterator[tuple[Any, bool, str]]:
    """(normalized item, plain, chain hash after it) along `path`, then its leaf's assistant reply if known."""
    for node in path:
        yield from zip(node.items, node.plain, node.hashes)
    leaf = path[-1]
    if leaf.assistant_hash is not None:
        yield leaf.assistant, leaf.assistant_plain, leaf.assistant_hash


def _same(item: Any, stored: Any, plain: bool) -> bool:
    """Whether `item` normalizes to exactly `stored` (a normalized item), so to the same chain hash.

    `==` runs at C speed but is not exact where numbers are involved (1 == 1.0 == True and 0.0 == -0.0, which
    JSON, the hash and the template tell apart); `plain` (see _plain) says `stored` holds none, and then it is.
    Otherwise _identical decides. A False for equal items only costs a hash: the chain stays exact.
    """
    if item == stored:
        return plain or _identical(item, stored)
    normal = _normalize(item)
    return normal == stored and (plain or _identical(normal, stored))


def _plain(value: Any) -> bool:
    """Only dicts and lists of strings (and None in lists): `==` against it is exact for JSON-like values."""
    if type(value) is dict:
        return all(map(_plain, value.values()))
    if type(value) is list:
        return all(map(_plain, value))
    return type(value) is str or value is None


def _identical(a: Any, b: Any) -> bool:
    """Equal, with the same JSON types all the way down (floats by their repr, as JSON writes them).

    Anything else (another type) is not identical: the caller hashes it instead.
    """
    kind = type(a)
    if kind is not type(b):
        return False
    if kind is dict:
        return a.keys() == b.keys() and all(_identical(v, b[k]) for k, v in a.items())
    if kind is list:
        return len(a) == len(b) and all(map(_identical, a, b))
    if kind is float:
        return repr(a) == repr(b)
    return kind in (str, int, bool, type(None)) and a == b


def _rendered_prefix(path: list[_Node], full: str) -> int | None:
    """The length of the render the last turn of `path` was prompted with, if `full` starts with it (else None).

    That render is the concatenation of the path's rendered tails: comparing each one in place (no copy, no
    hashing) checks that the conversation so far still renders exactly as it did. A template that renders
    earlier turns differently once messages are added (not prefix-stable) fails here.
    """
    start = 0
    for node in path:
        if not full.startswith(node.rendered_tail, start):
            return None
        start += len(node.rendered_tail)
    return start


def _ancestors(session: _Session, node_id: int | None) -> set[int]:
    return {n.id for n in session.path(node_id)}


def _compare_ids(incremental: list[int], full: list[int]) -> list[dict[str, Any]]:
    """The debug validator: where the incremental prompt departs from a full re-tokenization of the render."""
    if incremental == full:
        return []
    position = next((i for i, (a, b) in enumerate(zip(incremental, full)) if a != b), None)
    if position is None:
        return [
            {
                "mismatch_type": "length_mismatch",
                "position": min(len(incremental), len(full)),
                "detail": f"incremental prompt has {len(incremental)} tokens, full re-tokenization {len(full)}",
            }
        ]
    return [
        {
            "mismatch_type": "token_mismatch",
            "position": position,
            "detail": f"incremental {incremental[position : position + 8]} != re-tokenized "
            f"{full[position : position + 8]} (lengths {len(incremental)} vs {len(full)})",
        }
    ]


def _record(node: _Node) -> dict[str, Any]:
    lps = node.output_logprobs
    return {
        "prompt_token_count": node.prompt_token_count,
        "output_logprobs": None if lps is None else [[lp, tok] for lp, tok in zip(lps, node.output_ids)],
        "finish_reason": node.finish_reason,
        "mismatch_report": list(node.mismatch_report),
        "routed_experts": node.routed_experts,
        "weight_version": node.weight_version,
        "output_token_versions": None if node.token_versions is None else list(node.token_versions),
    }


def _leaf(session: _Session, tid: int, node_id: int, *, dead: bool) -> dict[str, Any]:
    path = [n.id for n in session.path(node_id)]
    return {
        "trajectory_id": tid,
        "node_id": node_id,
        "parent": session.nodes[node_id].parent,
        "path_node_ids": path,
        "dead": dead,
    }
