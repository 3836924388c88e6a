"""psrl.tito.build_training_arrays against PSRL's `build_training_data` (its steps 1-8)."""

from __future__ import annotations

import base64
import io
import logging
import random
from typing import Any

import numpy as np
import pytest

from psrl.tito import TrainingDataError, TrimTooLarge, build_all_training_arrays, build_training_arrays

PROMPT = [1, 2, 3]


def record(
    prompt_len: int,
    out: list[int] | None,
    *,
    lps: list[float] | None = None,
    finish_reason: str = "stop",
    **extra: Any,
) -> dict[str, Any]:
    """A TITO record; logprobs default to -0.1, -0.2, ... so each token's logprob is recognisable."""
    pairs = None
    if out is not None:
        lps = lps if lps is not None else [-(j + 1) / 10 for j in range(len(out))]
        pairs = [[lp, tok] for lp, tok in zip(lps, out)]
    return {
        "prompt_token_count": prompt_len,
        "output_logprobs": pairs,
        "finish_reason": finish_reason,
        "mismatch_report": [],
        **extra,
    }


def trajectory(acc: list[int], records: list[dict[str, Any]], tid: int | str = 0) -> dict[str, Any]:
    return {"trajectory_id": tid, "accumulated_token_ids": acc, "records": records}


def snapshot(*trajectories: dict[str, Any], max_trim_tokens: int = 0) -> dict[str, Any]:
    return {"session_id": "s1", "max_trim_tokens": max_trim_tokens, "trajectories": list(trajectories)}


def experts_blob(array: np.ndarray, prompt_start: int) -> dict[str, Any]:
    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=False)
    return {
        "data": base64.b64encode(buf.getvalue()).decode(),
        "num_layers": array.shape[1],
        "top_k": array.shape[2],
        "dtype": str(array.dtype),
        "prompt_start": prompt_start,
    }


def two_turns(first_out: list[int], acc_tail: list[int], last_out: list[int], **kw: Any) -> dict[str, Any]:
    """Prompt, turn 0 emitting `first_out`, then `acc_tail` as stored in acc (re-rendered output + env),
    then the last turn emitting `last_out`."""
    acc = PROMPT + acc_tail + last_out
    return trajectory(acc, [record(3, first_out), record(3 + len(acc_tail), last_out)], **kw)


# --- steps 1, 2, 5, 6 ----------------------------------------------------------------------------------------


def test_no_records_gives_empty_arrays() -> None:
    arrays = build_training_arrays(trajectory([1, 2, 3], []))
    assert arrays.num_turns == 0
    assert arrays.routed_experts is None
    assert arrays.finish_reason is None
    for field in (arrays.prompt_ids, arrays.response_ids, arrays.response_mask, arrays.rollout_logprobs):
        assert field.size == 0
    assert arrays.token_versions.size == 0


def test_env_tokens_between_turns_are_masked_out() -> None:
    arrays = build_training_arrays(two_turns([10, 11], [10, 11, 20, 21], [12, 13, 14]))
    assert arrays.prompt_ids.tolist() == PROMPT
    assert arrays.response_ids.tolist() == [10, 11, 20, 21, 12, 13, 14]
    assert arrays.response_mask.tolist() == [1, 1, 0, 0, 1, 1, 1]
    np.testing.assert_allclose(arrays.rollout_logprobs, [-0.1, -0.2, 0, 0, -0.1, -0.2, -0.3], rtol=1e-6)
    assert arrays.num_turns == 2
    assert arrays.prompt_ids.dtype == np.int64 and arrays.response_ids.dtype == np.int64
    assert arrays.response_mask.dtype in (np.int8, np.uint8)
    assert arrays.rollout_logprobs.dtype == np.float32


def test_tokens_after_the_last_output_are_ignored_and_finish_reason_is_the_last() -> None:
    traj = trajectory(
        [*PROMPT, 10, 30, 31, 7, 7],
        [record(3, [10], finish_reason="tool_calls"), record(4, [30, 31], finish_reason="length")],
        tid=5,
    )
    arrays = build_training_arrays(traj)
    assert arrays.response_ids.tolist() == [10, 30, 31]
    assert arrays.finish_reason == "length"
    assert arrays.trajectory_id == 5


def test_prompt_override_replaces_prompt_only() -> None:
    traj = two_turns([10], [10, 20], [12])
    traj["records"][0]["routed_experts"] = experts_blob(np.ones((5, 1, 1), np.uint8), 0)
    arrays = build_training_arrays(traj, prompt_ids_override=[7, 8])
    assert arrays.prompt_ids.tolist() == [7, 8]
    assert arrays.response_ids.tolist() == [10, 20, 12]
    assert arrays.routed_experts is not None
    assert arrays.routed_experts.shape == (2 + 3 - 1, 1, 1)


# --- steps 3, 4 ------------------------------------------------------------------------------------------------


def test_trim_within_max_trim_tokens_drops_the_rerendered_tail() -> None:
    # Turn 0 sampled [10, 11, 99]; the next prompt re-renders 99 as 50.
    traj = two_turns([10, 11, 99], [10, 11, 50, 20], [12], tid=0)
    arrays = build_training_arrays(snapshot(traj, max_trim_tokens=1))
    assert arrays.response_ids.tolist() == [10, 11, 50, 20, 12]
    assert arrays.response_mask.tolist() == [1, 1, 0, 0, 1]
    np.testing.assert_allclose(arrays.rollout_logprobs, [-0.1, -0.2, 0, 0, -0.1], rtol=1e-6)


def test_trim_overflow_is_clamped_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    traj = two_turns([10, 11, 98, 99], [10, 11, 50, 51, 20], [12])
    with caplog.at_level(logging.WARNING, logger="psrl.tito.training"):
        arrays = build_training_arrays(snapshot(traj, max_trim_tokens=1))
    assert "max_trim_tokens=1" in caplog.text
    # Only one token trimmed: 98 stays, and the cursor moves past it (acc[6:8] = [51, 20] are env).
    assert arrays.response_ids.tolist() == [10, 11, 98, 51, 20, 12]
    assert arrays.response_mask.tolist() == [1, 1, 1, 0, 0, 1]


def test_strict_raises_on_a_trim_over_the_limit(caplog: pytest.LogCaptureFixture) -> None:
    snap = snapshot(two_turns([10, 11, 98, 99], [10, 11, 50, 51, 20], [12]), max_trim_tokens=1)
    with caplog.at_level(logging.WARNING, logger="psrl.tito.training"):
        with pytest.raises(TrimTooLarge, match=r"turn 0: 2 output tokens .* max_trim_tokens=1"):
            build_training_arrays(snap, strict=True)
        with pytest.raises(TrainingDataError):
            build_all_training_arrays(snap, strict=True)
    assert not caplog.records  # raised instead of warning
    # Within the limit, strict builds what the default builds.
    lenient = build_training_arrays(snap, max_trim_tokens=2)
    strict = build_training_arrays(snap, max_trim_tokens=2, strict=True)
    assert strict.response_ids.tolist() == lenient.response_ids.tolist() == [10, 11, 50, 51, 20, 12]


def test_max_trim_tokens_defaults_to_snapshot_and_can_be_overridden(caplog: pytest.LogCaptureFixture) -> None:
    snap = snapshot(two_turns([10, 99], [10, 50], [12]), max_trim_tokens=1)
    with caplog.at_level(logging.WARNING, logger="psrl.tito.training"):
        assert build_training_arrays(snap).response_ids.tolist() == [10, 50, 12]
        assert not caplog.records
        assert build_training_arrays(snap, max_trim_tokens=0).response_ids.tolist() == [10, 99, 12]
        assert caplog.records
    # A bare trajectory has no snapshot value: 0.
    assert build_training_arrays(snap["trajectories"][0]).response_ids.tolist() == [10, 99, 12]


def test_last_turn_is_never_trimmed() -> None:
    acc = [*PROMPT, 10, 20, 30]  # the last turn sampled [30, 31, 32] but acc holds only 30
    traj = trajectory(acc, [record(3, [10]), record(5, [30, 31, 32])])
    arrays = build_training_arrays(snapshot(traj, max_trim_tokens=5))
    assert arrays.response_ids.tolist() == [10, 20, 30, 31, 32]
    assert arrays.response_mask.tolist() == [1, 0, 1, 1, 1]


def test_missing_logprobs_for_a_turn_that_owns_tokens_raises() -> None:
    traj = trajectory([*PROMPT, 10, 11, 20, 12], [record(3, None), record(6, [12])])
    with pytest.raises(TrainingDataError, match="carries no output_logprobs"):
        build_training_arrays(traj)
    # The last turn owns acc[prompt_len:] too.
    with pytest.raises(ValueError, match="carries no output_logprobs"):
        build_training_arrays(trajectory([*PROMPT, 10], [record(3, None)]))


def test_zero_token_turns_with_null_logprobs() -> None:
    # Middle turn: next prompt starts where it started. Last turn: acc ends at its prompt.
    traj = trajectory([*PROMPT, 10, 20, 21], [record(3, [10]), record(4, [], lps=[]), record(6, None)])
    traj["records"].insert(2, record(6, None))
    arrays = build_training_arrays(traj)
    assert arrays.num_turns == 4
    assert arrays.response_ids.tolist() == [10, 20, 21]
    assert arrays.response_mask.tolist() == [1, 0, 0]


# --- step 7 ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16])
def test_routed_experts_assembly(dtype: type[np.integer[Any]]) -> None:
    # prompt 3 + response 6 -> 8 rows (every input position but the last token).
    traj = two_turns([10, 11], [10, 11, 20], [12, 13, 14])
    layers, top_k = 2, 3
    first = np.arange(5 * layers * top_k, dtype=dtype).reshape(5, layers, top_k) + 1
    second = np.full((5, layers, top_k), 300 if dtype == np.uint16 else 200, dtype=dtype)
    traj["records"][0]["routed_experts"] = experts_blob(first, prompt_start=0)
    traj["records"][1]["routed_experts"] = experts_blob(second, prompt_start=6)  # rows 6..10, clipped to 6..7
    experts = build_training_arrays(traj).routed_experts
    assert experts is not None
    assert experts.shape == (8, layers, top_k)
    assert experts.dtype == dtype
    np.testing.assert_array_equal(experts[:5], first)
    assert not experts[5].any()  # no blob covers row 5
    np.testing.assert_array_equal(experts[6:], second[:2])


def test_routed_experts_none_without_blobs_and_null_blobs_skipped() -> None:
    traj = two_turns([10], [10, 20], [12])
    assert build_training_arrays(traj).routed_experts is None
    traj["records"][0]["routed_experts"] = None
    traj["records"][1]["routed_experts"] = experts_blob(np.full((2, 1, 2), 4, np.uint8), prompt_start=3)
    experts = build_training_arrays(traj).routed_experts
    assert experts is not None
    assert experts[:, 0, 0].tolist() == [0, 0, 0, 4, 4]


def test_routed_experts_rejects_inconsistent_blobs() -> None:
    traj = two_turns([10], [10, 20], [12])
    traj["records"][0]["routed_experts"] = experts_blob(np.zeros((2, 1, 2), np.uint8), 0)
    traj["records"][1]["routed_experts"] = experts_blob(np.zeros((2, 2, 2), np.uint8), 3)
    with pytest.raises(TrainingDataError, match="does not match"):
        build_training_arrays(traj)
    traj["records"][1]["routed_experts"] = {"data": "not base64!", "prompt_start": 0}
    with pytest.raises(TrainingDataError, match="base64"):
        build_training_arrays(traj)


# --- token versions ----------------------------------------------------------------------------------------------


def test_token_versions_per_token_and_weight_version_fallback() -> None:
    traj = trajectory(
        [*PROMPT, 10, 11, 50, 20, 12, 13, 30],
        [
            record(3, [10, 11, 99], output_token_versions=[4, 5, 5], weight_version=9),
            record(7, [12, 13], weight_version=6),
            record(9, [30, 31]),
        ],
    )
    arrays = build_training_arrays(snapshot(traj, max_trim_tokens=1))
    assert arrays.response_ids.tolist() == [10, 11, 50, 20, 12, 13, 30, 31]
    # per-token versions trimmed with their tokens; env tokens -1; the fallback; unknown -> -1.
    assert arrays.token_versions.tolist() == [4, 5, -1, -1, 6, 6, -1, -1]
    assert arrays.token_versions.dtype == np.int64


def test_token_versions_length_mismatch_raises() -> None:
    traj = trajectory([*PROMPT, 10, 11], [record(3, [10, 11], output_token_versions=[1])])
    with pytest.raises(TrainingDataError, match="output_token_versions"):
        build_training_arrays(traj)


# --- property: 25 random turns --------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(20))
def test_lockstep_over_random_turns(seed: int) -> None:
    rng = random.Random(seed)
    max_trim = rng.randint(0, 2)
    acc = [rng.randrange(1000) for _ in range(rng.randint(1, 5))]
    prompt_len0 = len(acc)
    records: list[dict[str, Any]] = []
    expected_ids: list[int] = []
    expected_lps: list[float] = []
    num_turns = 25
    for turn in range(num_turns):
        prompt_len = len(acc)
        out = [rng.randrange(1000) for _ in range(rng.randint(0, 6))]
        env = [rng.randrange(1000) for _ in range(rng.randint(0, 4))]
        lps = [-rng.random() for _ in out]
        last = turn == num_turns - 1
        if last:
            acc += out + [rng.randrange(1000) for _ in range(rng.randint(0, 2))]  # trailing tokens are ignored
            kept = len(out)
        else:
            trim = rng.randint(0, min(len(out), max_trim))
            kept = len(out) - trim
            rerendered = [1000 + rng.randrange(1000) for _ in range(trim)]  # never equal to a sampled token
            acc += out[:kept] + rerendered + env
        expected_ids += out[:kept]
        expected_lps += lps[:kept]
        next_prompt_len = len(acc)  # the next record's prompt, or len(acc) for the last turn
        pairs_none = next_prompt_len == prompt_len and rng.random() < 0.5
        records.append(record(prompt_len, None if pairs_none else out, lps=lps, weight_version=turn))

    arrays = build_training_arrays(snapshot(trajectory(acc, records), max_trim_tokens=max_trim))
    r = arrays.response_ids.size
    assert arrays.response_mask.size == arrays.rollout_logprobs.size == arrays.token_versions.size == r
    assert arrays.num_turns == num_turns
    sampled = arrays.response_mask == 1
    assert arrays.response_ids[sampled].tolist() == expected_ids
    np.testing.assert_allclose(arrays.rollout_logprobs[sampled], np.float32(expected_lps), rtol=1e-6)
    assert not arrays.rollout_logprobs[~sampled].any()
    assert (arrays.token_versions[~sampled] == -1).all()
    assert (arrays.token_versions[sampled] >= 0).all()
    # With every overflow within max_trim, prompt + response is acc up to the end of the last output.
    full = np.concatenate([arrays.prompt_ids, arrays.response_ids]).tolist()
    assert arrays.prompt_ids.size == prompt_len0
    assert full == acc[: len(full)]


# --- input shapes ----------------------------------------------------------------------------------------------


def test_several_trajectories_selection() -> None:
    t2 = trajectory([*PROMPT, 10], [record(3, [10])], tid=2)
    t1 = trajectory([*PROMPT, 11, 12], [record(3, [11, 12])], tid=1)
    snap = snapshot(t2, t1)
    assert build_training_arrays(snap, trajectory_id=1).response_ids.tolist() == [11, 12]
    assert build_training_arrays(snap, trajectory_id="2").response_ids.tolist() == [10]
    with pytest.raises(TrainingDataError, match=r"\[2, 1\]"):
        build_training_arrays(snap)
    with pytest.raises(TrainingDataError, match="not in snapshot"):
        build_training_arrays(snap, trajectory_id=3)
    assert [a.trajectory_id for a in build_all_training_arrays(snap)] == [1, 2]
    # One trajectory: no id needed.
    assert build_training_arrays(snapshot(t1)).trajectory_id == 1


def test_branches_each_build_a_sample_and_the_final_one_is_the_trajectorys() -> None:
    # Trajectory 0's final history (nodes 0, 2), the branch it left behind (node 1), and trajectory 1.
    final = {**trajectory([*PROMPT, 10, 4, 12], [record(3, [10]), record(5, [12])]), "final": True}
    final["path_node_ids"] = [0, 2]
    left = {**trajectory([*PROMPT, 11], [record(3, [11])]), "final": False, "path_node_ids": [1]}
    other = {**trajectory([*PROMPT, 13], [record(3, [13])], tid=1), "final": True, "path_node_ids": [3]}
    snap = snapshot(final, left, other)
    every = build_all_training_arrays(snap)
    assert [(a.trajectory_id, a.final, a.path_node_ids, a.num_turns) for a in every] == [
        (0, True, (0, 2), 2),
        (0, False, (1,), 1),
        (1, True, (3,), 1),
    ]
    assert every[1].response_ids.tolist() == [11] and every[1].records == tuple(left["records"])
    assert [a.path_node_ids for a in build_all_training_arrays(snap, final_only=True)] == [(0, 2), (3,)]
    # One sample per trajectory id picks its final history; a left-behind branch builds from its entry.
    assert build_training_arrays(snap, trajectory_id=0).path_node_ids == (0, 2)
    assert build_training_arrays(snapshot(final, left)).response_ids.tolist() == [10, 4, 12]
    assert build_training_arrays(left).response_ids.tolist() == [11]
    with pytest.raises(TrainingDataError, match="build_all_training_arrays"):
        build_training_arrays(snap)
    # An entry without `final` (a snapshot from before branches were exported) is its trajectory's history.
    assert build_training_arrays(snapshot(trajectory([*PROMPT, 11], [record(3, [11])]))).final


def test_legacy_flat_snapshot_is_rejected() -> None:
    flat = {"session_id": "s1", "accumulated_token_ids": [*PROMPT, 10], "records": [record(3, [10])]}
    with pytest.raises(TrainingDataError, match="trajectories"):
        build_training_arrays(flat)
    with pytest.raises(TrainingDataError, match="trajectories"):
        build_all_training_arrays(flat)


def test_malformed_records_raise_typed_errors() -> None:
    assert issubclass(TrainingDataError, ValueError)
    with pytest.raises(TrainingDataError, match="prompt_token_count"):
        build_training_arrays(trajectory([1, 2], [record(5, [])]))
    with pytest.raises(TrainingDataError, match=r"\[\[logprob, token_id\]"):
        build_training_arrays(trajectory([1, 2, 3], [{"prompt_token_count": 2, "output_logprobs": [[-0.1]]}]))
