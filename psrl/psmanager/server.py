"""The PSManager gRPC service (`psrl.state.PSManagerState` plus our `psrl.state.PSManagerAdmin`) and its CLI.

A thin shell: each RPC converts the message, calls `PSManagerState` and converts back. Bad arguments (and bytes
that are not the request message) answer INVALID_ARGUMENT, an unknown buffer NOT_FOUND, anything else INTERNAL
with the error's message.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
from collections.abc import Callable
from typing import Any, TypeVar

import grpc

from psrl._proto import psrl_manager_pb2 as pb
from psrl._proto import psrl_manager_pb2_grpc as pb_grpc
from psrl.grpc_decode import RequestDecodeInterceptor
from psrl.psmanager.config import ServerArgs, parse_args
from psrl.psmanager.errors import InvalidArgument, UnknownBuffer
from psrl.psmanager.state import InstanceKey, PSManagerState

logger = logging.getLogger("psrl.psmanager")
T = TypeVar("T")

READY_PREFIX = "PSRL_PSMANAGER_READY"


def _instance(msg: pb.RolloutInstanceId) -> InstanceKey:
    return (msg.worker_id, msg.dp_rank)


async def _guarded(context: grpc.aio.ServicerContext, rpc: str, fn: Callable[[], T]) -> T:
    """Run one bookkeeping call, mapping its errors to status codes once."""
    try:
        return fn()
    except InvalidArgument as e:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
    except UnknownBuffer as e:
        await context.abort(grpc.StatusCode.NOT_FOUND, str(e.args[0]) if e.args else str(e))
    except Exception as e:
        logger.exception("%s failed", rpc)
        await context.abort(grpc.StatusCode.INTERNAL, f"{rpc} failed: {type(e).__name__}: {e}")
    raise AssertionError("unreachable: context.abort raises")


class StateServicer(pb_grpc.PSManagerStateServicer):
    """PSRL's psrl.state.PSManagerState, the service the router's selector calls."""

    def __init__(self, state: PSManagerState) -> None:
        self.state = state

    async def CanReserve(self, request: pb.CanReserveRequest, context: Any) -> pb.CanReserveResponse:
        def run() -> pb.CanReserveResponse:
            rows = self.state.can_reserve(
                list(request.request_ids),
                list(request.model_versions),
                without_new_reserve_entry=request.without_new_reserve_entry,
                is_validate=list(request.is_validate),
            )
            return pb.CanReserveResponse(
                results=[flag for row in rows for flag in row], n_versions=len(request.model_versions)
            )

        return await _guarded(context, "CanReserve", run)

    async def GetReserveIndicator(
        self, request: pb.GetReserveIndicatorRequest, context: Any
    ) -> pb.GetReserveIndicatorResponse:
        def run() -> pb.GetReserveIndicatorResponse:
            indicators = self.state.reserve_indicators(
                request.request_id, list(request.model_versions), is_validate=request.is_validate
            )
            return pb.GetReserveIndicatorResponse(indicators=indicators)

        return await _guarded(context, "GetReserveIndicator", run)

    async def ReserveRolloutInstanceRequests(
        self, request: pb.ReserveRolloutInstanceRequestsRequest, context: Any
    ) -> pb.ReserveRolloutInstanceRequestsResponse:
        def run() -> pb.ReserveRolloutInstanceRequestsResponse:
            result = self.state.reserve(
                [_instance(i) for i in request.rollout_instance_ids],
                list(request.request_ids),
                list(request.model_versions),
                guarantee_not_aborted=request.guarantee_not_aborted,
                is_validate=request.is_validate,
            )
            if not result.success:
                logger.info("reserve refused: %s", result.error_message)
            return pb.ReserveRolloutInstanceRequestsResponse(
                success=result.success,
                buffer_ids=result.buffer_ids,
                entry_ids=result.entry_ids,
                error_message=result.error_message,
            )

        return await _guarded(context, "ReserveRolloutInstanceRequests", run)

    async def UpdateRequestInstanceId(
        self, request: pb.UpdateRequestInstanceIdRequest, context: Any
    ) -> pb.UpdateRequestInstanceIdResponse:
        def run() -> pb.UpdateRequestInstanceIdResponse:
            if not request.HasField("new_instance_id") or not request.new_instance_id.worker_id:
                raise InvalidArgument("new_instance_id.worker_id is required")
            ok = self.state.update_request_instance(
                request.request_id, _instance(request.new_instance_id), is_validate=request.is_validate
            )
            return pb.UpdateRequestInstanceIdResponse(success=ok)

        return await _guarded(context, "UpdateRequestInstanceId", run)

    async def UpdateRequestVersionTag(
        self, request: pb.UpdateRequestVersionTagRequest, context: Any
    ) -> pb.UpdateRequestVersionTagResponse:
        def run() -> pb.UpdateRequestVersionTagResponse:
            ok = self.state.update_request_version_tag(
                request.request_id, request.new_version_tag, is_validate=request.is_validate
            )
            return pb.UpdateRequestVersionTagResponse(success=ok)

        return await _guarded(context, "UpdateRequestVersionTag", run)

    async def CheckAbortedRequests(
        self, request: pb.CheckAbortedRequestsRequest, context: Any
    ) -> pb.CheckAbortedRequestsResponse:
        def run() -> pb.CheckAbortedRequestsResponse:
            flags = self.state.check_aborted_requests(list(request.request_ids), remove=request.remove)
            return pb.CheckAbortedRequestsResponse(is_aborted=flags)

        return await _guarded(context, "CheckAbortedRequests", run)

    async def CheckAbortedModelVersions(
        self, request: pb.CheckAbortedModelVersionsRequest, context: Any
    ) -> pb.CheckAbortedModelVersionsResponse:
        def run() -> pb.CheckAbortedModelVersionsResponse:
            flags = self.state.check_aborted_model_versions(list(request.model_versions))
            return pb.CheckAbortedModelVersionsResponse(is_aborted=flags)

        return await _guarded(context, "CheckAbortedModelVersions", run)

    async def GetRolloutInstanceModelVersion(
        self, request: pb.GetRolloutInstanceModelVersionRequest, context: Any
    ) -> pb.GetRolloutInstanceModelVersionResponse:
        def run() -> pb.GetRolloutInstanceModelVersionResponse:
            version = self.state.instance_model_version(_instance(request.rollout_instance_id))
            return pb.GetRolloutInstanceModelVersionResponse(model_version=version)

        return await _guarded(context, "GetRolloutInstanceModelVersion", run)

    async def UpdateRequestStatus(
        self, request: pb.UpdateRequestStatusRequest, context: Any
    ) -> pb.UpdateRequestStatusResponse:
        def run() -> pb.UpdateRequestStatusResponse:
            succeeded = self.state.update_request_status(
                list(request.request_ids),
                request.status,
                model_versions=list(request.model_versions),
                instances=[_instance(i) for i in request.rollout_instance_ids],
                is_validate=request.is_validate,
            )
            return pb.UpdateRequestStatusResponse(succeeded=succeeded)

        return await _guarded(context, "UpdateRequestStatus", run)


class AdminServicer(pb_grpc.PSManagerAdminServicer):
    """Our psrl.state.PSManagerAdmin: what the trainer (and tests) use to drive the bookkeeping."""

    def __init__(self, state: PSManagerState) -> None:
        self.state = state

    async def AbortRequests(self, request: pb.AbortRequestsRequest, context: Any) -> pb.AbortRequestsResponse:
        def run() -> pb.AbortRequestsResponse:
            was_reserved = self.state.abort_requests(list(request.request_ids))
            logger.info("aborted %d request(s)", len(was_reserved))
            return pb.AbortRequestsResponse(was_reserved=was_reserved)

        return await _guarded(context, "AbortRequests", run)

    async def AbortModelVersion(
        self, request: pb.AbortModelVersionRequest, context: Any
    ) -> pb.AbortModelVersionResponse:
        def run() -> pb.AbortModelVersionResponse:
            ids = self.state.abort_model_version(request.model_version)
            logger.info("aborted model version %d (%d reserved request(s))", request.model_version, len(ids))
            return pb.AbortModelVersionResponse(aborted_request_ids=ids)

        return await _guarded(context, "AbortModelVersion", run)

    async def SetRolloutInstanceModelVersion(
        self, request: pb.SetRolloutInstanceModelVersionRequest, context: Any
    ) -> pb.SetRolloutInstanceModelVersionResponse:
        def run() -> pb.SetRolloutInstanceModelVersionResponse:
            if not request.rollout_instance_id.worker_id:
                raise InvalidArgument("rollout_instance_id.worker_id is required")
            self.state.set_instance_model_version(_instance(request.rollout_instance_id), request.model_version)
            return pb.SetRolloutInstanceModelVersionResponse(latest_model_version=self.state.latest_version)

        return await _guarded(context, "SetRolloutInstanceModelVersion", run)

    async def ConsumeBuffer(self, request: pb.ConsumeBufferRequest, context: Any) -> pb.ConsumeBufferResponse:
        def run() -> pb.ConsumeBufferResponse:
            ids = self.state.consume_buffer(request.model_version, request.buffer_id, is_validate=request.is_validate)
            logger.info(
                "consumed buffer %d of version %d (%d request(s))", request.buffer_id, request.model_version, len(ids)
            )
            return pb.ConsumeBufferResponse(released_request_ids=ids)

        return await _guarded(context, "ConsumeBuffer", run)

    async def SetLatestModelVersion(
        self, request: pb.SetLatestModelVersionRequest, context: Any
    ) -> pb.SetLatestModelVersionResponse:
        def run() -> pb.SetLatestModelVersionResponse:
            self.state.set_latest_version(request.model_version)
            return pb.SetLatestModelVersionResponse(latest_model_version=self.state.latest_version)

        return await _guarded(context, "SetLatestModelVersion", run)

    async def GetSnapshot(self, request: pb.GetSnapshotRequest, context: Any) -> pb.GetSnapshotResponse:
        def run() -> pb.GetSnapshotResponse:
            return pb.GetSnapshotResponse(state_json=json.dumps(self.state.snapshot()))

        return await _guarded(context, "GetSnapshot", run)


def build_server(state: PSManagerState) -> grpc.aio.Server:
    # Requests that do not parse answer INVALID_ARGUMENT, not grpc's UNKNOWN (psrl.grpc_decode).
    server = grpc.aio.server(interceptors=[RequestDecodeInterceptor()])
    pb_grpc.add_PSManagerStateServicer_to_server(StateServicer(state), server)
    pb_grpc.add_PSManagerAdminServicer_to_server(AdminServicer(state), server)
    return server


async def serve(args: ServerArgs) -> None:
    state = PSManagerState(args.config())
    server = build_server(state)
    port = server.add_insecure_port(f"{args.host}:{args.port}")
    if port == 0:
        raise OSError(f"cannot bind {args.host}:{args.port}")
    await server.start()
    # One parseable line for launchers that passed --port 0; logs go to stderr.
    print(f"{READY_PREFIX} {args.host}:{port}", flush=True)
    logger.info("PSManager serving on %s:%d with %s", args.host, port, state.config)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    logger.info("shutting down")
    await server.stop(grace=1.0)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(serve(args))
