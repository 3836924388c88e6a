"""cache_aware_v1: score candidates by the prompt blocks their engines report cached (KV events), per tier.

PSRL's "cache_aware_v1 with KV events" rule (docs/routing.md, Policies): score = gpu_w x gpu_blocks + lmc_w x
lmcache_blocks; the best positive score whose new (non-GPU-cached) tokens fit the instance's KV capacity wins, ties
to lower load then the emptier cache; no positive score -> shortest queue. Imbalance forces shortest queue first.
While the index knows nothing of the candidates, the approximate token tree of `CacheAwarePolicy` decides instead.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from psrl.router.config import CacheAwareConfig
from psrl.router.policies.base import Policy, SelectionRequest
from psrl.router.policies.cache_aware import CacheAwarePolicy, is_imbalanced, least_loaded
from psrl.router.policies.kv_index import KvEventIndex, PromptHashes, Tier
from psrl.router.registry import InstanceState

MAX_MODEL_LEN_LABEL = "max_model_len"


class CacheAwareV1Policy(Policy):
    name = "cache_aware_v1"
    needs_text = True  # the token-tree fallback matches on text
    kv_index: KvEventIndex

    def __init__(
        self,
        config: CacheAwareConfig | None = None,
        index: KvEventIndex | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config or CacheAwareConfig()
        self.kv_index = index if index is not None else KvEventIndex(self.config.block_size)
        self.approximate = CacheAwarePolicy(self.config, clock)  # the fallback without KV events

    @classmethod
    def from_settings(cls, cache_aware: CacheAwareConfig) -> Policy:
        return cls(cache_aware)

    def select(self, candidates: Sequence[InstanceState], request: SelectionRequest) -> InstanceState:
        if len(candidates) == 1:
            return candidates[0]
        if is_imbalanced(candidates, self.config):
            return least_loaded(candidates)
        prompt = request.prompt_ids
        if not prompt or not any(self.kv_index.has_blocks(c.id) for c in candidates):
            return self.approximate.select_by_prefix(candidates, request)
        return self.select_by_kv_events(candidates, prompt)

    def select_by_kv_events(self, candidates: Sequence[InstanceState], prompt: Sequence[int]) -> InstanceState:
        """The KV-event decision alone (no imbalance check, no fallback)."""
        gpu_w = self.config.gpu_overlap_weight
        lmc_w = self.config.lmcache_overlap_weight
        hashes = PromptHashes(prompt)
        ranked: list[tuple[float, int, int, int, int]] = []  # (-score, load, index size, position, gpu tokens)
        for position, c in enumerate(candidates):
            gpu_blocks, lmc_blocks = self.kv_index.score(c.id, hashes, gpu=gpu_w > 0, lmcache=lmc_w > 0)
            score = (gpu_w * gpu_blocks if gpu_w > 0 else 0.0) + (lmc_w * lmc_blocks if lmc_w > 0 else 0.0)
            if score > 0:
                gpu_tokens = min(len(prompt), gpu_blocks * self.kv_index.block_size(c.id, Tier.GPU))
                ranked.append((-score, c.load, self.kv_index.size_of(c.id), position, gpu_tokens))
        ranked.sort()
        for _, _, _, position, gpu_tokens in ranked:
            if self.admits(candidates[position], len(prompt) - gpu_tokens):
                return candidates[position]
        return least_loaded(candidates)

    def admits(self, instance: InstanceState, new_tokens: int) -> bool:
        """KV admission: the tokens to prefill fit in kv_capacity_threshold x capacity minus what is in use,
        capacity being the worker's max_model_len label (no label: no check)."""
        label = instance.worker.labels.get(MAX_MODEL_LEN_LABEL)
        if not label:
            return True
        try:
            capacity = float(label)
        except ValueError:
            return True
        free = (self.config.kv_capacity_threshold - instance.stats.kv_cache_usage) * capacity
        return new_tokens <= free

    def on_dispatched(self, instance: InstanceState, request: SelectionRequest) -> None:
        # The approximate tree stays warm so the fallback has something when events stop or never come.
        self.approximate.on_dispatched(instance, request)

    def on_worker_removed(self, worker_id: str) -> None:
        self.approximate.on_worker_removed(worker_id)
        self.kv_index.remove_worker(worker_id)

    def maybe_evict(self, now: float | None = None) -> bool:
        return self.approximate.maybe_evict(now)
