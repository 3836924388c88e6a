"""round_robin: each request goes to the next candidate in turn."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from psrl.router.policies.base import Policy, SelectionRequest
from psrl.router.registry import InstanceState


class RoundRobinPolicy(Policy):
    name = "round_robin"

    def __init__(self) -> None:
        self._counter = itertools.count()

    def select(self, candidates: Sequence[InstanceState], request: SelectionRequest) -> InstanceState:
        return candidates[next(self._counter) % len(candidates)]
