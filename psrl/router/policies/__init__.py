"""Routing policies: each one small module behind the `Policy` interface."""

from __future__ import annotations

from psrl.router.policies.base import Policy, SelectionRequest, StatelessPolicy
from psrl.router.policies.cache_aware import CacheAwareConfig, CacheAwarePolicy
from psrl.router.policies.cache_aware_v1 import CacheAwareV1Policy
from psrl.router.policies.consistent_hash import ConsistentHashPolicy
from psrl.router.policies.kv_index import KvEventIndex
from psrl.router.policies.least_load import LeastLoadPolicy
from psrl.router.policies.power_of_two import PowerOfTwoPolicy
from psrl.router.policies.random_choice import RandomPolicy
from psrl.router.policies.round_robin import RoundRobinPolicy


def make_policy(name: str, cache_aware: CacheAwareConfig | None = None, kv_index: KvEventIndex | None = None) -> Policy:
    simple: dict[str, type[Policy]] = {
        "round_robin": RoundRobinPolicy,
        "random": RandomPolicy,
        "power_of_two": PowerOfTwoPolicy,
        "least_load": LeastLoadPolicy,
        "consistent_hash": ConsistentHashPolicy,
    }
    if name in simple:
        return simple[name]()
    if name == "cache_aware":
        return CacheAwarePolicy(cache_aware or CacheAwareConfig())
    if name == "cache_aware_v1":
        return CacheAwareV1Policy(cache_aware or CacheAwareConfig(), kv_index)
    raise ValueError(f"unknown policy {name!r}")


__all__ = [
    "CacheAwareConfig",
    "CacheAwarePolicy",
    "CacheAwareV1Policy",
    "ConsistentHashPolicy",
    "KvEventIndex",
    "LeastLoadPolicy",
    "Policy",
    "PowerOfTwoPolicy",
    "RandomPolicy",
    "RoundRobinPolicy",
    "SelectionRequest",
    "StatelessPolicy",
    "make_policy",
]
