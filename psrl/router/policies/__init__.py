"""Routing policies: each one small module behind the `Policy` interface, named in one registry.

Importing this package loads no policy (the config reads the names from here); `make_policy` imports the one
it builds.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from psrl.router.config import CacheAwareConfig
    from psrl.router.policies.base import Policy
    from psrl.router.policies.kv_index import KvEventIndex

# Policy name -> "module:class". The cache_aware ones take the cache_aware settings (and v1 the KV-event index).
_REGISTRY = {
    "round_robin": "psrl.router.policies.round_robin:RoundRobinPolicy",
    "random": "psrl.router.policies.random_choice:RandomPolicy",
    "power_of_two": "psrl.router.policies.power_of_two:PowerOfTwoPolicy",
    "least_load": "psrl.router.policies.least_load:LeastLoadPolicy",
    "consistent_hash": "psrl.router.policies.consistent_hash:ConsistentHashPolicy",
    "cache_aware": "psrl.router.policies.cache_aware:CacheAwarePolicy",
    "cache_aware_v1": "psrl.router.policies.cache_aware_v1:CacheAwareV1Policy",
}
POLICIES = tuple(_REGISTRY)
# PSRL's routing_strategy.method names for the same policies.
POLICY_ALIASES = {"request_num_balance": "least_load"}


def make_policy(name: str, cache_aware: CacheAwareConfig | None = None, kv_index: KvEventIndex | None = None) -> Policy:
    target = _REGISTRY.get(name)
    if target is None:
        raise ValueError(f"unknown policy {name!r}")
    module, cls_name = target.split(":")
    cls = getattr(importlib.import_module(module), cls_name)
    if name in ("cache_aware", "cache_aware_v1"):
        from psrl.router.config import CacheAwareConfig

        config = cache_aware or CacheAwareConfig()
        return cls(config, kv_index) if name == "cache_aware_v1" else cls(config)
    return cls()


__all__ = ["POLICIES", "POLICY_ALIASES", "make_policy"]
