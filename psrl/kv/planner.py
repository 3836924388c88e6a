"""Block copy plan for moving a request's KV from a source replica's paged cache to a destination's.

Both block tables are the request's full tables on each side, indexed from token 0: token ``t`` lives in
block ``table[t // block_size]`` at slot ``t % block_size``. The plan moves tokens ``[start, num_tokens)``,
``start`` block-aligned because the destination may already hold ``[0, start)`` (a prefix-cache hit) in
its first blocks. Pure bookkeeping: no tensors. Feed ``plan.src_block_ids`` to ``gather_blocks`` on the
source and ``plan.dst_block_ids`` to ``scatter_blocks`` on the destination, both with
``num_tokens=plan.num_tokens`` so only the filled part of a partial last block moves.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

__all__ = [
    "BlockCopy",
    "BlockSizeMismatch",
    "NotEnoughBlocks",
    "PlanError",
    "TransferPlan",
    "plan_transfer",
]


class PlanError(ValueError):
    """A transfer that cannot be planned as asked."""


class BlockSizeMismatch(PlanError):
    def __init__(self, src_block_size: int, dst_block_size: int) -> None:
        self.src_block_size = src_block_size
        self.dst_block_size = dst_block_size
        super().__init__(
            f"block sizes differ: source {src_block_size}, destination {dst_block_size} "
            "(blocks move whole, so both caches need the same block size)"
        )


class NotEnoughBlocks(PlanError):
    def __init__(self, side: str, needed: int, have: int, num_tokens: int, block_size: int) -> None:
        self.side = side  # "source" or "destination"
        self.needed = needed
        self.have = have
        super().__init__(
            f"{side} block table has {have} blocks; {num_tokens} tokens at block_size {block_size} need {needed}"
        )


class BlockCopy(NamedTuple):
    src_block: int
    dst_block: int
    num_tokens: int  # valid tokens in the block: block_size, or fewer for the last block


@dataclass(frozen=True)
class TransferPlan:
    """The blocks to copy for tokens ``[start, end)``, in token order."""

    copies: tuple[BlockCopy, ...]
    start: int
    end: int
    block_size: int

    @property
    def num_tokens(self) -> int:
        """Tokens moved, ``end - start``: the tokens the plan's blocks hold, in order (gather/scatter's num_tokens)."""
        return self.end - self.start

    @property
    def num_blocks(self) -> int:
        return len(self.copies)

    @property
    def src_block_ids(self) -> list[int]:
        return [copy.src_block for copy in self.copies]

    @property
    def dst_block_ids(self) -> list[int]:
        return [copy.dst_block for copy in self.copies]

    @property
    def first_block(self) -> int:
        """Index in the block tables of the first block moved (``start // block_size``)."""
        return self.start // self.block_size


def _nonneg_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise PlanError(f"{name} must be a non-negative integer, got {value!r}")
    return value


def _table(name: str, ids: Sequence[int] | Any) -> list[int]:
    if hasattr(ids, "tolist"):  # numpy array / torch tensor
        ids = ids.tolist()
    table = list(ids)
    for i, block in enumerate(table):
        if isinstance(block, bool) or not isinstance(block, int) or block < 0:
            raise PlanError(f"{name}[{i}] must be a non-negative integer block id, got {block!r}")
    return table


def plan_transfer(
    src_block_ids: Sequence[int] | Any,
    dst_block_ids: Sequence[int] | Any,
    *,
    num_tokens: int,
    block_size: int,
    start: int = 0,
    dst_block_size: int | None = None,
) -> TransferPlan:
    """Plan copies of tokens ``[start, num_tokens)`` from the source block table to the destination's.

    ``num_tokens``: tokens of the request with KV on the source (the end of the moved range).
    ``block_size``: the source cache's; ``dst_block_size`` (default: the same) must equal it.
    ``start``: first token to move, a multiple of ``block_size``; the destination holds ``[0, start)``.
    Tables may be longer than needed (preallocated blocks); destination ids in the plan must be distinct.
    """
    block_size = _nonneg_int("block_size", block_size)
    if block_size == 0:
        raise PlanError("block_size must be positive")
    if dst_block_size is not None and _nonneg_int("dst_block_size", dst_block_size) != block_size:
        raise BlockSizeMismatch(block_size, dst_block_size)
    end = _nonneg_int("num_tokens", num_tokens)
    start = _nonneg_int("start", start)
    if start % block_size:
        raise PlanError(f"start {start} is not a multiple of block_size {block_size}")
    if start > end:
        raise PlanError(f"start {start} is past num_tokens {end}")
    src = _table("src_block_ids", src_block_ids)
    dst = _table("dst_block_ids", dst_block_ids)
    needed = -(-end // block_size)
    if len(src) < needed:
        raise NotEnoughBlocks("source", needed, len(src), end, block_size)
    if len(dst) < needed:
        raise NotEnoughBlocks("destination", needed, len(dst), end, block_size)
    first = start // block_size
    copies = tuple(BlockCopy(src[i], dst[i], min(block_size, end - i * block_size)) for i in range(first, needed))
    seen: set[int] = set()
    for copy in copies:
        if copy.dst_block in seen:
            raise PlanError(f"destination block {copy.dst_block} appears twice in the moved range")
        seen.add(copy.dst_block)
    return TransferPlan(copies=copies, start=start, end=end, block_size=block_size)
