"""consistent_hash: requests with the same routing key (x-smg-routing-key) go to the same instance.

A hash ring with virtual nodes over the candidates: when an instance leaves, only its keys move. Requests
without a key fall back to the least loaded candidate.
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Sequence

from psrl.router.policies.base import Policy, SelectionRequest
from psrl.router.registry import InstanceId, InstanceState

VIRTUAL_NODES = 64


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


class ConsistentHashPolicy(Policy):
    name = "consistent_hash"

    def __init__(self, virtual_nodes: int = VIRTUAL_NODES) -> None:
        self._virtual_nodes = virtual_nodes
        self._ring_for: tuple[InstanceId, ...] = ()
        self._points: list[int] = []
        self._owners: list[InstanceId] = []
        # The last candidates and their ids. Step 1 hands every request the same tuple until something that
        # decides availability changes, so a keyed request then costs no pass over the fleet.
        self._candidates: tuple[InstanceState, ...] = ()
        self._by_id: dict[InstanceId, InstanceState] = {}

    def _ring(self, ids: tuple[InstanceId, ...]) -> None:
        if ids == self._ring_for:
            return
        points = sorted((_hash(f"{i}#{v}"), i) for i in ids for v in range(self._virtual_nodes))
        self._points = [p for p, _ in points]
        self._owners = [i for _, i in points]
        self._ring_for = ids

    def select(self, candidates: Sequence[InstanceState], request: SelectionRequest) -> InstanceState:
        if not request.routing_key:
            return min(candidates, key=lambda c: c.load)
        if candidates is not self._candidates:
            by_id = {c.id: c for c in candidates}
            self._ring(tuple(sorted(by_id)))
            # a tuple cannot change under us; anything else is worked out again next time
            self._candidates, self._by_id = (candidates, by_id) if isinstance(candidates, tuple) else ((), by_id)
        at = bisect.bisect(self._points, _hash(request.routing_key)) % len(self._points)
        return self._by_id[self._owners[at]]
