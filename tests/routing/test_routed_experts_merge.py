"""Routed experts through partial-rollout merges (pure bookkeeping): segments concatenate as prompt rows then
output rows, each looped-back request asks from where the rows so far end, and what cannot be aligned fails."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest

from psrl.router.errors import BadRequest
from psrl.router.pipeline.context import Generation, GenerationInput, RoutedExperts, SamplingSpec
from psrl.router.pipeline.parse import routed_experts_start
from psrl.router.pipeline.partial_rollout import RolloutState, RoutedExpertsMismatch

PROMPT = [5, 6, 7, 8, 9, 10]  # P = 6
L, K = 3, 2


def _rows(first: int, last: int) -> np.ndarray:
    """Rows for positions [first, last): each row holds its position (so a misplaced row shows)."""
    return np.stack([np.full((L, K), p, dtype=np.uint8) for p in range(first, last)]).reshape(-1, L, K)


def _segment(ids: list[int], finish: str, routed: RoutedExperts | None) -> Generation:
    return Generation(output_ids=ids, finish_reason=finish, routed_experts=routed)


def _state(start: int | None = 0, max_tokens: int = 20) -> RolloutState:
    gen = GenerationInput("r", PROMPT, SamplingSpec(max_tokens=max_tokens), routed_experts_start=start)
    return RolloutState(gen)


def test_segments_concatenate_prompt_rows_then_output_rows() -> None:
    state = _state(start=2)
    # Iteration 1: 3 tokens of the 6-token prompt: positions [2, 6 + 3 - 1) = [2, 8).
    state.add(_segment([1, 2, 3], "abort", RoutedExperts(_rows(2, 8), 2)), 0)
    loop = state.next_input()
    assert loop.prompt_ids == [*PROMPT, 1, 2, 3] and loop.routed_experts_start == 8  # its last prompt token on
    # A refused attempt (admission closed) produced nothing and adds nothing, whatever it carries.
    state.add(_segment([], "abort", None), 1)
    assert state.next_input().routed_experts_start == 8
    # Iteration 2: prompt of 9, 4 tokens: positions [8, 9 + 4 - 1) = [8, 12).
    state.add(_segment([4, 5, 6, 7], "stop", RoutedExperts(_rows(8, 12), 8)), 1)
    merged = state.merged(_segment([4, 5, 6, 7], "stop", None)).routed_experts
    assert merged is not None and merged.prompt_start == 2
    np.testing.assert_array_equal(merged.rows, _rows(2, 12))  # [start, P + R - 1) of all 7 tokens
    assert merged.rows.shape[0] == len(PROMPT) + 7 - 1 - 2


def test_not_asked_means_none_and_no_start_on_loop_backs() -> None:
    state = _state(start=None)
    state.add(_segment([1, 2], "abort", None), 0)
    assert state.next_input().routed_experts_start is None
    state.add(_segment([3], "length", None), 0)
    assert state.merged(_segment([3], "length", None)).routed_experts is None


def test_no_replica_had_them_means_none() -> None:
    state = _state()
    state.add(_segment([1, 2], "abort", None), 0)
    state.add(_segment([3], "length", None), 0)
    assert state.merged(_segment([3], "length", None)).routed_experts is None


@pytest.mark.parametrize(
    ("first", "second", "match"),
    [
        (RoutedExperts(_rows(0, 7), 0), None, "came without routed experts"),  # a missing segment
        (None, RoutedExperts(_rows(7, 9), 7), "iterations before came without"),  # a late first segment
        (RoutedExperts(_rows(0, 6), 0), None, "expected 7 from 0"),  # rows short of what it fed
        (RoutedExperts(_rows(1, 8), 1), None, "expected 7 from 0"),  # from another position
        (RoutedExperts(_rows(0, 7), 0), RoutedExperts(np.zeros((2, L, K + 1), np.uint8), 7), "shape"),
    ],
)
def test_what_cannot_be_aligned_fails_the_request(first, second, match: str) -> None:
    state = _state()
    with pytest.raises(RoutedExpertsMismatch, match=match) as err:
        state.add(_segment([1, 2], "abort", first), 0)
        state.add(_segment([3, 4], "stop", second), 0)
    assert err.value.status == 500 and err.value.code == "routed_experts_mismatch"


def test_the_b64_npy_and_the_tito_record() -> None:
    routed = RoutedExperts(_rows(3, 9), 3)
    back = np.load(io.BytesIO(base64.b64decode(routed.b64_npy())), allow_pickle=False)
    np.testing.assert_array_equal(back, routed.rows)
    record = routed.record()
    assert {k: v for k, v in record.items() if k != "data"} == {
        "num_layers": L,
        "top_k": K,
        "dtype": "uint8",
        "prompt_start": 3,
    }
    assert record["data"] == routed.b64_npy()


def test_the_generate_fields() -> None:
    assert routed_experts_start({}) is None
    assert routed_experts_start({"return_routed_experts": False, "routed_experts_start_len": 4}) is None
    assert routed_experts_start({"return_routed_experts": True}) == 0
    assert routed_experts_start({"return_routed_experts": True, "routed_experts_start_len": 4}) == 4
    for body in ({"return_routed_experts": "yes"}, {"return_routed_experts": True, "routed_experts_start_len": -1}):
        with pytest.raises(BadRequest):
            routed_experts_start(body)
