"""The engine's KV manager: the blocks of the pool that KV migration holds, beside those running requests hold.

In the spirit of vLLM v1's KVCacheManager, it sits between the engine and the BlockPool and owns:
- pins: a request's computed KV kept for a peer to pull (after a sync abort, or while it still runs), until
  unpinned, adopted by the request coming back, dropped when the cache runs short (oldest first), or expired;
- leases: an extra reference on blocks a transfer reads, until released;
- reservations: fresh blocks for incoming migrated KV, and that KV handed to a request (PreloadedKV);
- frees held back while a forward may still write the blocks of an aborted request.

Pure bookkeeping like the pool, with no lock of its own: the engine calls it under its lock.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from psrl.engine.kv_cache import blocks_for_tokens
from psrl.engine.prefix_cache import BlockPool
from psrl.engine.request import Request
from psrl.engine.sync import KvLease, KvSource, PreloadedKV, common_prefix


@dataclass(frozen=True)
class _Pin:
    token_ids: tuple[int, ...]  # the tokens whose K/V the blocks hold
    block_ids: tuple[int, ...]
    expires_at: float  # on the manager's clock


class KvManager:
    """The KV migration state over one BlockPool (shared with the scheduler, which owns the requests' blocks)."""

    def __init__(self, pool: BlockPool, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.pool = pool
        self.block_size = pool.block_size
        self._clock = clock
        self._pins: dict[str, _Pin] = {}  # oldest first
        self._next_pin_expiry = math.inf  # no pin expires before this (on `clock`)
        # Whether a forward is writing the blocks of the requests it runs, and the blocks of those aborted
        # meanwhile: freed only once it has ended, so that reserve() never hands out a block being written.
        self._forward_in_flight = False
        self._deferred_free: list[int] = []

    # ---- pins -----------------------------------------------------------------------------------

    @property
    def num_pinned(self) -> int:
        return len(self._pins)

    def pin(self, req: Request, ttl_s: float) -> int:
        """Pin the request's computed KV for `ttl_s` seconds (replacing its earlier pin); returns the tokens pinned."""
        n = req.num_computed_tokens
        if n == 0:
            return 0
        ids = req.block_ids[: blocks_for_tokens(n, self.block_size)]
        self.unpin(req.request_id)
        self.pool.touch(ids)
        expires_at = self._clock() + ttl_s
        self._pins[req.request_id] = _Pin(tuple(req.token_ids[:n]), tuple(ids), expires_at)
        self._next_pin_expiry = min(self._next_pin_expiry, expires_at)
        return n

    def unpin(self, request_id: str) -> bool:
        """Free the request's pinned blocks; False when it has no pin."""
        pin = self._pins.pop(request_id, None)
        if pin is None:
            return False
        self.pool.free(pin.block_ids)
        return True

    def drop_oldest_pin(self) -> bool:
        """Free the oldest pin (the first blocks given back when the cache runs short); False when there is none."""
        if not self._pins:
            return False
        return self.unpin(next(iter(self._pins)))

    def expire_pins(self) -> None:
        """Free every pin whose TTL has passed."""
        if not self._pins:
            return
        now = self._clock()
        if now < self._next_pin_expiry:
            return
        for request_id in [r for r, p in self._pins.items() if p.expires_at <= now]:
            self.unpin(request_id)
        self._next_pin_expiry = min((p.expires_at for p in self._pins.values()), default=math.inf)

    # ---- leases, adoption, reservations ---------------------------------------------------------

    def lease(self, request_id: str, token_ids: Sequence[int], *, allow_prefix_cache: bool) -> KvLease | None:
        """Blocks holding the K/V of the longest prefix of `token_ids` that the request's pin holds (or, with
        `allow_prefix_cache` and no pin, the prefix cache's full blocks), each with an extra reference."""
        self.expire_pins()
        pin = self._pins.get(request_id)
        if pin is None:
            return self.lease_cached_prefix(token_ids) if allow_prefix_cache else None
        n = common_prefix(pin.token_ids, token_ids)
        if n == 0:
            return None
        ids = pin.block_ids[: blocks_for_tokens(n, self.block_size)]
        self.pool.touch(ids)
        return KvLease(n, tuple(ids), KvSource.PIN)

    def lease_cached_prefix(self, token_ids: Sequence[int]) -> KvLease | None:
        """The full blocks of `token_ids` the prefix cache holds, with a reference each."""
        ids = self.pool.cached_prefix_of(token_ids)
        if not ids:
            return None
        self.pool.touch(ids)
        return KvLease(len(ids) * self.block_size, tuple(ids), KvSource.PREFIX_CACHE)

    def adopt_pin(self, request_id: str, token_ids: Sequence[int], max_tokens: int) -> PreloadedKV | None:
        """End the request's pin, keeping its blocks of the longest common prefix with `token_ids` (at most
        `max_tokens`) as KV for the request's next iteration; the other blocks are freed."""
        self.expire_pins()
        pin = self._pins.pop(request_id, None)
        if pin is None:
            return None
        block_size = self.block_size
        n = min(common_prefix(pin.token_ids, token_ids), max_tokens)
        if n % block_size:
            # The request will write its tokens from n on into the last kept block: only if nobody else
            # reads that block (the prefix cache, or a request still running after PinKv).
            last = pin.block_ids[n // block_size]
            if self.pool.is_cached(last) or self.pool.ref_count(last) > 1:
                n -= n % block_size
        keep = blocks_for_tokens(n, block_size)
        self.pool.free(pin.block_ids[keep:])
        if n == 0:
            return None
        return PreloadedKV(pin.block_ids[:keep], n, tuple(token_ids[:n]))

    def reserve(self, num_tokens: int) -> list[int]:
        """Fresh blocks for `num_tokens` incoming migrated tokens (OutOfBlocks when the pool cannot spare them)."""
        return self.pool.allocate(blocks_for_tokens(num_tokens, self.block_size))

    def release(self, block_ids: Sequence[int]) -> None:
        """Drop the reference a lease or a reservation took."""
        self.pool.free(block_ids)

    def preload(self, request: Request, kv: PreloadedKV) -> None:
        """Hand migrated KV (checked to fit the request) to a request: its blocks become the request's. Blocks
        covering positions whose routing the request must compute itself are freed instead."""
        limit = request.kv_reuse_limit
        if kv.num_tokens > limit:
            # Routing to report for positions the KV covers: keep the whole blocks before them, compute the rest.
            keep = limit // self.block_size
            self.pool.free(kv.block_ids[keep:])
            if keep == 0:
                return
            n = keep * self.block_size
            kv = PreloadedKV(kv.block_ids[:keep], n, None if kv.token_ids is None else kv.token_ids[:n])
        request.block_ids = list(kv.block_ids)
        request.num_computed_tokens = kv.num_tokens
        request.num_cached_tokens = kv.num_tokens  # reported like a prefix-cache hit: not prefilled here
        request.cache_epoch = -1  # computed elsewhere (maybe under other weights): never shared via the cache

    # ---- the forward in flight ------------------------------------------------------------------

    def begin_forward(self) -> None:
        self._forward_in_flight = True

    def end_forward(self) -> None:
        """The forward ended: free the blocks of requests aborted while it ran."""
        self._forward_in_flight = False
        if self._deferred_free:
            self.pool.free(self._deferred_free)
            self._deferred_free = []

    def hold_while_written(self, request: Request) -> None:
        """An aborted request's blocks: while a forward is in flight, take them from it to free once the forward
        ends; otherwise leave them for the scheduler to free now."""
        if self._forward_in_flight:
            self._deferred_free += request.block_ids
            request.block_ids = []
