"""The block pool with automatic prefix caching, in the manner of vLLM v1's BlockPool.

Physical KV blocks carry reference counts. With caching on, a full block is named by a chained content
hash (its parent's hash and its token ids); a hash -> block map serves later requests with the same
prefix, and blocks that no request holds any more stay cached in an LRU until the pool needs fresh
blocks. Pure bookkeeping: no tensors.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass

from psrl.engine.errors import OutOfBlocks
from psrl.engine.kv_events import AllBlocksCleared, BlocksRemoved, BlocksStored, KvEvent, StoredBlock

_HASH_PERSON = b"psrl-prefix-v1"  # blake2b personalization: a new scheme gets a new tag


def hash_block_tokens(parent_block_hash: int | None, token_ids: Sequence[int]) -> int:
    """Chained hash of one full block as a signed int64 (the wire's KvBlock.block_hash type).

    blake2b-64 over a parent marker (0x00 for the first block, else 0x01 + the parent hash as 8 bytes
    little-endian) and the token ids as little-endian int64. Stable across processes and machines, unlike
    Python's hash(), so every replica names the same prefix the same way.
    """
    h = hashlib.blake2b(digest_size=8, person=_HASH_PERSON)
    if parent_block_hash is None:
        h.update(b"\x00")
    else:
        h.update(b"\x01" + struct.pack("<q", parent_block_hash))
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return int.from_bytes(h.digest(), "little", signed=True)


def extend_block_hashes(block_hashes: list[int], token_ids: Sequence[int], block_size: int, num_blocks: int) -> None:
    """Append hashes so that `block_hashes` names the first `num_blocks` full blocks of `token_ids`."""
    for i in range(len(block_hashes), min(num_blocks, len(token_ids) // block_size)):
        parent = block_hashes[i - 1] if i else None
        block_hashes.append(hash_block_tokens(parent, token_ids[i * block_size : (i + 1) * block_size]))


@dataclass(slots=True)
class _CachedBlock:
    block_id: int
    parent_block_hash: int | None
    token_ids: tuple[int, ...]


class BlockPool:
    """Reference-counted KV blocks, plus the prefix cache when `enable_caching` is on.

    Free blocks are of two kinds: never-cached ones (handed out first, recently freed last, like the plain
    allocator) and cached ones no request holds (an LRU, evicted oldest first and only when no
    never-cached block is left). `num_free` counts both: a cached free block is reclaimable.
    """

    def __init__(self, num_blocks: int, block_size: int, *, enable_caching: bool = True) -> None:
        self.num_total = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.events_enabled = False
        # Bumped by reset(): KV computed before it may be stale (new weights), so requests that hold KV
        # from an older epoch never add their blocks to the cache.
        self.epoch = 0
        self._ref = [0] * num_blocks
        self._free_uncached: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, ref 0; oldest first
        self._hash_of: list[int | None] = [None] * num_blocks
        self._cached: dict[int, _CachedBlock] = {}  # block hash -> the one physical copy serving it
        self._events: list[KvEvent] = []

    # ---- counts -----------------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        return len(self._free_uncached) + len(self._evictable)

    @property
    def num_used(self) -> int:
        """Blocks some request holds (cached free blocks are reclaimable, so not counted)."""
        return self.num_total - self.num_free

    @property
    def num_cached(self) -> int:
        """Blocks the prefix cache can serve, held or free."""
        return len(self._cached)

    def ref_count(self, block_id: int) -> int:
        return self._ref[block_id]

    def is_cached(self, block_id: int) -> bool:
        return self._hash_of[block_id] is not None

    # ---- allocation -------------------------------------------------------------------------------

    def allocate(self, n: int) -> list[int]:
        """`n` fresh blocks (ref 1), evicting least recently freed cached blocks if it must."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({n})")
        if n > self.num_free:
            raise OutOfBlocks(n, self.num_free)
        ids: list[int] = []
        evicted: list[int] = []
        for _ in range(n):
            if self._free_uncached:
                block_id = self._free_uncached.popleft()
            else:
                block_id, _ = self._evictable.popitem(last=False)
                block_hash = self._hash_of[block_id]
                assert block_hash is not None
                del self._cached[block_hash]
                self._hash_of[block_id] = None
                evicted.append(block_hash)
            self._ref[block_id] = 1
            ids.append(block_id)
        if evicted and self.events_enabled:
            self._events.append(BlocksRemoved(tuple(evicted)))
        return ids

    def free(self, ids: Sequence[int]) -> None:
        """Drop one reference per block. The tail is freed first so that it is evicted first (vLLM's order):
        a sequence's last blocks are the least likely to be shared."""
        for i in ids:
            if not 0 <= i < self.num_total:
                raise ValueError(f"block id {i} is out of range [0, {self.num_total})")
            if self._ref[i] <= 0:
                raise ValueError(f"block {i} is freed twice")
        for i in reversed(ids):
            self._ref[i] -= 1
            if self._ref[i] == 0:
                if self._hash_of[i] is not None:
                    self._evictable[i] = None
                else:
                    self._free_uncached.append(i)

    def touch(self, ids: Sequence[int]) -> None:
        """Take a reference on cached blocks a request reuses (a free one leaves the LRU)."""
        for i in ids:
            if self._ref[i] == 0:
                del self._evictable[i]
            self._ref[i] += 1

    # ---- the prefix cache -------------------------------------------------------------------------

    def cached_prefix(self, block_hashes: Sequence[int]) -> list[int]:
        """Block ids serving the longest run of `block_hashes` present in the cache, from the first."""
        ids: list[int] = []
        if not self.enable_caching:
            return ids
        for block_hash in block_hashes:
            entry = self._cached.get(block_hash)
            if entry is None:
                break
            ids.append(entry.block_id)
        return ids

    def cached_prefix_of(self, token_ids: Sequence[int]) -> list[int]:
        """Block ids serving the longest cached run of `token_ids`' full blocks; hashes only up to the first miss."""
        ids: list[int] = []
        if not self.enable_caching:
            return ids
        parent: int | None = None
        for start in range(0, len(token_ids) - self.block_size + 1, self.block_size):
            parent = hash_block_tokens(parent, token_ids[start : start + self.block_size])
            entry = self._cached.get(parent)
            if entry is None:
                break
            ids.append(entry.block_id)
        return ids

    def num_evictable(self, ids: Sequence[int]) -> int:
        """How many of `ids` are free cached blocks (touching them takes them out of `num_free`)."""
        return sum(1 for i in ids if self._ref[i] == 0)

    def cache_blocks(
        self, block_ids: Sequence[int], block_hashes: Sequence[int], token_ids: Sequence[int], start: int, end: int
    ) -> None:
        """Register blocks [start, end) of a sequence, whose K/V are fully computed, in the cache.

        A block whose hash is already cached (another request computed the same prefix at the same time)
        stays an uncached copy: one physical block serves each hash.
        """
        if not self.enable_caching or start >= end:
            return
        bs = self.block_size
        run: list[StoredBlock] = []
        run_parent: int | None = None
        for i in range(start, end):
            block_hash = block_hashes[i]
            parent = block_hashes[i - 1] if i else None
            if block_hash in self._cached:
                self._flush_stored(run, run_parent)
                run = []
                continue
            block_id = block_ids[i]
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            self._cached[block_hash] = _CachedBlock(block_id, parent, tokens)
            self._hash_of[block_id] = block_hash
            if not run:
                run_parent = parent
            run.append(StoredBlock(block_hash, tokens))
        self._flush_stored(run, run_parent)

    def _flush_stored(self, run: list[StoredBlock], parent: int | None) -> None:
        if run and self.events_enabled:
            self._events.append(BlocksStored(tuple(run), parent, self.block_size))

    def reset(self) -> int:
        """Forget every cached hash; blocks held by requests stay with them, uncached. Returns the count."""
        count = len(self._cached)
        for entry in self._cached.values():
            self._hash_of[entry.block_id] = None
        self._cached.clear()
        self._free_uncached.extend(self._evictable)
        self._evictable.clear()
        self.epoch += 1
        if self.events_enabled:
            self._events.append(AllBlocksCleared())
        return count

    # ---- events -----------------------------------------------------------------------------------

    def set_events_enabled(self, enabled: bool) -> None:
        self.events_enabled = enabled
        if not enabled:
            self._events.clear()

    def drain_events(self) -> list[KvEvent]:
        events, self._events = self._events, []
        return events

    def snapshot(self) -> list[KvEvent]:
        """The cache state as events: AllBlocksCleared, then every cached block, parents before children.

        Blocks are listed depth first from each root, so a block that directly follows its parent extends
        the parent's BlocksStored chain. A block whose parent was evicted starts a chain of its own.
        """
        children: dict[int | None, list[int]] = {}
        for block_hash, entry in self._cached.items():
            parent = entry.parent_block_hash if entry.parent_block_hash in self._cached else None
            children.setdefault(parent, []).append(block_hash)
        events: list[KvEvent] = [AllBlocksCleared()]
        run: list[StoredBlock] = []
        run_parent: int | None = None
        stack = list(reversed(children.get(None, [])))
        while stack:
            block_hash = stack.pop()
            entry = self._cached[block_hash]
            parent = entry.parent_block_hash
            if not run or run[-1].block_hash != parent:
                if run:
                    events.append(BlocksStored(tuple(run), run_parent, self.block_size))
                run, run_parent = [], parent
            run.append(StoredBlock(block_hash, entry.token_ids))
            stack.extend(reversed(children.get(block_hash, [])))
        if run:
            events.append(BlocksStored(tuple(run), run_parent, self.block_size))
        return events
