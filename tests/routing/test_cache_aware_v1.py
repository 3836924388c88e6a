"""KV events -> KvEventIndex -> scores, and the cache_aware_v1 decisions built on them."""

from __future__ import annotations

from smg_grpc_proto.generated import common_pb2 as pb

from psrl.router.config import CacheAwareConfig
from psrl.router.policies.base import SelectionRequest
from psrl.router.policies.cache_aware_v1 import CacheAwareV1Policy
from psrl.router.policies.kv_index import KvEventIndex, PromptHashes, Tier
from psrl.router.registry import InstanceId, InstanceState, WorkerRegistry

A, B = InstanceId("a", 0), InstanceId("b", 0)
BS = 4


def _blocks(tokens: list[int], bs: int, first_hash: int) -> list[pb.KvBlock]:
    return [
        pb.KvBlock(block_hash=first_hash + i, token_ids=tokens[i * bs : (i + 1) * bs], block_size=bs)
        for i in range(len(tokens) // bs)
    ]


def stored(
    tokens: list[int], *, first_hash: int, parent: int | None = None, bs: int = BS, tier: int = 0, **kw: object
) -> pb.KvCacheEvent:
    ev = pb.KvBlocksStored(blocks=_blocks(tokens, bs, first_hash), tier=tier, **kw)  # type: ignore[arg-type]
    if parent is not None:
        ev.parent_block_hash = parent
    return pb.KvCacheEvent(stored=ev)


def removed(hashes: list[int], tier: int = 0) -> pb.KvCacheEvent:
    return pb.KvCacheEvent(removed=pb.KvBlocksRemoved(block_hashes=hashes, tier=tier))


def cleared() -> pb.KvCacheEvent:
    return pb.KvCacheEvent(cleared=pb.KvCacheCleared())


def batch(*events: pb.KvCacheEvent, seq: int = 1) -> pb.KvEventBatch:
    return pb.KvEventBatch(sequence_number=seq, events=list(events))


PROMPT = list(range(100, 124))  # 6 blocks of 4


# -- index -------------------------------------------------------------------------------------------------


def test_chained_hashes_match_a_prompt_across_events() -> None:
    index = KvEventIndex(block_size=BS)
    # Two events: the second continues the first through the engine's parent hash.
    index.apply(A, batch(stored(PROMPT[:8], first_hash=500), stored(PROMPT[8:16], first_hash=900, parent=501)))
    assert index.score(A, PROMPT) == (4, 0)
    assert index.score(A, PROMPT[:10]) == (2, 0)  # partial last block does not count
    assert index.score(A, [0, *PROMPT]) == (0, 0)  # same tokens, shifted: no leading match
    assert index.score(B, PROMPT) == (0, 0)
    # A block whose content differs breaks the chain from there on, even if later blocks are equal.
    other = [*PROMPT[:4], 7, 7, 7, 7, *PROMPT[8:]]
    assert index.score(A, other) == (1, 0)
    assert index.has_blocks(A) and not index.has_blocks(B)
    assert index.size_of(A) == 4


def test_same_content_under_another_parent_is_a_different_block() -> None:
    index = KvEventIndex(block_size=BS)
    index.apply(A, batch(stored([1, 1, 1, 1], first_hash=10), stored(PROMPT[4:8], first_hash=11, parent=10)))
    assert index.score(A, PROMPT) == (0, 0)


def test_removal_and_unknown_hashes() -> None:
    index = KvEventIndex(block_size=BS)
    index.apply(A, batch(stored(PROMPT, first_hash=1)))  # hashes 1..6
    assert index.score(A, PROMPT) == (6, 0)
    index.apply(A, batch(removed([4, 12345])))
    assert index.score(A, PROMPT) == (3, 0)  # consecutive from the start only
    assert index.unknown_removals == 1
    index.apply(B, batch(removed([1])))  # an instance never seen
    assert index.unknown_removals == 2
    # A child stored under a parent the index never saw cannot be reached: dropped, counted.
    index.apply(A, batch(stored(PROMPT[:4], first_hash=77, parent=999)))
    assert index.unknown_parents == 1
    index.apply(A, batch(removed([1, 2, 3, 5, 6])))
    assert not index.has_blocks(A)


def test_duplicate_copies_are_refcounted() -> None:
    index = KvEventIndex(block_size=BS)
    index.apply(A, batch(stored(PROMPT[:4], first_hash=1), stored(PROMPT[:4], first_hash=1)))
    index.apply(A, batch(removed([1])))
    assert index.score(A, PROMPT) == (1, 0)  # one physical copy left
    index.apply(A, batch(removed([1])))
    assert index.score(A, PROMPT) == (0, 0)


def test_clear_and_snapshot() -> None:
    index = KvEventIndex(block_size=BS)
    index.apply(A, batch(stored(PROMPT, first_hash=1), stored([5] * 8, first_hash=50)))
    index.apply(A, batch(cleared()))
    assert index.score(A, PROMPT) == (0, 0) and not index.has_blocks(A)
    # A relay snapshot: a leading clear, then every live block, parents first.
    snap = pb.KvEventBatch(
        sequence_number=42,
        events=[cleared(), stored(PROMPT[:8], first_hash=70), stored(PROMPT[8:12], first_hash=72, parent=71)],
        snapshot=pb.KvSnapshotChunk(index=0, count=1, blocks=3),
    )
    index.apply(A, batch(stored([9] * 8, first_hash=80)))
    index.apply(A, snap)
    assert index.score(A, PROMPT) == (3, 0)
    assert index.size_of(A) == 3  # the stale [9]* blocks went with the clear
    index.remove_instance(A)
    assert index.score(A, PROMPT) == (0, 0)


def test_two_tiers_and_their_removals() -> None:
    index = KvEventIndex(block_size=BS)
    host = pb.KV_CACHE_TIER_HOST
    index.apply(
        A,
        batch(
            stored(PROMPT[:8], first_hash=1),  # device, unspecified tier
            stored(PROMPT, first_hash=1, tier=host),  # the whole prompt offloaded, same engine hashes
        ),
    )
    assert index.score(A, PROMPT) == (2, 6)
    assert index.score(A, PROMPT, gpu=False) == (0, 6)
    index.apply(A, batch(removed([1], tier=pb.KV_CACHE_TIER_DEVICE)))
    assert index.score(A, PROMPT) == (0, 6)
    # The host copy keeps the engine hash known, so a new device child of block 1 still chains.
    index.apply(A, batch(stored(PROMPT[4:8], first_hash=2, parent=1)))
    assert index.score(A, PROMPT[4:]) == (0, 0) and index.unknown_parents == 0
    # The older cache_level field says the tier when `tier` is unset.
    block = pb.KvBlock(block_hash=300, token_ids=[8, 8, 8, 8], block_size=BS, cache_level=2)
    index.apply(B, batch(pb.KvCacheEvent(stored=pb.KvBlocksStored(blocks=[block]))))
    assert index.score(B, [8, 8, 8, 8]) == (0, 1)


def test_block_size_is_learned_per_instance_and_tier_else_the_fallback() -> None:
    index = KvEventIndex(block_size=16)
    prompt = list(range(64))
    index.apply(A, batch(stored(prompt, first_hash=1, bs=16)))
    index.apply(B, batch(stored(prompt, first_hash=1, bs=8), stored(prompt, first_hash=1, bs=32, tier=4)))
    assert index.block_size(A) == 16 and index.block_size(A, Tier.LMCACHE) == 16  # the fallback
    assert index.block_size(B) == 8 and index.block_size(B, Tier.LMCACHE) == 32
    hashes = PromptHashes(prompt)  # one chain per block size, shared by every instance
    assert index.score(A, hashes) == (4, 0)
    assert index.score(B, hashes) == (8, 2)
    # Blocks whose block_size is unset are hashed with the fallback.
    unsized = pb.KvBlocksStored(blocks=[pb.KvBlock(block_hash=1, token_ids=prompt[:16])])
    c = InstanceId("c", 0)
    index.apply(c, batch(pb.KvCacheEvent(stored=unsized)))
    assert index.block_size(c) == 16 and index.score(c, prompt) == (1, 0)


def test_namespaced_remote_and_sliding_window_blocks_do_not_match_plain_prompts() -> None:
    index = KvEventIndex(block_size=BS)
    index.apply(A, batch(stored(PROMPT, first_hash=1, lora_name="adapter")))
    index.apply(B, batch(stored(PROMPT, first_hash=1, locality=pb.KV_CACHE_LOCALITY_REMOTE)))
    c = InstanceId("c", 0)
    index.apply(c, batch(stored(PROMPT, first_hash=1, group_idx=1, kv_cache_spec_kind="sliding_window")))
    index.apply(c, batch(stored(PROMPT, first_hash=1, group_idx=0, kv_cache_spec_kind="full_attention")))
    assert index.score(A, PROMPT) == (0, 0)
    assert index.score(B, PROMPT) == (0, 0)
    assert index.score(c, PROMPT) == (6, 0)
    # Removals in the ignored group leave the full-attention blocks alone.
    index.apply(c, batch(pb.KvCacheEvent(removed=pb.KvBlocksRemoved(block_hashes=[1], group_idx=1))))
    assert index.score(c, PROMPT) == (6, 0)


def test_long_prompt_chain_is_extended_lazily() -> None:
    index = KvEventIndex(block_size=BS)
    long_prompt = list(range(40_000))
    index.apply(A, batch(stored(long_prompt[:8], first_hash=1)))
    hashes = PromptHashes(long_prompt)
    assert index.score(A, hashes) == (2, 0)
    assert len(hashes._chains[BS]) < 100  # hashed only as far as a match could reach
    index.apply(B, batch(stored(long_prompt[:4000], first_hash=1)))
    assert index.score(B, hashes) == (1000, 0)


# -- policy ------------------------------------------------------------------------------------------------


def _instances(labels: dict[str, str] | None = None) -> list[InstanceState]:
    reg = WorkerRegistry()
    reg.create_worker("a", "grpc://h:1", models=["m"], labels=dict(labels or {}))
    reg.create_worker("b", "grpc://h:2", models=["m"], labels=dict(labels or {}))
    reg.create_worker("c", "grpc://h:3", models=["m"], labels=dict(labels or {}))
    return reg.instances_of("m")


def _req(ids: list[int]) -> SelectionRequest:
    return SelectionRequest("r", model="m", prompt_ids=ids)


def _policy(**overrides: object) -> CacheAwareV1Policy:
    cfg = CacheAwareConfig(block_size=BS, **overrides)  # type: ignore[arg-type]
    return CacheAwareV1Policy(cfg, KvEventIndex(BS))


def test_prefix_hit_wins() -> None:
    a, b, c = _instances()
    policy = _policy()
    policy.kv_index.apply(b.id, batch(stored(PROMPT[:8], first_hash=1)))
    policy.kv_index.apply(c.id, batch(stored(PROMPT[:16], first_hash=1)))
    c.inflight = 4
    assert policy.select([a, b, c], _req(PROMPT)) is c  # 4 blocks beat 2 despite the load
    assert policy.select([a, b], _req(PROMPT)) is b  # only the candidates are scored
    assert policy.select([a, b, c], _req([1, 2, 3, 4, 5])) is a  # no positive score: least load


def test_score_ties_go_to_lower_load_then_smaller_index() -> None:
    a, b, c = _instances()
    policy = _policy()
    for inst in (a, b, c):
        policy.kv_index.apply(inst.id, batch(stored(PROMPT[:8], first_hash=1)))
    policy.kv_index.apply(a.id, batch(stored([9] * 8, first_hash=50)))
    b.inflight = 1
    assert policy.select([a, b, c], _req(PROMPT)) is c  # a: bigger index; b: busier
    c.inflight = 1
    assert policy.select([a, b, c], _req(PROMPT)) is a


def test_tier_weights() -> None:
    a, b, _ = _instances()
    host = pb.KV_CACHE_TIER_HOST
    gpu_only = _policy()  # lmcache weight 0: the host tier is skipped
    weighted = _policy(lmcache_overlap_weight=0.5)
    for policy in (gpu_only, weighted):
        policy.kv_index.apply(a.id, batch(stored(PROMPT[:8], first_hash=1)))  # 2 device blocks
        policy.kv_index.apply(b.id, batch(stored(PROMPT[:4], first_hash=1), stored(PROMPT, first_hash=1, tier=host)))
    # gpu_only: a 2 vs b 1. weighted: a 2 vs b 1 + 0.5 x 6 = 4.
    assert gpu_only.select([a, b], _req(PROMPT)) is a
    assert weighted.select([a, b], _req(PROMPT)) is b


def test_imbalance_forces_min_load() -> None:
    a, b, c = _instances()
    policy = _policy()
    policy.kv_index.apply(c.id, batch(stored(PROMPT, first_hash=1)))
    a.inflight, b.inflight, c.inflight = 5, 3, 20  # spread 17 > 16, 20 > 1.5 x 3
    assert policy.select([a, b, c], _req(PROMPT)) is b
    a.inflight, b.inflight, c.inflight = 1, 0, 1
    c.stats.kv_cache_usage = 0.8  # spread 0.8 > 0.75
    assert policy.select([a, b, c], _req(PROMPT)) is b


def test_admission_rejects_a_hit_that_does_not_fit() -> None:
    a, b, c = _instances({"max_model_len": "100"})
    policy = _policy(kv_capacity_threshold=1.0)
    long_prompt = list(range(200, 300))  # 100 tokens
    policy.kv_index.apply(b.id, batch(stored(long_prompt[:80], first_hash=1)))  # 20 new tokens
    policy.kv_index.apply(c.id, batch(stored(long_prompt[:40], first_hash=1)))  # 60 new tokens
    b.stats.kv_cache_usage = 0.7  # free (1.0 - 0.7) x 100 = 30 >= 20
    c.stats.kv_cache_usage = 0.3  # free 70 >= 60
    a.inflight, a.stats.kv_cache_usage = 1, 0.5  # keeps the usage spread under 0.75 below
    assert policy.select([a, b, c], _req(long_prompt)) is b
    b.stats.kv_cache_usage = 0.85  # free 15 < 20: the next best, c
    assert policy.select([a, b, c], _req(long_prompt)) is c
    c.stats.kv_cache_usage = 0.45  # free 55 < 60: nobody fits -> least load (b or c; a is busier)
    assert policy.select([a, b, c], _req(long_prompt)) is b
    # Without the label there is no check.
    b.worker.labels.pop("max_model_len")
    b.stats.kv_cache_usage = 0.99
    c.stats.kv_cache_usage = 0.99
    assert policy.select([a, b, c], _req(long_prompt)) is b


def test_falls_back_to_the_token_tree_without_events() -> None:
    a, b, c = _instances()
    policy = _policy(cache_threshold=0.3)
    policy.on_dispatched(b, _req(PROMPT[:12]))
    assert policy.select([a, b, c], _req(PROMPT)) is b  # 12/24 = 0.5 > 0.3 on the approximate tree
    assert policy.select([a, b, c], _req([1, 2, 3])) is a  # miss: smallest tree
    # Text-only requests cannot be scored by KV events: the tree's byte keys decide.
    policy.on_dispatched(c, SelectionRequest("t", model="m", text="hello world"))
    policy.kv_index.apply(a.id, batch(stored(PROMPT, first_hash=1)))
    assert policy.select([a, b, c], SelectionRequest("t", model="m", text="hello there")) is c
    # Once the index knows a candidate, events decide.
    assert policy.select([a, b, c], _req(PROMPT)) is a


def test_worker_removal_reaches_tree_and_index() -> None:
    a, _, _ = _instances()
    policy = _policy()
    policy.kv_index.apply(a.id, batch(stored(PROMPT, first_hash=1)))
    policy.on_dispatched(a, _req(PROMPT))
    policy.on_worker_removed("a")
    assert not policy.kv_index.has_blocks(a.id)
    assert policy.approximate.tree(_req(PROMPT)).size_of(a.id) == 0
    assert policy.maybe_evict(10**9)
