"""A TITO session's tree of recorded turns, and the prepared turn that crosses to the router and back.

Data only: psrl.tito.matching reads it to match a new turn, psrl.tito.store changes it, psrl.tito.snapshot
exports it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from psrl.tito.schema import Mismatch, RoutedExperts


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
    draft: Draft = field(repr=False)
    mismatch_report: list[Mismatch] = field(default_factory=list)

    @property
    def new_tokens(self) -> int:
        return len(self.prompt_ids) - self.reused_tokens


@dataclass(frozen=True, eq=False)
class Draft:
    """What record_turn needs, besides the ids, to add a prepared turn to the tree.

    The prompt has `num_messages` messages. Its chain (see matching.chain_hashes) hashes the items [header, *messages];
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
class Node:
    """One recorded turn: the prompt ids it added after its parent's ids, and the ids the model sampled.

    It also keeps its part of the conversation (see Draft), so that the next turn can match the history
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
    mismatch_report: list[Mismatch]
    items: list[Any]  # Draft.items
    plain: list[bool]  # per item: matching.plain(item), so that `==` against it is an exact match
    hashes: list[str]  # Draft.hashes
    rendered_tail: str  # Draft.rendered_tail
    assistant: Any = None  # the normalized assistant message, when the router gave it
    routed_experts: RoutedExperts | None = None  # the record's MoE routing blob, when recorded
    assistant_plain: bool = False
    assistant_hash: str | None = None  # chain hash through the assistant message, when the router gave it
    # What a later turn's echo of the reply must match for this node to be its parent (see matching.reply_signature);
    # None: the router gave no assistant message, so any echo is taken as this reply.
    reply_signature: tuple[str, tuple[tuple[str, str], ...]] | None = None
    snapshotted: bool = False  # a snapshot has exported it
    unexported: bool = False  # dropped (drop_dead_leaves): in no branch any more, never a parent again


@dataclass(eq=False)
class Trajectory:
    id: int
    leaf: int | None = None
    dead_leaves: list[int] = field(default_factory=list)  # leaves left behind by history rewrites
    pending: PreparedTurn | None = None


@dataclass(eq=False)
class Session:
    """One session's tree. `lock` guards everything below it; the store's own lock guards `last_used` and
    `turns_in_flight` (what expiry reads)."""

    id: str
    nodes: dict[int, Node] = field(default_factory=dict)
    by_prompt_hash: dict[str, list[int]] = field(default_factory=dict)
    trajectories: dict[int, Trajectory] = field(default_factory=dict)
    next_node_id: int = 0
    turns_recorded: int = 0
    client: str | None = None  # who created it, for the per-client cap
    last_used: float = 0.0  # the store's clock at the last call that named the session (or a turn's end)
    turns_in_flight: int = 0  # being prepared, or prepared and neither recorded nor abandoned: cannot expire
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    unsnapshotted: int = 0  # exported turns no snapshot has included yet (what expiry loses)
    unreachable: int = 0  # nodes no leaf reaches any more (dropped branches): what GC frees
    turns_not_exported: int = 0  # sampled turns dropped from every exported branch (drop_dead_leaves)

    def path(self, node_id: int | None) -> list[Node]:
        """Nodes root -> node_id."""
        out: list[Node] = []
        while node_id is not None:
            node = self.nodes[node_id]
            out.append(node)
            node_id = node.parent
        out.reverse()
        return out


def ids_of(path: list[Node]) -> list[int]:
    """The token ids along a path: each turn's new prompt ids, then what it sampled."""
    ids: list[int] = []
    for node in path:
        ids += node.new_prompt_ids
        ids += node.output_ids
    return ids
