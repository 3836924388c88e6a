"""The export of a TITO session: every branch of its tree that holds sampled turns, as training data reads it."""

from __future__ import annotations

from psrl.tito.schema import Snapshot, SnapshotTrajectory, TreeLeaf, TreeNode, TurnRecord
from psrl.tito.tree import Node, Session, ids_of


def export(session: Session, max_trim_tokens: int) -> Snapshot:
    """The GET /tito/sessions/{sid} body (docs/compat.md section 10), with every branch that holds sampled turns.

    `trajectories` has, per trajectory id (ascending), its final history first (`final: true`: the path to
    the turn it recorded last, what the agent's conversation is now), then each other branch it left
    behind (`final: false`, a history rewrite, or an agent that dropped its reply), oldest first; a branch
    that another exported one continues is not listed again. `path_node_ids` are a branch's tree nodes,
    one per record. `turns_not_exported` counts this session's sampled turns no branch holds any more.

    Marks the exported turns as snapshotted; the caller holds the session's lock.
    """
    branches: list[tuple[int, int | None, bool]] = []  # (trajectory id, leaf, final)
    paths: dict[int | None, list[Node]] = {}
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
        (tid, leaf, final) for tid, leaf, final in branches if final or (leaf not in continued and leaf not in finals)
    ]

    trajectories: list[SnapshotTrajectory] = []
    through: dict[int, list[int]] = {}
    newly_snapshotted = 0
    for tid, leaf, final in exported:
        path = paths[leaf]
        trajectories.append(
            {
                "trajectory_id": tid,
                "accumulated_token_ids": ids_of(path),
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
    leaves: list[TreeLeaf] = []
    for tid in sorted(session.trajectories):
        traj = session.trajectories[tid]
        if traj.leaf is not None:
            leaves.append(_leaf(session, tid, traj.leaf, dead=False))
        leaves += [_leaf(session, tid, d, dead=True) for d in traj.dead_leaves]
    nodes: list[TreeNode] = [
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
        "session_id": session.id,
        "max_trim_tokens": max_trim_tokens,
        "trajectories": trajectories,
        "turns_not_exported": session.turns_not_exported,
        "tree": {"nodes": nodes, "leaves": leaves},
    }


def _record(node: Node) -> TurnRecord:
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


def _leaf(session: Session, tid: int, node_id: int, *, dead: bool) -> TreeLeaf:
    path = [n.id for n in session.path(node_id)]
    return {
        "trajectory_id": tid,
        "node_id": node_id,
        "parent": session.nodes[node_id].parent,
        "path_node_ids": path,
        "dead": dead,
    }
