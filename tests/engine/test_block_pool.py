"""BlockPool: reference counts, the never-cached free list, the LRU of cached free blocks, chained hashes."""

from __future__ import annotations

import pytest

from psrl.engine import AllBlocksCleared, BlockPool, BlocksRemoved, BlocksStored, OutOfBlocks, hash_block_tokens
from psrl.engine.prefix_cache import extend_block_hashes

BS = 4


def test_hash_is_stable_signed_64_bit_and_chained() -> None:
    first = hash_block_tokens(None, [1, 2, 3, 4])
    # A golden value: the scheme is part of the wire (KvBlock.block_hash), so it must not drift.
    assert first == -6103203071484142668
    assert -(2**63) <= first < 2**63
    assert hash_block_tokens(None, [1, 2, 3, 4]) == first
    assert hash_block_tokens(first, [1, 2, 3, 4]) != first
    assert hash_block_tokens(0, [1, 2, 3, 4]) != first  # a parent of 0 is not "no parent"
    assert hash_block_tokens(None, [1, 2, 3, 5]) != first
    hashes: list[int] = []
    tokens = list(range(1, 12))
    extend_block_hashes(hashes, tokens, BS, 10)
    assert hashes == [first, hash_block_tokens(first, [5, 6, 7, 8])]  # only full blocks


def _cache(pool: BlockPool, tokens: list[int]) -> tuple[list[int], list[int]]:
    """Allocate and register the full blocks of `tokens` as one sequence; returns (block ids, hashes)."""
    n = len(tokens) // BS
    ids = pool.allocate(n)
    hashes: list[int] = []
    extend_block_hashes(hashes, tokens, BS, n)
    pool.cache_blocks(ids, hashes, tokens, 0, n)
    return ids, hashes


def test_allocate_free_and_reference_counts() -> None:
    pool = BlockPool(6, BS, enable_caching=False)
    a = pool.allocate(4)
    assert len(set(a)) == 4 and pool.num_used == 4 and pool.num_free == 2
    with pytest.raises(OutOfBlocks):
        pool.allocate(3)
    pool.free(a)
    assert pool.num_used == 0
    with pytest.raises(ValueError, match="freed twice"):
        pool.free([a[0]])
    with pytest.raises(ValueError, match="out of range"):
        pool.free([6])
    # Without caching nothing is ever looked up or registered.
    _ids, hashes = _cache(pool, list(range(8)))
    assert pool.cached_prefix(hashes) == [] and pool.num_cached == 0


def test_cached_blocks_are_shared_kept_after_free_and_evicted_lru_tail_first() -> None:
    pool = BlockPool(6, BS)
    pool.events_enabled = True
    ids, hashes = _cache(pool, list(range(12)))  # 3 blocks
    assert pool.cached_prefix(hashes) == ids
    assert pool.cached_prefix([hashes[0], 12345, hashes[2]]) == ids[:1]  # a prefix only

    pool.touch(ids[:2])  # a second request shares two blocks
    assert pool.ref_count(ids[0]) == 2 and pool.num_used == 3
    pool.free(ids)  # the first request finishes
    assert [pool.ref_count(i) for i in ids] == [1, 1, 0]
    assert pool.num_used == 2 and pool.num_free == 4 and pool.num_cached == 3
    pool.free(ids[:2])
    assert pool.num_used == 0 and pool.num_cached == 3

    # Three never-cached blocks are handed out before any cached one is evicted.
    fresh = pool.allocate(3)
    assert not set(fresh) & set(ids) and pool.num_cached == 3
    pool.drain_events()
    # Then the LRU goes oldest first; a sequence's tail was freed first, so it goes first.
    assert pool.allocate(1) == [ids[2]]
    assert pool.drain_events() == [BlocksRemoved((hashes[2],))]
    assert pool.cached_prefix(hashes) == ids[:2]
    pool.touch([ids[0]])  # a hit takes the block out of the LRU: not evictable while held
    assert pool.num_evictable([ids[0], ids[1]]) == 1
    assert pool.allocate(1) == [ids[1]] and pool.num_free == 0
    assert pool.cached_prefix(hashes) == ids[:1]


def test_a_duplicate_block_stays_an_uncached_copy() -> None:
    pool = BlockPool(8, BS)
    pool.events_enabled = True
    tokens = list(range(8))
    first, hashes = _cache(pool, tokens)
    second = pool.allocate(2)  # the same prefix computed by a concurrent request
    pool.cache_blocks(second, hashes, tokens, 0, 2)
    assert pool.cached_prefix(hashes) == first
    assert not pool.is_cached(second[0]) and pool.num_cached == 2
    events = pool.drain_events()
    assert len(events) == 1 and isinstance(events[0], BlocksStored)
    pool.free(second)
    assert pool.num_cached == 2 and pool.num_used == 2


def test_reset_forgets_hashes_and_held_blocks_stay_held() -> None:
    pool = BlockPool(6, BS)
    pool.events_enabled = True
    held, hashes = _cache(pool, list(range(8)))
    free, _ = _cache(pool, list(range(100, 108)))
    pool.free(free)
    assert pool.reset() == 4
    assert pool.num_cached == 0 and pool.cached_prefix(hashes) == [] and pool.epoch == 1
    assert pool.num_used == 2 and pool.num_free == 4
    assert pool.drain_events()[-1] == AllBlocksCleared()
    pool.free(held)  # back to the never-cached list
    assert pool.num_used == 0 and all(not pool.is_cached(i) for i in held)


def test_events_are_recorded_only_when_enabled() -> None:
    pool = BlockPool(4, BS)
    _cache(pool, list(range(8)))
    pool.reset()
    assert pool.drain_events() == []
    pool.set_events_enabled(True)
    pool.reset()
    pool.set_events_enabled(False)  # turning off drops what is pending
    assert pool.drain_events() == []


def test_snapshot_lists_parents_before_children_and_chains_runs() -> None:
    pool = BlockPool(16, BS)
    base = list(range(8))
    a_ids, a = _cache(pool, [*base, 50, 51, 52, 53])
    b_ids, b = _cache(pool, [*base, 60, 61, 62, 63])
    assert a[:2] == b[:2]  # b's first two blocks were duplicates of a's
    snap = pool.snapshot()
    assert snap[0] == AllBlocksCleared()
    stored = [e for e in snap[1:] if isinstance(e, BlocksStored)]
    assert len(stored) == len(snap) - 1
    assert stored[0].parent_block_hash is None
    assert [blk.block_hash for blk in stored[0].blocks] == a  # one chain: root, child, grandchild
    assert stored[1].parent_block_hash == a[1] and [blk.block_hash for blk in stored[1].blocks] == [b[2]]
    assert stored[1].blocks[0].token_ids == (60, 61, 62, 63)
    seen: set[int | None] = {None}
    for event in stored:
        assert event.parent_block_hash in seen
        seen.update(blk.block_hash for blk in event.blocks)

    # A block whose parent was evicted is still listed, with its true parent.
    pool.free(a_ids)
    pool.free(b_ids)
    pool.touch([a_ids[2]])  # keep a's last block while its parents are evicted
    pool.allocate(pool.num_free)
    orphan = [e for e in pool.snapshot() if isinstance(e, BlocksStored)]
    assert len(orphan) == 1 and orphan[0].parent_block_hash == a[1]
    assert [blk.block_hash for blk in orphan[0].blocks] == [a[2]]
