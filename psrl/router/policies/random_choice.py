"""random: a uniformly random candidate."""

from __future__ import annotations

import random
from collections.abc import Sequence

from psrl.router.policies.base import Policy, SelectionRequest
from psrl.router.registry import InstanceState


class RandomPolicy(Policy):
    name = "random"

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def select(self, candidates: Sequence[InstanceState], request: SelectionRequest) -> InstanceState:
        return self._rng.choice(candidates)
