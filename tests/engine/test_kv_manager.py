"""KvManager on its own: pins, leases, adoption, reservations, migrated KV and frees held back for a forward.

Pure bookkeeping over a BlockPool, with a fake clock for pin expiry; every test ends with no block held.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from psrl.engine import BlockPool, KvManager, KvSource, OutOfBlocks, PreloadedKV, SamplingOptions
from psrl.engine.prefix_cache import extend_block_hashes
from psrl.engine.request import Request
from psrl.engine.routing import RoutingRecorder

BS = 4
TOKENS = list(range(10, 24))  # 14 tokens: 3 full blocks and a partial one


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def pool() -> Iterator[BlockPool]:
    pool = BlockPool(16, BS)
    yield pool
    assert pool.num_used == 0, "a test leaked blocks"


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def kv(pool: BlockPool, clock: Clock) -> KvManager:
    return KvManager(pool, clock=clock)


def computed(pool: BlockPool, rid: str, tokens: list[int], num_computed: int, *, cache: bool = False) -> Request:
    """A request whose first `num_computed` tokens have their K/V in freshly allocated blocks (the full ones
    registered in the prefix cache with `cache`)."""
    req = Request(rid, tokens, SamplingOptions(max_tokens=4), len(tokens) + 4)
    req.block_ids = pool.allocate(-(-num_computed // BS))
    req.num_computed_tokens = num_computed
    if cache:
        full = num_computed // BS
        extend_block_hashes(req.block_hashes, tokens, BS, full)
        pool.cache_blocks(req.block_ids, req.block_hashes, tokens, 0, full)
    return req


def finish(pool: BlockPool, req: Request) -> None:
    """What the scheduler does when a request ends: drop its references."""
    pool.free(req.block_ids)
    req.block_ids = []


def test_a_pin_holds_the_computed_blocks_until_unpinned(pool: BlockPool, kv: KvManager) -> None:
    req = computed(pool, "r", TOKENS, 13)
    assert kv.pin(req, 10.0) == 13 and kv.num_pinned == 1
    finish(pool, req)
    assert pool.num_used == 4  # the pin's own reference keeps all 4 blocks, the partial last one too
    assert kv.unpin("r") and not kv.unpin("r")
    assert kv.num_pinned == 0


def test_pinning_nothing_computed_pins_nothing(pool: BlockPool, kv: KvManager) -> None:
    req = computed(pool, "r", TOKENS, 0)
    assert kv.pin(req, 10.0) == 0 and kv.num_pinned == 0
    finish(pool, req)


def test_pinning_again_replaces_the_pin(pool: BlockPool, kv: KvManager) -> None:
    req = computed(pool, "r", TOKENS, 6)
    kv.pin(req, 10.0)
    req.block_ids += pool.allocate(2)
    req.num_computed_tokens = 13
    assert kv.pin(req, 10.0) == 13 and kv.num_pinned == 1
    finish(pool, req)
    assert pool.num_used == 4  # the first pin's references were dropped, not leaked
    assert kv.unpin("r")


def test_pins_expire_on_the_clock(pool: BlockPool, kv: KvManager, clock: Clock) -> None:
    kv.pin(early := computed(pool, "early", TOKENS, 8), 5.0)
    kv.pin(late := computed(pool, "late", TOKENS, 8), 20.0)
    finish(pool, early)
    finish(pool, late)
    clock.now += 4.0
    kv.expire_pins()
    assert kv.num_pinned == 2
    clock.now += 1.0
    kv.expire_pins()
    assert kv.num_pinned == 1 and kv.lease("early", TOKENS, allow_prefix_cache=False) is None
    clock.now += 15.0
    assert kv.lease("late", TOKENS, allow_prefix_cache=False) is None  # a lease expires pins first
    assert kv.num_pinned == 0


def test_the_oldest_pin_is_dropped_first(pool: BlockPool, kv: KvManager) -> None:
    for rid in ("a", "b"):
        req = computed(pool, rid, TOKENS, 8)
        kv.pin(req, 10.0)
        finish(pool, req)
    assert kv.drop_oldest_pin() and kv.lease("a", TOKENS, allow_prefix_cache=False) is None
    assert kv.drop_oldest_pin() and not kv.drop_oldest_pin()


def test_a_lease_lends_the_pinned_common_prefix(pool: BlockPool, kv: KvManager) -> None:
    req = computed(pool, "r", TOKENS, 13)
    kv.pin(req, 10.0)
    finish(pool, req)
    diverged = [*TOKENS[:6], -1, *TOKENS[7:]]
    lease = kv.lease("r", diverged, allow_prefix_cache=False)
    assert lease is not None and lease.source is KvSource.PIN and lease.source == "pin"
    assert lease.num_tokens == 6 and len(lease.block_ids) == 2  # a partial last block
    kv.unpin("r")
    assert pool.num_used == 2  # the lease outlives the pin
    kv.release(lease.block_ids)
    assert kv.lease("r", TOKENS, allow_prefix_cache=False) is None  # no pin any more


def test_a_lease_of_nothing_in_common_takes_no_reference(pool: BlockPool, kv: KvManager) -> None:
    req = computed(pool, "r", TOKENS, 13)
    kv.pin(req, 10.0)
    finish(pool, req)
    assert kv.lease("r", [-1, *TOKENS[1:]], allow_prefix_cache=False) is None
    assert pool.num_used == 4
    kv.unpin("r")


def test_without_a_pin_a_lease_may_lend_the_prefix_cache(pool: BlockPool, kv: KvManager) -> None:
    req = computed(pool, "other", TOKENS, 13, cache=True)  # 3 full blocks cached
    finish(pool, req)
    assert kv.lease("r", TOKENS, allow_prefix_cache=False) is None
    lease = kv.lease("r", TOKENS, allow_prefix_cache=True)
    assert lease is not None and lease.source is KvSource.PREFIX_CACHE and lease.source == "prefix_cache"
    assert lease.num_tokens == 12 and len(lease.block_ids) == 3 and pool.num_used == 3
    assert kv.lease_cached_prefix([-1, *TOKENS[1:]]) is None
    again = kv.lease_cached_prefix(TOKENS[:9])
    assert again is not None and again.block_ids == lease.block_ids[:2]
    kv.release(lease.block_ids)
    kv.release(again.block_ids)


def test_adopting_a_pin_keeps_the_common_prefix_and_frees_the_rest(pool: BlockPool, kv: KvManager) -> None:
    req = computed(pool, "r", TOKENS, 13)
    kv.pin(req, 10.0)
    finish(pool, req)
    got = kv.adopt_pin("r", [*TOKENS[:10], -1, -1], max_tokens=11)
    assert got is not None and got.num_tokens == 10 and got.token_ids == tuple(TOKENS[:10])
    assert len(got.block_ids) == 3 and pool.num_used == 3 and kv.num_pinned == 0
    assert kv.adopt_pin("r", TOKENS, 13) is None  # adopted once
    kv.release(got.block_ids)


def test_adoption_stops_at_max_tokens(pool: BlockPool, kv: KvManager) -> None:
    req = computed(pool, "r", TOKENS, 13)
    kv.pin(req, 10.0)
    finish(pool, req)
    got = kv.adopt_pin("r", TOKENS, max_tokens=8)
    assert got is not None and got.num_tokens == 8 and len(got.block_ids) == 2 and pool.num_used == 2
    kv.release(got.block_ids)


@pytest.mark.parametrize("reader", ["prefix_cache", "running_request"])
def test_adoption_never_writes_into_a_block_others_read(pool: BlockPool, kv: KvManager, reader: str) -> None:
    req = computed(pool, "r", TOKENS, 13, cache=reader == "prefix_cache")
    kv.pin(req, 10.0)
    if reader == "prefix_cache":
        finish(pool, req)
    got = kv.adopt_pin("r", [*TOKENS[:6], -1], max_tokens=13)  # diverges inside block 1, which others read
    assert got is not None and got.num_tokens == 4 and len(got.block_ids) == 1  # rounded down to block 0
    kv.release(got.block_ids)
    if reader == "running_request":
        finish(pool, req)


def test_adopting_nothing_in_common_frees_the_whole_pin(pool: BlockPool, kv: KvManager) -> None:
    req = computed(pool, "r", TOKENS, 13)
    kv.pin(req, 10.0)
    finish(pool, req)
    assert kv.adopt_pin("r", [-1, *TOKENS[1:]], max_tokens=13) is None
    assert kv.num_pinned == 0 and kv.adopt_pin("nope", TOKENS, 13) is None


def test_an_expired_pin_cannot_be_adopted(pool: BlockPool, kv: KvManager, clock: Clock) -> None:
    req = computed(pool, "r", TOKENS, 13)
    kv.pin(req, 1.0)
    finish(pool, req)
    clock.now += 1.0
    assert kv.adopt_pin("r", TOKENS, 13) is None and kv.num_pinned == 0


def test_reservations_are_fresh_blocks_or_none(pool: BlockPool, kv: KvManager) -> None:
    ids = kv.reserve(9)
    assert len(ids) == 3 and pool.num_used == 3
    with pytest.raises(OutOfBlocks):
        kv.reserve(14 * BS)
    assert pool.num_used == 3  # a refused reservation takes nothing
    kv.release(ids)


def test_preloaded_kv_becomes_the_requests(pool: BlockPool, kv: KvManager) -> None:
    req = Request("r", TOKENS, SamplingOptions(max_tokens=4), 18)
    ids = kv.reserve(10)
    kv.preload(req, PreloadedKV(tuple(ids), 10))
    assert req.block_ids == ids and req.num_computed_tokens == 10 and req.num_cached_tokens == 10
    assert req.cache_epoch == -1  # never shared via the prefix cache
    finish(pool, req)


def _recording(start: int) -> Request:
    routing = RoutingRecorder(start, 2, 2, np.dtype(np.uint8))
    return Request("r", TOKENS, SamplingOptions(max_tokens=4), 18, routing=routing)


def test_preloaded_kv_past_the_routing_frontier_is_cut_to_whole_blocks(pool: BlockPool, kv: KvManager) -> None:
    req = _recording(start=9)  # it must compute positions 9 on itself
    ids = kv.reserve(13)
    kv.preload(req, PreloadedKV(tuple(ids), 13, tuple(TOKENS[:13])))
    assert req.block_ids == ids[:2] and req.num_computed_tokens == 8 and pool.num_used == 2
    finish(pool, req)


def test_preloaded_kv_with_no_whole_block_before_the_frontier_is_all_freed(pool: BlockPool, kv: KvManager) -> None:
    req = _recording(start=3)
    ids = kv.reserve(13)
    kv.preload(req, PreloadedKV(tuple(ids), 13))
    assert req.block_ids == [] and req.num_computed_tokens == 0 and pool.num_used == 0


def test_blocks_of_a_request_aborted_during_a_forward_are_freed_once_it_ends(pool: BlockPool, kv: KvManager) -> None:
    req = computed(pool, "r", TOKENS, 13)
    kv.hold_while_written(req)  # no forward: the blocks stay for the scheduler to free
    assert len(req.block_ids) == 4
    kv.begin_forward()
    kv.hold_while_written(req)
    assert req.block_ids == [] and pool.num_used == 4
    kv.end_forward()
    assert pool.num_used == 0
    kv.end_forward()  # nothing held back: nothing freed twice
