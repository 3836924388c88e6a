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

# Policy name -> "module:class"; each class builds itself from the settings (Policy.from_settings).
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


def make_policy(name: str, cache_aware: CacheAwareConfig | None = None) -> Policy:
    target = _REGISTRY.get(name)
    if target is None:
        raise ValueError(f"unknown policy {name!r}")
    from psrl.router.config import CacheAwareConfig

    module, cls_name = target.split(":")
    cls: type[Policy] = getattr(importlib.import_module(module), cls_name)
    return cls.from_settings(cache_aware or CacheAwareConfig())


__all__ = ["POLICIES", "POLICY_ALIASES", "make_policy"]
