"""Routing policies: each one small module behind the `Policy` interface."""

from psrl.router.policies.base import Policy, SelectionRequest
from psrl.router.policies.round_robin import RoundRobinPolicy


def make_policy(name: str) -> Policy:
    if name == "round_robin":
        return RoundRobinPolicy()
    raise ValueError(f"unknown policy {name!r}")


__all__ = ["Policy", "RoundRobinPolicy", "SelectionRequest", "make_policy"]
