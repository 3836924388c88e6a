"""Continuous-batching scheduler: which requests run this step, with how many tokens, and who is preempted.

Pure bookkeeping over requests and the block allocator (no tensors), in the spirit of vLLM v1: every
request simply has tokens whose K/V are not in the cache yet; a step computes up to the token budget of
them, so prefill, chunked prefill, recompute after preemption and decode are one code path.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from psrl.engine.kv_cache import BlockAllocator, blocks_for_tokens
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
        self, allocator: BlockAllocator, block_size: int, max_num_seqs: int, max_num_batched_tokens: int
    ) -> None:
        self.allocator = allocator
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order; the last one is preempted first
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, request: Request) -> None:
        """Remove a request (finished or aborted) wherever it is and free its blocks."""
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
            while need > self.allocator.num_free:
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                break
            req.block_ids.extend(self.allocator.allocate(need))
            chunks.append(ScheduledChunk(req, req.num_computed_tokens, n))
            budget -= n
            i += 1

        # No admissions in a step that had to preempt: the cache is already too tight.
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            n = min(req.num_uncomputed_tokens, budget)
            need = self._blocks_needed(req, n)
            if need > self.allocator.num_free:
                break
            self.waiting.popleft()
            req.block_ids.extend(self.allocator.allocate(need))
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            chunks.append(ScheduledChunk(req, req.num_computed_tokens, n))
            budget -= n
        return chunks

    def _blocks_needed(self, req: Request, num_new_tokens: int) -> int:
        total = blocks_for_tokens(req.num_computed_tokens + num_new_tokens, self.block_size)
        return max(0, total - len(req.block_ids))

    def _preempt(self, req: Request) -> None:
        """Preempt by recompute: drop its KV; it re-enters the queue first, with all its tokens so far."""
        self._free_blocks(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    def _free_blocks(self, req: Request) -> None:
        if req.block_ids:
            self.allocator.free(req.block_ids)
            req.block_ids = []
