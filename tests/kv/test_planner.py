"""psrl.kv.planner: block copy plans, their validation, and a numpy migration through gather/scatter."""

from __future__ import annotations

import inspect

import numpy as np
import pytest

from psrl.kv.blocks import gather_blocks, scatter_blocks
from psrl.kv.planner import (
    BlockCopy,
    BlockSizeMismatch,
    NotEnoughBlocks,
    PlanError,
    TransferPlan,
    plan_transfer,
)


def test_full_and_partial_blocks() -> None:
    plan = plan_transfer([7, 3, 9], [0, 1, 2], num_tokens=40, block_size=16)
    assert plan.copies == (BlockCopy(7, 0, 16), BlockCopy(3, 1, 16), BlockCopy(9, 2, 8))
    assert list(plan.copies) == [(7, 0, 16), (3, 1, 16), (9, 2, 8)]  # plain (src, dst, num_tokens) tuples
    assert (plan.start, plan.end, plan.num_tokens, plan.num_blocks) == (0, 40, 40, 3)
    assert plan.src_block_ids == [7, 3, 9] and plan.dst_block_ids == [0, 1, 2]


def test_exact_multiple_has_no_partial_block() -> None:
    plan = plan_transfer([5, 6], [1, 2], num_tokens=32, block_size=16)
    assert plan.copies == (BlockCopy(5, 1, 16), BlockCopy(6, 2, 16))


def test_longer_tables_are_fine() -> None:
    plan = plan_transfer([5, 6, 7, 8], np.array([1, 2, 3, 4, 5, 6]), num_tokens=17, block_size=16)
    assert plan.copies == (BlockCopy(5, 1, 16), BlockCopy(6, 2, 1))


def test_start_skips_the_cached_prefix() -> None:
    plan = plan_transfer([10, 11, 12, 13], [20, 21, 22, 23], num_tokens=50, block_size=16, start=32)
    assert plan.copies == (BlockCopy(12, 22, 16), BlockCopy(13, 23, 2))
    assert (plan.first_block, plan.num_tokens) == (2, 18)


def test_empty_ranges() -> None:
    assert plan_transfer([], [], num_tokens=0, block_size=16) == TransferPlan((), 0, 0, 16)
    # Everything already on the destination: nothing moves.
    plan = plan_transfer([1, 2], [3, 4], num_tokens=32, block_size=16, start=32)
    assert plan.copies == () and plan.num_tokens == 0


def test_start_inside_the_last_partial_block_region() -> None:
    # start is block-aligned and below num_tokens; the last block is partial.
    plan = plan_transfer([1, 2, 3], [4, 5, 6], num_tokens=33, block_size=16, start=32)
    assert plan.copies == (BlockCopy(3, 6, 1),)


def test_not_enough_blocks() -> None:
    with pytest.raises(NotEnoughBlocks, match="source block table has 2 blocks") as info:
        plan_transfer([1, 2], [3, 4, 5], num_tokens=33, block_size=16)
    assert (info.value.side, info.value.needed, info.value.have) == ("source", 3, 2)
    with pytest.raises(NotEnoughBlocks, match="destination") as info:
        plan_transfer([1, 2, 3], [4, 5], num_tokens=33, block_size=16, start=16)
    assert (info.value.side, info.value.needed, info.value.have) == ("destination", 3, 2)


def test_block_size_mismatch() -> None:
    plan_transfer([1], [2], num_tokens=16, block_size=16, dst_block_size=16)
    with pytest.raises(BlockSizeMismatch, match="source 16, destination 32") as info:
        plan_transfer([1], [2], num_tokens=16, block_size=16, dst_block_size=32)
    assert (info.value.src_block_size, info.value.dst_block_size) == (16, 32)
    assert isinstance(info.value, PlanError) and isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"start": 8}, "not a multiple"),
        ({"start": 48}, "past num_tokens"),
        ({"start": -16}, "start"),
        ({"num_tokens": -1}, "num_tokens"),
        ({"num_tokens": 3.0}, "num_tokens"),
        ({"block_size": 0}, "block_size"),
        ({"block_size": True}, "block_size"),
        ({"dst_block_size": -1}, "dst_block_size"),
    ],
)
def test_invalid_arguments(kwargs: dict[str, object], match: str) -> None:
    args: dict[str, object] = {"num_tokens": 40, "block_size": 16, **kwargs}
    with pytest.raises(PlanError, match=match):
        plan_transfer([1, 2, 3], [4, 5, 6], **args)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("src", "dst", "match"), [([1, -2], [3, 4], "src_block_ids\\[1\\]"), ([1, 2], [3, 4.0], "dst")]
)
def test_invalid_block_ids(src: list[object], dst: list[object], match: str) -> None:
    with pytest.raises(PlanError, match=match):
        plan_transfer(src, dst, num_tokens=32, block_size=16)


def test_duplicate_destination_blocks() -> None:
    with pytest.raises(PlanError, match="destination block 4 appears twice"):
        plan_transfer([1, 2], [4, 4], num_tokens=32, block_size=16)
    # Outside the moved range a repeat does not matter (e.g. the destination's cached prefix).
    plan_transfer([1, 2, 3], [4, 4, 5], num_tokens=48, block_size=32, start=32)


def test_numpy_migration_round_trip() -> None:
    """Move a request's KV from a source cache to a destination that already holds a cached prefix."""
    rng = np.random.default_rng(0)
    num_layers, block_size, heads, head_size = 3, 4, 2, 8
    shape = (2, 12, block_size, heads, head_size)
    src = [rng.standard_normal(shape).astype(np.float16) for _ in range(num_layers)]
    dst = [np.zeros(shape, dtype=np.float16) for _ in range(num_layers)]
    src_table = [9, 2, 7, 4, 11]  # 18 tokens: 4 full blocks + 2 tokens
    dst_table = [5, 0, 3, 8, 1]
    num_tokens = 18

    def token_kv(caches: list[np.ndarray], table: list[int], t: int) -> np.ndarray:
        return np.stack([c[:, table[t // block_size], t % block_size] for c in caches])

    # The destination already has tokens [0, 8) (blocks 0 and 1 of its table) from its prefix cache.
    for t in range(8):
        for layer in range(num_layers):
            dst[layer][:, dst_table[t // block_size], t % block_size] = src[layer][
                :, src_table[t // block_size], t % block_size
            ]

    plan = plan_transfer(src_table, dst_table, num_tokens=num_tokens, block_size=block_size, start=8)
    assert plan.src_block_ids == [7, 4, 11] and plan.dst_block_ids == [3, 8, 1]
    assert plan.num_tokens == 10
    partial = "num_tokens" in inspect.signature(gather_blocks).parameters
    extra = {"num_tokens": plan.num_tokens} if partial else {}
    buffer = gather_blocks(src, plan.src_block_ids, **extra)
    scatter_blocks(buffer, dst, plan.dst_block_ids, **extra)

    for t in range(num_tokens):
        np.testing.assert_array_equal(token_kv(dst, dst_table, t), token_kv(src, src_table, t))
    if partial:  # the slots of the last block past num_tokens are not written
        for layer in dst:
            assert not layer[:, dst_table[-1], num_tokens % block_size :].any()
    # Blocks outside the request's table on the destination stay untouched.
    untouched = sorted(set(range(12)) - set(dst_table))
    for layer in dst:
        assert not layer[:, untouched].any()
