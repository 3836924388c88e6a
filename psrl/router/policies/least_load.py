"""least_load (PSRL's request_num_balance): the candidate with the fewest queued requests.

Load is the larger of the router's own in-flight count and the engine's last report (update_stats or GetLoads
polling); ties go to the earlier candidate, so a sorted candidate list keeps its order of preference.
"""

from __future__ import annotations

from collections.abc import Sequence

from psrl.router.policies.base import Policy, SelectionRequest
from psrl.router.registry import InstanceState


class LeastLoadPolicy(Policy):
    name = "least_load"

    def select(self, candidates: Sequence[InstanceState], request: SelectionRequest) -> InstanceState:
        return min(candidates, key=lambda c: c.load)
