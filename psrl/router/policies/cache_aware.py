"""cache_aware: send a request where its prompt prefix is most likely cached, unless the load is imbalanced.

SGLang's / SMG's cache_aware semantics over the router's own approximate tree (`RadixTree`, one per model):
when loads are imbalanced take the shortest queue; otherwise the candidate with the longest prefix match if
the match rate beats `cache_threshold`, else the candidate with the smallest tree (the most free cache).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from psrl.router.config import CacheAwareConfig
from psrl.router.policies.base import Policy, SelectionRequest
from psrl.router.policies.radix_tree import RadixTree
from psrl.router.registry import InstanceState


def is_imbalanced(candidates: Sequence[InstanceState], config: CacheAwareConfig) -> bool:
    """The shortest-queue override: request counts spread too far (absolute and relative), one instance's KV
    usage over the overload threshold, or KV usage spread too far."""
    loads = [c.load for c in candidates]
    lo, hi = min(loads), max(loads)
    if hi - lo > config.balance_abs_threshold and hi > config.balance_rel_threshold * lo:
        return True
    usage = [c.stats.kv_cache_usage for c in candidates]
    lo_u, hi_u = min(usage), max(usage)
    return hi_u > config.overload_token_usage_threshold or hi_u - lo_u > config.balance_token_usage_threshold


def least_loaded(candidates: Sequence[InstanceState]) -> InstanceState:
    """Shortest queue; ties go to the earlier candidate."""
    return min(candidates, key=lambda c: c.load)


class CacheAwarePolicy(Policy):
    name = "cache_aware"
    needs_text = True

    def __init__(self, config: CacheAwareConfig | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config or CacheAwareConfig()
        self._clock = clock
        # One tree per model and key kind: token ids and text bytes are different alphabets.
        self._trees: dict[tuple[str | None, bool], RadixTree] = {}
        self._last_eviction = clock()

    def tree(self, request: SelectionRequest) -> RadixTree:
        """The tree a request matches against (created on first use)."""
        slot = (request.model, not request.prompt_ids)
        tree = self._trees.get(slot)
        if tree is None:
            tree = self._trees[slot] = RadixTree(self._clock)
        return tree

    @classmethod
    def from_settings(cls, cache_aware: CacheAwareConfig) -> Policy:
        return cls(cache_aware)

    def select(self, candidates: Sequence[InstanceState], request: SelectionRequest) -> InstanceState:
        if len(candidates) == 1:
            return candidates[0]
        if is_imbalanced(candidates, self.config):
            return least_loaded(candidates)
        return self.select_by_prefix(candidates, request)

    def select_by_prefix(self, candidates: Sequence[InstanceState], request: SelectionRequest) -> InstanceState:
        """The tree decision alone (no imbalance check): best match if its rate beats cache_threshold, else the
        candidate with the smallest tree; ties go to lower load."""
        key = request.prefix_key()
        tree = self.tree(request)
        if key:
            matched = tree.match(key)
            if matched:
                best = min(candidates, key=lambda c: (-matched.get(c.id, 0), c.load))
                if matched.get(best.id, 0) / len(key) > self.config.cache_threshold:
                    return best
        return min(candidates, key=lambda c: (tree.size_of(c.id), c.load))

    def on_dispatched(self, instance: InstanceState, request: SelectionRequest) -> None:
        key = request.prefix_key()
        if key:
            now = self._clock()
            self.tree(request).insert(key, instance.id, now)
            self.maybe_evict(now)

    def on_worker_removed(self, worker_id: str) -> None:
        for tree in self._trees.values():
            tree.remove_worker(worker_id)

    def maybe_evict(self, now: float | None = None) -> bool:
        """Trim every instance to max_tree_size tokens per tree, at most once per eviction_interval_secs
        (on_dispatched calls it too)."""
        now = self._clock() if now is None else now
        if now - self._last_eviction < self.config.eviction_interval_secs:
            return False
        self._last_eviction = now
        for tree in self._trees.values():
            tree.evict(self.config.max_tree_size)
        return True
