"""The shape of a TITO session snapshot (GET /tito/sessions/{sid}, docs/compat.md section 10).

One definition for both sides: the store's snapshot export produces it and build_training_arrays reads it.
Standard library only, so that training code can import it without the gateway's dependencies.
"""

from __future__ import annotations

from enum import StrEnum
from typing import NotRequired, TypedDict

TrajectoryId = int | str  # the gateway writes ints; other producers, and JSON keys, may give strings


class MismatchType(StrEnum):
    """Why a turn's prompt ids may differ from a full tokenization of its render (a record's mismatch_report)."""

    TEMPLATE_NOT_PREFIX_STABLE = "template_not_prefix_stable"  # the turn was tokenized whole, as a new root
    LENGTH_MISMATCH = "length_mismatch"  # debug validator: the incremental prompt has another length
    TOKEN_MISMATCH = "token_mismatch"  # debug validator: the incremental prompt has another token


class Mismatch(TypedDict):
    mismatch_type: str  # a MismatchType value
    position: int  # the first token position that differs
    detail: str


class RoutedExperts(TypedDict):
    """A turn's MoE routing: rows [n, num_layers, top_k] for positions prompt_start.. of the full sequence."""

    data: str  # base64 of a .npy file
    num_layers: NotRequired[int]
    top_k: NotRequired[int]
    dtype: NotRequired[str]  # a numpy dtype name
    prompt_start: NotRequired[int]  # 0 when absent


class TurnRecord(TypedDict):
    """One sampled turn of a trajectory, in order."""

    prompt_token_count: int  # the turn's prompt is accumulated_token_ids[:prompt_token_count]
    output_logprobs: list[list[float]] | None  # [[logprob, token_id], ...]; None: no logprobs returned
    finish_reason: str | None
    mismatch_report: list[Mismatch]
    routed_experts: RoutedExperts | None
    weight_version: int | None
    output_token_versions: list[int | None] | None  # per output token; None: weight_version for all


class SnapshotTrajectory(TypedDict):
    """One exported branch: the token ids of its whole conversation and a record per turn, root to leaf."""

    trajectory_id: TrajectoryId
    accumulated_token_ids: list[int]
    records: list[TurnRecord]
    # The gateway always writes these two; snapshots from before branches were exported lack them.
    final: NotRequired[bool]  # the trajectory's current history (False: a branch it left behind)
    path_node_ids: NotRequired[list[int]]  # the tree node of each record


class TreeNode(TypedDict):
    id: int
    hash: str  # chain hash of the messages the turn was prompted with
    parent: int | None
    finish_reason: str | None
    truncated: bool  # finish_reason == "length"
    num_tokens: int  # prompt and output
    trajectory_ids: list[int]  # the exported trajectories whose branches hold the node


class TreeLeaf(TypedDict):
    trajectory_id: int
    node_id: int
    parent: int | None
    path_node_ids: list[int]
    dead: bool  # left behind by a history rewrite


class SessionTree(TypedDict):
    nodes: list[TreeNode]
    leaves: list[TreeLeaf]


class HeaderInfo(TypedDict):
    base_worker_id: str
    target_dp_rank: str


class Snapshot(TypedDict):
    session_id: str
    max_trim_tokens: int  # the gateway's limit, build_training_arrays' default
    trajectories: list[SnapshotTrajectory]
    turns_not_exported: int  # sampled turns of the session in no exported branch
    tree: SessionTree
    header_info: NotRequired[HeaderInfo]  # the router's: the instance that served the session last
