"""Typed async client for the PSManager (PSRL's psrl.state.PSManagerState plus our PSManagerAdmin).

Every RPC takes and returns plain Python types. UNAVAILABLE and DEADLINE_EXCEEDED raise
`PSManagerUnavailable`; any other failure raises `PSManagerError` (its base class). The gRPC channel
reconnects by itself after the server comes back, with a short backoff, so one client lives as long as its
user; calls made while the server is away fail fast instead of waiting for it.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Sequence
from typing import Any, TypeVar

import grpc

from psrl._proto import psrl_manager_pb2 as pb
from psrl._proto import psrl_manager_pb2_grpc as pb_grpc
from psrl.psmanager.errors import PSManagerError, PSManagerUnavailable
from psrl.psmanager.state import RequestStatus, ReserveResult

__all__ = ["PSManagerClient", "PSManagerError", "PSManagerUnavailable", "ReserveResult"]

T = TypeVar("T")
Instance = tuple[str, int]  # (worker_id, dp_rank); the router's InstanceId NamedTuple fits

_UNAVAILABLE_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def _instance_msg(instance: Sequence[Any]) -> pb.RolloutInstanceId:
    worker_id, dp_rank = instance
    return pb.RolloutInstanceId(worker_id=str(worker_id), dp_rank=int(dp_rank))


class PSManagerClient:
    def __init__(
        self,
        address: str,
        timeout_s: float = 5.0,
        *,
        reconnect_backoff_ms: tuple[int, int] = (100, 1000),
    ) -> None:
        """`address` is "host:port" (a "grpc://" prefix is accepted); `timeout_s` bounds every call."""
        self.address = address.removeprefix("grpc://")
        self.timeout_s = timeout_s
        self._backoff_ms = reconnect_backoff_ms
        self._channel: grpc.aio.Channel | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._state: pb_grpc.PSManagerStateStub | None = None
        self._admin: pb_grpc.PSManagerAdminStub | None = None

    # ---- PSManagerState --------------------------------------------------------------------------------

    async def can_reserve(
        self,
        request_ids: Sequence[int],
        versions: Sequence[int],
        is_validate: bool | Sequence[bool] = False,
        *,
        without_new_reserve_entry: bool = False,
    ) -> list[list[bool]]:
        """rows[i][j]: request_ids[i] can be reserved on versions[j]."""
        flags = [is_validate] if isinstance(is_validate, bool) else list(is_validate)
        req = pb.CanReserveRequest(
            request_ids=list(request_ids),
            model_versions=list(versions),
            without_new_reserve_entry=without_new_reserve_entry,
            is_validate=flags,
        )
        resp = await self._call(self._state_stub().CanReserve(req, timeout=self.timeout_s))
        n = resp.n_versions
        results = list(resp.results)
        if n != len(versions) or len(results) != n * len(request_ids):
            raise PSManagerError(f"CanReserve answered {len(results)} results for {len(request_ids)}x{len(versions)}")
        return [results[i * n : (i + 1) * n] for i in range(len(request_ids))]

    async def reserve_indicators(
        self, request_id: int, versions: Sequence[int], is_validate: bool = False
    ) -> list[float]:
        """Per version: -inf fits an existing entry, -k a new entry in pending buffer k, +inf cannot."""
        req = pb.GetReserveIndicatorRequest(
            request_id=request_id, model_versions=list(versions), is_validate=is_validate
        )
        resp = await self._call(self._state_stub().GetReserveIndicator(req, timeout=self.timeout_s))
        return list(resp.indicators)

    async def reserve(
        self,
        instances: Sequence[Instance],
        request_ids: Sequence[int],
        versions: Sequence[int],
        is_validate: bool = False,
        *,
        guarantee_not_aborted: bool = False,
    ) -> ReserveResult:
        """Reserve requests on instances/versions (length-1 lists broadcast). A refusal is not an exception:
        it comes back as success=False with the reason."""
        req = pb.ReserveRolloutInstanceRequestsRequest(
            rollout_instance_ids=[_instance_msg(i) for i in instances],
            request_ids=list(request_ids),
            model_versions=list(versions),
            guarantee_not_aborted=guarantee_not_aborted,
            is_validate=is_validate,
        )
        resp = await self._call(self._state_stub().ReserveRolloutInstanceRequests(req, timeout=self.timeout_s))
        return ReserveResult(resp.success, list(resp.buffer_ids), list(resp.entry_ids), resp.error_message)

    async def update_request_instance(self, request_id: int, instance: Instance, is_validate: bool = False) -> bool:
        req = pb.UpdateRequestInstanceIdRequest(
            request_id=request_id, new_instance_id=_instance_msg(instance), is_validate=is_validate
        )
        resp = await self._call(self._state_stub().UpdateRequestInstanceId(req, timeout=self.timeout_s))
        return resp.success

    async def update_request_version_tag(
        self, request_id: int, new_version_tag: int, is_validate: bool = False
    ) -> bool:
        req = pb.UpdateRequestVersionTagRequest(
            request_id=request_id, new_version_tag=new_version_tag, is_validate=is_validate
        )
        resp = await self._call(self._state_stub().UpdateRequestVersionTag(req, timeout=self.timeout_s))
        return resp.success

    async def check_aborted_requests(self, request_ids: Sequence[int], remove: bool = False) -> list[bool]:
        req = pb.CheckAbortedRequestsRequest(request_ids=list(request_ids), remove=remove)
        resp = await self._call(self._state_stub().CheckAbortedRequests(req, timeout=self.timeout_s))
        return list(resp.is_aborted)

    async def check_aborted_model_versions(self, versions: Sequence[int]) -> list[bool]:
        req = pb.CheckAbortedModelVersionsRequest(model_versions=list(versions))
        resp = await self._call(self._state_stub().CheckAbortedModelVersions(req, timeout=self.timeout_s))
        return list(resp.is_aborted)

    async def get_instance_model_version(self, instance: Instance) -> int:
        """The instance's model version, -1 when unknown."""
        req = pb.GetRolloutInstanceModelVersionRequest(rollout_instance_id=_instance_msg(instance))
        resp = await self._call(self._state_stub().GetRolloutInstanceModelVersion(req, timeout=self.timeout_s))
        return resp.model_version

    async def update_request_status(
        self,
        request_ids: Sequence[int],
        status: str | RequestStatus,
        versions: Sequence[int] = (),
        instances: Sequence[Instance] = (),
        is_validate: bool = False,
    ) -> list[bool]:
        req = pb.UpdateRequestStatusRequest(
            request_ids=list(request_ids),
            status=str(status.value if isinstance(status, RequestStatus) else status),
            model_versions=list(versions),
            rollout_instance_ids=[_instance_msg(i) for i in instances],
            is_validate=is_validate,
        )
        resp = await self._call(self._state_stub().UpdateRequestStatus(req, timeout=self.timeout_s))
        return list(resp.succeeded)

    # ---- PSManagerAdmin --------------------------------------------------------------------------------

    async def abort_requests(self, request_ids: Sequence[int]) -> list[bool]:
        """Mark requests aborted; per request, whether it held a reservation."""
        req = pb.AbortRequestsRequest(request_ids=list(request_ids))
        resp = await self._call(self._admin_stub().AbortRequests(req, timeout=self.timeout_s))
        return list(resp.was_reserved)

    async def abort_model_version(self, version: int) -> list[int]:
        """Abort a version; returns the reserved requests that became aborted."""
        req = pb.AbortModelVersionRequest(model_version=version)
        resp = await self._call(self._admin_stub().AbortModelVersion(req, timeout=self.timeout_s))
        return list(resp.aborted_request_ids)

    async def set_instance_model_version(self, instance: Instance, version: int) -> int:
        """Record an instance's version; returns the latest version afterwards."""
        req = pb.SetRolloutInstanceModelVersionRequest(
            rollout_instance_id=_instance_msg(instance), model_version=version
        )
        resp = await self._call(self._admin_stub().SetRolloutInstanceModelVersion(req, timeout=self.timeout_s))
        return resp.latest_model_version

    async def consume_buffer(self, version: int, buffer_id: int, is_validate: bool = False) -> list[int]:
        """The trainer took a buffer; returns the request ids it released."""
        req = pb.ConsumeBufferRequest(model_version=version, buffer_id=buffer_id, is_validate=is_validate)
        resp = await self._call(self._admin_stub().ConsumeBuffer(req, timeout=self.timeout_s))
        return list(resp.released_request_ids)

    async def set_latest_version(self, version: int) -> int:
        req = pb.SetLatestModelVersionRequest(model_version=version)
        resp = await self._call(self._admin_stub().SetLatestModelVersion(req, timeout=self.timeout_s))
        return resp.latest_model_version

    async def snapshot(self) -> dict[str, Any]:
        """The server's whole bookkeeping (shape: `PSManagerState.snapshot`)."""
        resp = await self._call(self._admin_stub().GetSnapshot(pb.GetSnapshotRequest(), timeout=self.timeout_s))
        return json.loads(resp.state_json)

    # ---- plumbing --------------------------------------------------------------------------------------

    async def close(self) -> None:
        channel, self._channel = self._channel, None
        self._state = self._admin = None
        self._loop = None
        if channel is not None:
            await channel.close()

    async def __aenter__(self) -> PSManagerClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _ensure_channel(self) -> None:
        # A grpc.aio channel belongs to the loop it was made on: make it lazily, and again on a new loop.
        loop = asyncio.get_running_loop()
        if self._channel is not None and self._loop is loop:
            return
        initial_ms, max_ms = self._backoff_ms
        self._channel = grpc.aio.insecure_channel(
            self.address,
            options=[
                ("grpc.initial_reconnect_backoff_ms", initial_ms),
                ("grpc.min_reconnect_backoff_ms", initial_ms),
                ("grpc.max_reconnect_backoff_ms", max_ms),
            ],
        )
        self._loop = loop
        self._state = pb_grpc.PSManagerStateStub(self._channel)
        self._admin = pb_grpc.PSManagerAdminStub(self._channel)

    def _state_stub(self) -> pb_grpc.PSManagerStateStub:
        self._ensure_channel()
        assert self._state is not None
        return self._state

    def _admin_stub(self) -> pb_grpc.PSManagerAdminStub:
        self._ensure_channel()
        assert self._admin is not None
        return self._admin

    async def _call(self, call: Awaitable[T]) -> T:
        try:
            return await call
        except grpc.aio.AioRpcError as e:
            code = e.code()
            message = f"PSManager {self.address}: {code.name}: {e.details()}"
            if code in _UNAVAILABLE_CODES:
                raise PSManagerUnavailable(message, code) from e
            raise PSManagerError(message, code) from e
