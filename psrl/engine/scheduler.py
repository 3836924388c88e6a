"""Continuous-batching scheduler: which requests run this step, with how many tokens, and who is preempted.

Pure bookkeeping over requests and the block allocator (no tensors), in the spirit of vLLM v1: every
request simply has tokens whose K/V are not in the cache yet; a step computes up to the token budget of
them, so prefill, chunked prefill, recompute after preemption and decode are one code path. With prefix
caching, admission first takes the longest run of cached full blocks of the request's tokens (never all of
them: the last token is always computed), and blocks become cached once their K/V are fully computed.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from psrl.engine.kv_cache import blocks_for_tokens
from psrl.engine.prefix_cache import BlockPool, extend_block_hashes
from psrl.engine.request import Request, RequestStatus


@dataclass
class ScheduledChunk:
    request: Request
    start: int  # first token position computed this step (= num_computed_tokens before the step)
    num_tokens: int

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the end of the request's tokens, so its last row yields a token."""
        return self.start + self.num_tokens == self.request.num_tokens


class Scheduler:
    def __init__(
        self,
        pool: BlockPool,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        drop_pin: Callable[[], bool] | None = None,
    ) -> None:
        self.pool = pool
        # Frees the oldest pinned KV (held for a migration peer), True if there was one: the first blocks given
        # back when the cache runs short.
        self.drop_pin = drop_pin
        self.block_size = pool.block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order; the last one is preempted first
        self.num_preemptions = 0
        # Prefix-cache hit rate, in tokens, over admissions (re-admissions after preemption included).
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, request: Request) -> None:
        """Remove a request (finished or aborted) wherever it is and free its blocks (a request still waiting
        for migrated KV is in no queue yet)."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        self._free_blocks(request)
        request.status = RequestStatus.FINISHED

    def schedule(self) -> list[ScheduledChunk]:
        budget = self.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        preempted = False

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_uncomputed_tokens, budget)
            need = self._blocks_needed(req, n)
            while need > self.pool.num_free:
                if self._reclaim(keep=None):
                    continue
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                break
            req.block_ids.extend(self.pool.allocate(need))
            chunks.append(ScheduledChunk(req, req.num_computed_tokens, n))
            budget -= n
            i += 1

        # No admissions in a step that had to preempt: the cache is already too tight.
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            if req.block_ids:
                # Migrated KV (PreloadedKV): its blocks and computed tokens came with it; nothing to look up.
                n = min(req.num_uncomputed_tokens, budget)
                need = self._blocks_needed(req, n)
                if need > self.pool.num_free:
                    if self._reclaim(keep=req):
                        continue
                    break
                self.waiting.popleft()
                req.block_ids.extend(self.pool.allocate(need))
            else:
                hits = self._cached_prefix(req)  # otherwise a waiting request holds no blocks, no computed tokens
                num_hit_tokens = len(hits) * self.block_size
                n = min(req.num_tokens - num_hit_tokens, budget)
                need = blocks_for_tokens(num_hit_tokens + n, self.block_size) - len(hits)
                if need + self.pool.num_evictable(hits) > self.pool.num_free:
                    if self._reclaim(keep=req):
                        continue
                    break
                self.waiting.popleft()
                self.pool.touch(hits)  # before allocate, which could otherwise evict them
                req.block_ids = hits + self.pool.allocate(need)
                req.num_computed_tokens = num_hit_tokens
                req.num_cached_blocks = len(hits)
                req.cache_epoch = self.pool.epoch
                if req.num_cached_tokens < 0:
                    req.num_cached_tokens = num_hit_tokens
                if self.pool.enable_caching:
                    self.prefix_cache_queries += req.num_tokens
                    self.prefix_cache_hits += num_hit_tokens
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            chunks.append(ScheduledChunk(req, req.num_computed_tokens, n))
            budget -= n
        return chunks

    def _cached_prefix(self, req: Request) -> list[int]:
        if not self.pool.enable_caching:
            return []
        # At most num_tokens - 1 tokens from the cache: the last one is computed to get logits (vLLM's rule);
        # fewer when the request records routed experts it has no row for yet.
        max_blocks = req.kv_reuse_limit // self.block_size
        extend_block_hashes(req.block_hashes, req.token_ids, self.block_size, max_blocks)
        return self.pool.cached_prefix(req.block_hashes[:max_blocks])

    def cache_computed_blocks(self, req: Request) -> None:
        """After a step: put the request's newly full, fully computed blocks in the prefix cache."""
        if not self.pool.enable_caching or req.cache_epoch != self.pool.epoch:
            return  # its KV predates a reset (maybe other weights): never shared
        num_full = req.num_computed_tokens // self.block_size
        if num_full <= req.num_cached_blocks:
            return
        extend_block_hashes(req.block_hashes, req.token_ids, self.block_size, num_full)
        self.pool.cache_blocks(req.block_ids, req.block_hashes, req.token_ids, req.num_cached_blocks, num_full)
        req.num_cached_blocks = num_full

    def _reclaim(self, keep: Request | None) -> bool:
        """Give back blocks nothing running needs: pinned KV first (oldest pin), then the migrated KV of the last
        waiting request other than `keep` (it is prefilled when its turn comes). True if something was freed;
        without this, waiting requests holding migrated KV could starve each other for good."""
        if self.drop_pin is not None and self.drop_pin():
            return True
        for req in reversed(self.waiting):
            if req is not keep and req.block_ids:
                self._free_blocks(req)
                req.num_computed_tokens = 0
                req.num_cached_tokens = -1  # measured again at its admission
                return True
        return False

    def _blocks_needed(self, req: Request, num_new_tokens: int) -> int:
        total = blocks_for_tokens(req.num_computed_tokens + num_new_tokens, self.block_size)
        return max(0, total - len(req.block_ids))

    def _preempt(self, req: Request) -> None:
        """Preempt by recompute: drop its KV; it re-enters the queue first, with all its tokens so far."""
        self._free_blocks(req)
        req.num_computed_tokens = 0
        req.num_cached_blocks = 0
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    def _free_blocks(self, req: Request) -> None:
        if req.block_ids:
            self.pool.free(req.block_ids)  # cached blocks stay cached until evicted
            req.block_ids = []
