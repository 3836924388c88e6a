"""KV-cache events of the prefix cache (vLLM's BlockStored / BlockRemoved / AllBlocksCleared), as plain dataclasses.

The engine records them in order while `Engine.kv_events_enabled` is on; `AsyncEngine.subscribe_kv_events`
fans them out to asyncio consumers, and the replica servicer turns them into `KvEventBatch` protos.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StoredBlock:
    block_hash: int  # signed 64-bit chained hash, see prefix_cache.hash_block_tokens
    token_ids: tuple[int, ...]  # exactly block_size tokens


@dataclass(frozen=True, slots=True)
class BlocksStored:
    """Full blocks that became cached: a chain, each block's parent being the block before it."""

    blocks: tuple[StoredBlock, ...]
    parent_block_hash: int | None  # parent of blocks[0]; None when blocks[0] starts a sequence
    block_size: int


@dataclass(frozen=True, slots=True)
class BlocksRemoved:
    """Cached blocks evicted to make room (their hashes are no longer served from the cache)."""

    block_hashes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """Every cached block was dropped (reset_prefix_cache, a weight swap, or the start of a snapshot)."""


KvEvent = BlocksStored | BlocksRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class KvEventsUpdate:
    """What one KV-event subscriber receives at a time.

    A snapshot update lists the cache state (an AllBlocksCleared, then every live block, parents before
    children); every later update lists the events of one or more engine steps, in order.
    """

    events: tuple[KvEvent, ...]
    is_snapshot: bool
    timestamp: float  # time.time() when the update was taken from the engine
