"""Training arrays (prompt, response, mask, logprobs, versions, routed experts) built from a TITO session snapshot.

PSRL's `build_training_data` in eight steps (numbered in `_build`; docs/tito.md, Training arrays); pure
logic, no I/O.
"""

from __future__ import annotations

import base64
import binascii
import io
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeGuard, cast

import numpy as np

from psrl.tito.schema import Snapshot, SnapshotTrajectory, TrajectoryId, TurnRecord

logger = logging.getLogger(__name__)

# Version recorded for tokens the model did not sample, or whose weight version nobody reported.
UNKNOWN_VERSION = -1


class TrainingDataError(ValueError):
    """A snapshot (or trajectory) that cannot be turned into training arrays."""

    code = "tito_training_data"


class TrimTooLarge(TrainingDataError):
    """strict=True: a turn's output differs from the next prompt in more than max_trim_tokens trailing tokens."""

    code = "tito_trim_too_large"


@dataclass(frozen=True, eq=False)
class TrainingArrays:
    """One trajectory's training data. The response arrays are aligned token for token.

    `response_mask` is 1 where the model sampled the token and 0 for environment/user/tool tokens;
    `rollout_logprobs` is 0.0 and `token_versions` is -1 where the mask is 0. `routed_experts` has one
    row per input position of the full sequence (len(prompt) + len(response) - 1 rows) or is None when
    no record carried any.
    """

    prompt_ids: np.ndarray  # int64 [P]
    response_ids: np.ndarray  # int64 [R]
    response_mask: np.ndarray  # uint8 [R]
    rollout_logprobs: np.ndarray  # float32 [R]
    num_turns: int
    token_versions: np.ndarray  # int64 [R]
    routed_experts: np.ndarray | None  # [P + R - 1, L, K], the first blob's dtype
    trajectory_id: TrajectoryId | None = None
    finish_reason: str | None = None
    # The branch this sample was built from: whether it is its trajectory's final history (the snapshot's
    # `final`; True for a snapshot or trajectory that does not say), its tree nodes (one per turn) and the
    # snapshot's records of its turns, root to leaf.
    final: bool = True
    path_node_ids: tuple[int, ...] = ()
    records: tuple[TurnRecord, ...] = ()


def build_training_arrays(
    snapshot_or_trajectory: Snapshot | SnapshotTrajectory,
    *,
    trajectory_id: TrajectoryId | None = None,
    max_trim_tokens: int | None = None,
    prompt_ids_override: Sequence[int] | None = None,
    strict: bool = False,
) -> TrainingArrays:
    """Build one trajectory's arrays from a GET /tito/sessions/{sid} snapshot or from one of its trajectories.

    With a snapshot, `trajectory_id` picks the trajectory's final history (the entry marked `final`; the other
    branches it left behind are built by build_all_training_arrays, or by passing one entry of `trajectories`);
    it may be omitted when the snapshot has exactly one trajectory id. `max_trim_tokens` defaults to the
    snapshot's own value (0 when absent, and for a bare trajectory). A turn whose output differs from the next
    prompt in more trailing tokens than that is trimmed by max_trim_tokens only, with a warning; with `strict`,
    it raises TrimTooLarge instead.
    """
    if _is_snapshot(snapshot_or_trajectory):
        trajectories = _trajectories(snapshot_or_trajectory)
        trajectory = _select_trajectory(trajectories, trajectory_id)
        default_trim = snapshot_or_trajectory.get("max_trim_tokens") or 0
    else:
        trajectory = _check_trajectory(snapshot_or_trajectory)
        if trajectory_id is not None and not _same_id(trajectory.get("trajectory_id"), trajectory_id):
            raise TrainingDataError(
                f"trajectory_id {trajectory_id!r} requested, but the trajectory given is "
                f"{trajectory.get('trajectory_id')!r}"
            )
        default_trim = 0
    return _build(
        trajectory,
        max_trim_tokens=default_trim if max_trim_tokens is None else max_trim_tokens,
        prompt_ids_override=prompt_ids_override,
        strict=strict,
    )


def build_all_training_arrays(
    snapshot: Snapshot, *, max_trim_tokens: int | None = None, final_only: bool = False, strict: bool = False
) -> list[TrainingArrays]:
    """Build one sample per exported branch of a snapshot: every sampled turn of the session is in one of them.

    Sorted by trajectory id; within one, its final history first, then the branches it left behind (history
    rewrites, an agent that dropped its reply), in the snapshot's order. `final_only`: only the final histories.
    `max_trim_tokens` and `strict` as for build_training_arrays.
    """
    if not _is_snapshot(snapshot):
        raise TrainingDataError("build_all_training_arrays needs a session snapshot with `trajectories`")
    trim = (snapshot.get("max_trim_tokens") or 0) if max_trim_tokens is None else max_trim_tokens
    trajectories = sorted(_trajectories(snapshot), key=lambda t: _id_sort_key(t.get("trajectory_id")))
    if final_only:
        trajectories = [t for t in trajectories if _is_final(t)]
    return [_build(t, max_trim_tokens=trim, prompt_ids_override=None, strict=strict) for t in trajectories]


# --- input shape -------------------------------------------------------------------------------------------


def _is_snapshot(obj: Snapshot | SnapshotTrajectory) -> TypeGuard[Snapshot]:
    if not isinstance(obj, Mapping):
        raise TrainingDataError(f"expected a snapshot or trajectory dict, got {type(obj).__name__}")
    if "trajectories" in obj:
        return True
    if "session_id" in obj:
        # The older flat shape kept records at the top level; it cannot say which trajectory they belong to.
        raise TrainingDataError(
            "flat TITO snapshot without `trajectories` (legacy shape with top-level records) is not supported; "
            "fetch GET /tito/sessions/{sid} from a gateway that returns per-trajectory records"
        )
    return False


def _check_trajectory(trajectory: object) -> SnapshotTrajectory:
    if not isinstance(trajectory, Mapping) or "records" not in trajectory or "accumulated_token_ids" not in trajectory:
        raise TrainingDataError(
            "expected a trajectory dict with `accumulated_token_ids` and `records` (or a snapshot with `trajectories`)"
        )
    return cast(SnapshotTrajectory, trajectory)


def _trajectories(snapshot: Snapshot) -> list[SnapshotTrajectory]:
    trajectories = snapshot["trajectories"]
    if not isinstance(trajectories, list):
        raise TrainingDataError("snapshot `trajectories` must be a list")
    for trajectory in trajectories:
        _check_trajectory(trajectory)
    return trajectories


def _is_final(trajectory: SnapshotTrajectory) -> bool:
    # Snapshots from before branches were exported have no `final`: each entry is its trajectory's history.
    return trajectory.get("final", True) is not False


def _select_trajectory(
    trajectories: list[SnapshotTrajectory], trajectory_id: TrajectoryId | None
) -> SnapshotTrajectory:
    finals = [t for t in trajectories if _is_final(t)]
    ids = [t.get("trajectory_id") for t in finals]
    if trajectory_id is None:
        if len(finals) == 1:
            return finals[0]
        if not finals:
            raise TrainingDataError("snapshot has no trajectories")
        raise TrainingDataError(
            f"snapshot has {len(finals)} trajectories {ids}; pass trajectory_id (or build all of them, every "
            "branch included, with build_all_training_arrays)"
        )
    for trajectory, tid in zip(finals, ids):
        if _same_id(tid, trajectory_id):
            return trajectory
    raise TrainingDataError(f"trajectory_id {trajectory_id!r} not in snapshot (has {ids})")


def _same_id(a: Any, b: Any) -> bool:
    # Ids arrive as JSON ints or strings; callers may hold either form.
    return a == b or str(a) == str(b)


def _id_sort_key(tid: Any) -> tuple[int, int, str]:
    if isinstance(tid, int):
        return (0, tid, "")
    if isinstance(tid, str) and tid.lstrip("-").isdigit():
        return (0, int(tid), tid)
    return (1, 0, str(tid))


# --- the build (steps 1-8) --------------------------------------------------------------------------------


def _build(
    trajectory: SnapshotTrajectory, *, max_trim_tokens: int, prompt_ids_override: Sequence[int] | None, strict: bool
) -> TrainingArrays:
    if isinstance(max_trim_tokens, bool) or not isinstance(max_trim_tokens, int) or max_trim_tokens < 0:
        raise TrainingDataError(f"max_trim_tokens must be a non-negative int, got {max_trim_tokens!r}")
    tid = trajectory.get("trajectory_id")
    acc = list(trajectory["accumulated_token_ids"])
    records = trajectory["records"]
    if not isinstance(records, list):
        raise TrainingDataError(f"trajectory {tid!r}: `records` must be a list")

    final = _is_final(trajectory)
    path_node_ids = tuple(trajectory.get("path_node_ids") or ())

    # Step 1.
    if not records:
        return TrainingArrays(
            prompt_ids=np.zeros(0, np.int64),
            response_ids=np.zeros(0, np.int64),
            response_mask=np.zeros(0, np.uint8),
            rollout_logprobs=np.zeros(0, np.float32),
            num_turns=0,
            token_versions=np.zeros(0, np.int64),
            routed_experts=None,
            trajectory_id=tid,
            finish_reason=None,
            final=final,
            path_node_ids=path_node_ids,
            records=tuple(records),
        )

    prompt_lens = [_prompt_len(r, i, len(acc), tid) for i, r in enumerate(records)]
    ids: list[int] = []
    mask: list[int] = []
    logprobs: list[float] = []
    versions: list[int] = []
    cursor = 0
    last = len(records) - 1
    for i, record in enumerate(records):
        prompt_len = prompt_lens[i]
        # Step 2: tokens between the previous output and this prompt's end came from the environment.
        if cursor > 0 and prompt_len > cursor:
            env = acc[cursor:prompt_len]
            ids.extend(env)
            mask.extend([0] * len(env))
            logprobs.extend([0.0] * len(env))
            versions.extend([UNKNOWN_VERSION] * len(env))

        # Step 3.
        turn_end = prompt_lens[i + 1] if i < last else len(acc)
        out_ids, out_lps, out_versions = _turn_output(record, i, tid, owns_tokens=turn_end > prompt_len)

        # Step 4: drop the tail the chat template re-rendered differently in the next prompt.
        if i < last and out_ids:
            trim = len(out_ids) - _matched_prefix(out_ids, acc, prompt_len)
            if trim > max_trim_tokens:
                if strict:
                    raise TrimTooLarge(
                        f"trajectory {tid!r} turn {i}: {trim} output tokens do not match the accumulated tokens, "
                        f"more than max_trim_tokens={max_trim_tokens}"
                    )
                logger.warning(
                    "TITO trajectory %r turn %d: %d output tokens do not match the accumulated tokens, more than "
                    "max_trim_tokens=%d; trimming only %d",
                    tid,
                    i,
                    trim,
                    max_trim_tokens,
                    max_trim_tokens,
                )
                trim = max_trim_tokens
            if trim:
                del out_ids[-trim:], out_lps[-trim:], out_versions[-trim:]

        # Step 5.
        ids.extend(out_ids)
        mask.extend([1] * len(out_ids))
        logprobs.extend(out_lps)
        versions.extend(out_versions)
        cursor = prompt_len + len(out_ids)

    # Step 8 (checked before building arrays so the message can name the lengths).
    lengths = {len(ids), len(mask), len(logprobs), len(versions)}
    if len(lengths) != 1:
        raise TrainingDataError(
            f"trajectory {tid!r}: response lists out of step: ids={len(ids)} mask={len(mask)} "
            f"logprobs={len(logprobs)} versions={len(versions)}"
        )

    # Step 6.
    prompt = list(prompt_ids_override) if prompt_ids_override is not None else acc[: prompt_lens[0]]

    return TrainingArrays(
        prompt_ids=np.asarray(prompt, dtype=np.int64),
        response_ids=np.asarray(ids, dtype=np.int64),
        response_mask=np.asarray(mask, dtype=np.uint8),
        rollout_logprobs=np.asarray(logprobs, dtype=np.float32),
        num_turns=len(records),
        token_versions=np.asarray(versions, dtype=np.int64),
        routed_experts=_assemble_routed_experts(records, len(prompt) + len(ids) - 1, tid),  # Step 7.
        trajectory_id=tid,
        finish_reason=records[-1].get("finish_reason"),
        final=final,
        path_node_ids=path_node_ids,
        records=tuple(records),
    )


def _prompt_len(record: Any, index: int, acc_len: int, tid: Any) -> int:
    if not isinstance(record, Mapping):
        raise TrainingDataError(f"trajectory {tid!r} record {index}: expected a dict, got {type(record).__name__}")
    prompt_len = record.get("prompt_token_count")
    if isinstance(prompt_len, bool) or not isinstance(prompt_len, int) or not 0 <= prompt_len <= acc_len:
        raise TrainingDataError(
            f"trajectory {tid!r} record {index}: prompt_token_count {prompt_len!r} is not in "
            f"[0, {acc_len}] (len(accumulated_token_ids))"
        )
    return prompt_len


def _turn_output(
    record: TurnRecord, index: int, tid: Any, *, owns_tokens: bool
) -> tuple[list[int], list[float], list[int]]:
    pairs = record.get("output_logprobs")
    if pairs is None:
        if owns_tokens:
            raise TrainingDataError(
                f"trajectory {tid!r} record {index} carries no output_logprobs but owns tokens in "
                "accumulated_token_ids; the gateway must return logprobs for every sampled turn"
            )
        return [], [], []  # a zero-token turn
    try:
        out_lps = [float(p[0]) for p in pairs]
        out_ids = [int(p[1]) for p in pairs]
    except (TypeError, ValueError, IndexError) as exc:
        raise TrainingDataError(
            f"trajectory {tid!r} record {index}: output_logprobs must be [[logprob, token_id], ...] ({exc})"
        ) from exc

    per_token = record.get("output_token_versions")
    if per_token is not None:
        if len(per_token) != len(out_ids):
            raise TrainingDataError(
                f"trajectory {tid!r} record {index}: output_token_versions has {len(per_token)} entries "
                f"for {len(out_ids)} output tokens"
            )
        out_versions = [UNKNOWN_VERSION if v is None else int(v) for v in per_token]
    else:
        version = record.get("weight_version")
        out_versions = [UNKNOWN_VERSION if version is None else int(version)] * len(out_ids)
    return out_ids, out_lps, out_versions


def _matched_prefix(out_ids: list[int], acc: list[int], prompt_len: int) -> int:
    """Length of the longest prefix of `out_ids` equal to acc[prompt_len:]."""
    window = acc[prompt_len : prompt_len + len(out_ids)]
    if window == out_ids:  # the common case, compared in C
        return len(out_ids)
    for j, (a, b) in enumerate(zip(window, out_ids)):
        if a != b:
            return j
    return len(window)


def _assemble_routed_experts(records: list[TurnRecord], rows: int, tid: Any) -> np.ndarray | None:
    out: np.ndarray | None = None
    for index, record in enumerate(records):
        blob = record.get("routed_experts")
        if blob is None:
            continue
        block, prompt_start = _decode_routed_experts(blob, index, tid)
        if out is None:
            out = np.zeros((max(rows, 0), *block.shape[1:]), dtype=block.dtype)
        elif block.shape[1:] != out.shape[1:]:
            raise TrainingDataError(
                f"trajectory {tid!r} record {index}: routed_experts shape {block.shape} does not match "
                f"[n, {out.shape[1]}, {out.shape[2]}] of the first blob"
            )
        stop = min(prompt_start + block.shape[0], out.shape[0])
        if stop > prompt_start:
            out[prompt_start:stop] = block[: stop - prompt_start]
    return out


def _decode_routed_experts(blob: Any, index: int, tid: Any) -> tuple[np.ndarray, int]:
    where = f"trajectory {tid!r} record {index}: routed_experts"
    if not isinstance(blob, Mapping) or "data" not in blob:
        raise TrainingDataError(f"{where} must be a dict with base64 `data`")
    try:
        block = np.load(io.BytesIO(base64.b64decode(blob["data"], validate=True)), allow_pickle=False)
    except (binascii.Error, ValueError, TypeError, OSError, EOFError) as exc:
        raise TrainingDataError(f"{where} `data` is not a base64 .npy file ({exc})") from exc
    if block.ndim != 3:
        raise TrainingDataError(f"{where} has shape {block.shape}, expected [n, num_layers, top_k]")
    declared = (blob.get("num_layers"), blob.get("top_k"))
    if any(d is not None and d != s for d, s in zip(declared, block.shape[1:])):
        raise TrainingDataError(f"{where} num_layers/top_k {declared} do not match the array shape {block.shape}")
    if blob.get("dtype") is not None:
        try:
            declared_dtype = np.dtype(blob["dtype"])
        except TypeError as exc:
            raise TrainingDataError(f"{where} dtype {blob['dtype']!r} is not a numpy dtype") from exc
        if declared_dtype != block.dtype:
            raise TrainingDataError(f"{where} declares dtype {declared_dtype} but holds {block.dtype}")
    prompt_start = blob.get("prompt_start", 0)
    if isinstance(prompt_start, bool) or not isinstance(prompt_start, int) or prompt_start < 0:
        raise TrainingDataError(f"{where} prompt_start {prompt_start!r} must be a non-negative int")
    return block, prompt_start
