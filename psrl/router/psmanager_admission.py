"""The selector's admission step and the commit/dispatch checks, backed by the PSManager (docs/routing.md).

- admit: for an unversioned request (version_tag -1), CanReserve over the candidates' distinct synced
  versions; only candidates whose version can take the request stay.
- indicators: GetReserveIndicator per version, for `candidate_sort_indicator=reserve_capability`.
- on_commit: Reserve(instance, request, synced version) for a fresh placement, UpdateRequestInstanceId for a
  request that carried an instance hint (a loop-back or a sticky turn).
- is_aborted: CheckAbortedRequests(remove=True) right before dispatch.
A PSManager that cannot be reached raises: in the routing loop the request then stays queued until it is back.
"""

from __future__ import annotations

from collections.abc import Sequence

from psrl.psmanager.client import PSManagerClient
from psrl.router.errors import RequestAborted
from psrl.router.metadata import RoutingMeta
from psrl.router.registry import InstanceState


class PlacementRefused(RuntimeError):
    """The PSManager would not record the placement (the request stays queued)."""


class PSManagerAdmission:
    def __init__(self, client: PSManagerClient) -> None:
        self.client = client

    @staticmethod
    def _versions(candidates: Sequence[InstanceState]) -> list[int]:
        return sorted({c.weight_version for c in candidates})

    async def admit(self, candidates: Sequence[InstanceState], meta: RoutingMeta) -> list[InstanceState]:
        if meta.version_tag >= 0 or meta.request_id is None:
            return list(candidates)
        versions = self._versions(candidates)
        rows = await self.client.can_reserve([meta.request_id], versions, meta.is_validate)
        reservable = {v for v, ok in zip(versions, rows[0]) if ok}
        admitted = [c for c in candidates if c.weight_version in reservable]
        if not admitted and (await self.client.check_aborted_requests([meta.request_id], remove=False))[0]:
            # Nothing will ever admit an aborted request: answer it now instead of queueing it forever.
            raise RequestAborted(f"request {meta.request_id} was aborted")
        return admitted

    async def indicators(self, candidates: Sequence[InstanceState], meta: RoutingMeta) -> list[float] | None:
        if meta.request_id is None:
            return None
        versions = self._versions(candidates)
        values = await self.client.reserve_indicators(meta.request_id, versions, meta.is_validate)
        by_version = dict(zip(versions, values))
        return [by_version[c.weight_version] for c in candidates]

    async def on_commit(self, instance: InstanceState, meta: RoutingMeta, pinned_version: int) -> None:
        if meta.request_id is None:
            return
        if meta.hint is not None:
            await self.client.update_request_instance(meta.request_id, instance.id, meta.is_validate)
            return
        result = await self.client.reserve(
            [instance.id], [meta.request_id], [instance.weight_version], meta.is_validate
        )
        if not result.success:
            raise PlacementRefused(f"PSManager refused to reserve request {meta.request_id}: {result.error_message}")

    async def is_aborted(self, meta: RoutingMeta) -> bool:
        if meta.request_id is None:
            return False
        return (await self.client.check_aborted_requests([meta.request_id], remove=True))[0]

    async def close(self) -> None:
        await self.client.close()
