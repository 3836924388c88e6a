"""power_of_two: sample two candidates at random and take the less loaded one."""

from __future__ import annotations

import random
from collections.abc import Sequence

from psrl.router.policies.base import Policy, SelectionRequest
from psrl.router.registry import InstanceState


class PowerOfTwoPolicy(Policy):
    name = "power_of_two"

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def select(self, candidates: Sequence[InstanceState], request: SelectionRequest) -> InstanceState:
        if len(candidates) == 1:
            return candidates[0]
        a, b = self._rng.sample(range(len(candidates)), 2)
        return candidates[a] if candidates[a].load <= candidates[b].load else candidates[b]
