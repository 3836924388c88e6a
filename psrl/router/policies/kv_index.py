"""What each instance really has cached, per tier, from its engine's KV events (SubscribeKvEvents).

The engine's block hashes are opaque, so the index keys blocks by its OWN chained content hash of each block's
token ids (the parent's router hash found through a per-instance engine-hash map); a prompt hashed the same way
in blocks of the instance's block size then finds how many of its leading blocks are cached. The subscriber
feeds `apply`; the cache_aware_v1 policy reads `score`.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Sequence

from smg_grpc_proto.generated import common_pb2

from psrl.router.registry import InstanceId

ROOT_HASH = 0  # the parent of a chain's first block, as the prompt side hashes it


class Tier(enum.IntEnum):
    GPU = 0  # the device (KV_CACHE_TIER_DEVICE, or unspecified)
    LMCACHE = 1  # anything off the device: host, disk, external (LMCache and the like)


def _tier_of(tier: int, cache_level: int | None) -> Tier:
    """The proto's tier, else the older cache_level (0 device, 1 host, 2 disk, 3 external), else the device."""
    if tier != common_pb2.KV_CACHE_TIER_UNSPECIFIED:
        return Tier.GPU if tier == common_pb2.KV_CACHE_TIER_DEVICE else Tier.LMCACHE
    if cache_level is not None and cache_level != 0:
        return Tier.LMCACHE
    return Tier.GPU


def chain_hash(parent: int, tokens: tuple[int, ...]) -> int:
    """The router's content hash of a block after `parent` (deterministic for ints across processes)."""
    return hash((parent, tokens))


# Spec kinds that do not hold every token of a prefix (hybrid models publish one group per attention kind).
_NON_PREFIX_KIND_WORDS = ("sliding", "mamba", "linear", "cross", "encoder")


def _feeds_prefix_index(stored: common_pb2.KvBlocksStored) -> bool:
    if stored.HasField("locality") and stored.locality == common_pb2.KV_CACHE_LOCALITY_REMOTE:
        return False  # a shared pool's blocks, not this instance's
    if stored.HasField("kv_cache_spec_sliding_window") and stored.kv_cache_spec_sliding_window > 0:
        return False
    kind = stored.kv_cache_spec_kind.lower()
    return not any(word in kind for word in _NON_PREFIX_KIND_WORDS)


def _namespace(stored: common_pb2.KvBlocksStored, block: common_pb2.KvBlock) -> tuple[object, ...] | None:
    """Inputs beyond token ids that went into the engine's hash (LoRA, salt, multimodal keys). A prompt carries
    none of them, so folding them in keeps such blocks from matching a plain prompt."""
    lora_id = block.lora_id if block.HasField("lora_id") else None
    if not (stored.lora_name or stored.cache_salt or lora_id is not None or block.extra_keys):
        return None
    return (stored.lora_name, stored.cache_salt, lora_id, tuple(k.SerializeToString() for k in block.extra_keys))


class _TierBlocks:
    __slots__ = ("block_size", "copies", "present")

    def __init__(self, block_size: int = 0) -> None:
        self.block_size = block_size  # learned from the events; 0 until then
        self.copies: dict[int, int] = {}  # engine hash -> stored copies not yet removed
        self.present: dict[int, int] = {}  # router hash -> engine-hash copies behind it


class _InstanceBlocks:
    __slots__ = ("ignored_groups", "router_of", "tiers")

    def __init__(self, block_sizes: tuple[int, int] = (0, 0)) -> None:
        self.router_of: dict[int, int] = {}  # engine hash -> router hash, while any tier holds it
        self.tiers = (_TierBlocks(block_sizes[0]), _TierBlocks(block_sizes[1]))
        self.ignored_groups: set[int] = set()  # KV cache groups that do not feed the index

    def blocks(self) -> int:
        return len(self.tiers[0].present) + len(self.tiers[1].present)


class PromptHashes:
    """A prompt's chained block hashes per block size, computed lazily as far as some instance matches.

    Build one per selection and pass it to every `score` call, so the chain is hashed once.
    """

    def __init__(self, prompt_ids: Sequence[int]) -> None:
        self.tokens: tuple[int, ...] = prompt_ids if isinstance(prompt_ids, tuple) else tuple(prompt_ids)
        self._chains: dict[int, list[int]] = {}

    def leading_hits(self, block_size: int, present: dict[int, int]) -> int:
        """How many full blocks from the start of the prompt have their hash in `present`."""
        chain = self._chains.setdefault(block_size, [])
        total = len(self.tokens) // block_size
        hits = 0
        while True:
            hits += len(list(itertools.takewhile(present.__contains__, itertools.islice(chain, hits, None))))
            if hits < len(chain) or len(chain) == total:
                return hits
            self._extend(chain, block_size, min(total, max(2 * len(chain), 8)))

    def _extend(self, chain: list[int], block_size: int, upto: int) -> None:
        tokens = self.tokens
        parent = chain[-1] if chain else ROOT_HASH
        for i in range(len(chain), upto):
            parent = chain_hash(parent, tokens[i * block_size : (i + 1) * block_size])
            chain.append(parent)


class KvEventIndex:
    """Per-instance, per-tier sets of router block hashes, kept current by the instances' KV event batches."""

    def __init__(self, block_size: int = 16) -> None:
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        self.default_block_size = block_size  # until an instance's events tell its own
        self._instances: dict[InstanceId, _InstanceBlocks] = {}
        self.unknown_parents = 0  # stored blocks dropped because their parent was never seen
        self.unknown_removals = 0  # removed hashes the index did not hold

    # -- feeding ---------------------------------------------------------------------------------------

    def apply(self, instance_id: InstanceId, batch: common_pb2.KvEventBatch) -> None:
        """Apply one batch in order (a snapshot chunk's leading clear then stores work like live events)."""
        for event in batch.events:
            kind = event.WhichOneof("data")
            if kind == "stored":
                self._stored(self._state(instance_id), event.stored)
            elif kind == "removed":
                state = self._instances.get(instance_id)
                if state is None:
                    self.unknown_removals += len(event.removed.block_hashes)
                else:
                    self._removed(state, event.removed)
            elif kind == "cleared":
                self.clear_instance(instance_id)

    def clear_instance(self, instance_id: InstanceId) -> None:
        """The engine dropped its whole cache: forget its blocks, keep the block sizes learned."""
        old = self._instances.get(instance_id)
        sizes = (old.tiers[0].block_size, old.tiers[1].block_size) if old else (0, 0)
        self._instances[instance_id] = _InstanceBlocks(sizes)

    def remove_instance(self, instance_id: InstanceId) -> None:
        self._instances.pop(instance_id, None)

    def remove_worker(self, worker_id: str) -> None:
        for iid in [i for i in self._instances if i.base_worker_id == worker_id]:
            del self._instances[iid]

    def _state(self, instance_id: InstanceId) -> _InstanceBlocks:
        state = self._instances.get(instance_id)
        if state is None:
            state = self._instances[instance_id] = _InstanceBlocks()
        return state

    def _stored(self, state: _InstanceBlocks, stored: common_pb2.KvBlocksStored) -> None:
        if not _feeds_prefix_index(stored):
            if stored.HasField("group_idx"):
                state.ignored_groups.add(stored.group_idx)
            return
        if stored.HasField("parent_block_hash"):
            parent = state.router_of.get(stored.parent_block_hash)
            if parent is None:  # its chain is broken for us: no prompt can reach these blocks
                self.unknown_parents += len(stored.blocks)
                return
        else:
            parent = ROOT_HASH
        event_tier = stored.tier
        for block in stored.blocks:
            tier = state.tiers[_tier_of(event_tier, block.cache_level if block.HasField("cache_level") else None)]
            if block.block_size > 0:
                tier.block_size = block.block_size
            namespace = _namespace(stored, block)
            tokens = tuple(block.token_ids)
            parent = chain_hash(parent, tokens) if namespace is None else hash((parent, tokens, namespace))
            engine_hash = block.block_hash
            previous = state.router_of.get(engine_hash)
            if previous is not None and previous != parent and engine_hash in tier.copies:
                self._drop(tier, previous, tier.copies[engine_hash])  # same engine hash, new content
                del tier.copies[engine_hash]
            state.router_of[engine_hash] = parent
            tier.copies[engine_hash] = tier.copies.get(engine_hash, 0) + 1
            tier.present[parent] = tier.present.get(parent, 0) + 1

    def _removed(self, state: _InstanceBlocks, removed: common_pb2.KvBlocksRemoved) -> None:
        if removed.HasField("locality") and removed.locality == common_pb2.KV_CACHE_LOCALITY_REMOTE:
            return
        if removed.HasField("group_idx") and removed.group_idx in state.ignored_groups:
            return
        tier_id = _tier_of(removed.tier, removed.cache_level if removed.HasField("cache_level") else None)
        tier = state.tiers[tier_id]
        other = state.tiers[1 - tier_id]
        for engine_hash in removed.block_hashes:
            copies = tier.copies.get(engine_hash)
            if copies is None:
                self.unknown_removals += 1
                continue
            self._drop(tier, state.router_of[engine_hash], 1)
            if copies > 1:
                tier.copies[engine_hash] = copies - 1
                continue
            del tier.copies[engine_hash]
            if engine_hash not in other.copies:
                del state.router_of[engine_hash]

    @staticmethod
    def _drop(tier: _TierBlocks, router_hash: int, count: int) -> None:
        left = tier.present.get(router_hash, 0) - count
        if left > 0:
            tier.present[router_hash] = left
        else:
            tier.present.pop(router_hash, None)

    # -- reading ---------------------------------------------------------------------------------------

    def has_blocks(self, instance_id: InstanceId) -> bool:
        """Whether the index holds any block of the instance (else a policy falls back to its own guess)."""
        state = self._instances.get(instance_id)
        return state is not None and state.blocks() > 0

    def size_of(self, instance_id: InstanceId) -> int:
        """Distinct blocks held, all tiers together (the tie-break toward the emptier cache)."""
        state = self._instances.get(instance_id)
        return 0 if state is None else state.blocks()

    def block_size(self, instance_id: InstanceId, tier: Tier = Tier.GPU) -> int:
        """The block size the instance's events showed for `tier`, else the configured fallback."""
        state = self._instances.get(instance_id)
        learned = 0 if state is None else state.tiers[tier].block_size
        return learned or self.default_block_size

    def score(
        self,
        instance_id: InstanceId,
        prompt: PromptHashes | Sequence[int],
        *,
        gpu: bool = True,
        lmcache: bool = True,
    ) -> tuple[int, int]:
        """(gpu_blocks, lmcache_blocks): leading prompt blocks cached per tier, consecutive from the start.

        A tier turned off (its weight <= 0) scores 0 without hashing anything.
        """
        state = self._instances.get(instance_id)
        if state is None:
            return 0, 0
        hashes = prompt if isinstance(prompt, PromptHashes) else PromptHashes(prompt)
        result = [0, 0]
        for tier_id, wanted in ((Tier.GPU, gpu), (Tier.LMCACHE, lmcache)):
            tier = state.tiers[tier_id]
            if wanted and tier.present:
                result[tier_id] = hashes.leading_hits(tier.block_size or self.default_block_size, tier.present)
        return result[0], result[1]
