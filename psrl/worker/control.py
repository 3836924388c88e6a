"""`psrl.control.ReplicaControl` over the reference engines: the replica side of a weight sync.

Every call acts on all dp ranks together. A pause first closes admission on every rank, then applies its
mode on all ranks at once, and answers only when every rank is paused (no step in flight). Weight loads
build every rank's weights first and swap only if all of them built, so the ranks never disagree on the
version. Sync calls that change state run one at a time (a Resume sent during a WAIT pause lands after it);
GetSyncState never waits.
"""

from __future__ import annotations

import asyncio
import logging
from typing import NoReturn

import grpc

from psrl._proto import replica_control_pb2 as pb
from psrl._proto import replica_control_pb2_grpc as pb_grpc
from psrl.engine import AsyncEngine, PauseMode

logger = logging.getLogger(__name__)

PAUSE_MODES = {
    pb.PAUSE_MODE_ABORT: PauseMode.ABORT,
    pb.PAUSE_MODE_WAIT: PauseMode.WAIT,
    pb.PAUSE_MODE_KEEP: PauseMode.KEEP,
}
PAUSED_REASON = "generation is paused for a weight sync"


class ReplicaControlServicer(pb_grpc.ReplicaControlServicer):
    def __init__(self, engines: list[AsyncEngine]) -> None:
        if not engines:
            raise ValueError("at least one engine is required")
        self.engines = engines
        self._sync_lock = asyncio.Lock()
        self._failure_reason: str | None = None

    @property
    def weight_version(self) -> int:
        return self.engines[0].weight_version  # every call keeps the ranks on one version

    @property
    def paused(self) -> bool:
        return all(e.paused for e in self.engines)

    async def PauseGeneration(
        self, request: pb.PauseGenerationRequest, context: grpc.aio.ServicerContext
    ) -> pb.PauseGenerationResponse:
        mode = await pause_mode(request, context)
        async with self._sync_lock:
            reason = closed_reason(self._failure_reason)
            for engine in self.engines:  # no rank admits anything once any rank starts pausing
                engine.close_admission(reason)
            per_rank = await asyncio.gather(
                *(e.pause(mode, clear_cache=request.clear_cache, reason=reason) for e in self.engines)
            )
            aborted = [a.request_id for rank in per_rank for a in rank]
            logger.info("paused (%s): %d request(s) aborted", mode.value, len(aborted))
            return pb.PauseGenerationResponse(
                weight_version=self.weight_version, aborted_request_ids=aborted, paused=self.paused
            )

    async def LoadWeights(
        self, request: pb.LoadWeightsRequest, context: grpc.aio.ServicerContext
    ) -> pb.LoadWeightsResponse:
        which = request.WhichOneof("source")
        if which is None:
            await invalid_argument(context, "LoadWeights needs a source: seed or path")
        async with self._sync_lock:
            try:
                source = {"seed": request.seed} if which == "seed" else {"path": request.path}
                models = await asyncio.gather(*(e.prepare_weights(**source) for e in self.engines))
            except ValueError as e:  # WeightLoadError: missing, unreadable or mismatched weights
                await invalid_argument(context, str(e))
            await asyncio.gather(*(e.swap_weights(m, version=request.version) for e, m in zip(self.engines, models)))
            logger.info("loaded weights version %d from %s", request.version, which)
            return pb.LoadWeightsResponse(weight_version=self.weight_version)

    async def ResumeGeneration(
        self, request: pb.ResumeGenerationRequest, context: grpc.aio.ServicerContext
    ) -> pb.ResumeGenerationResponse:
        async with self._sync_lock:
            self._failure_reason = None
            for engine in self.engines:
                engine.resume()
            logger.info("resumed at weight version %d", self.weight_version)
            return pb.ResumeGenerationResponse(weight_version=self.weight_version, paused=False)

    async def GetSyncState(
        self, request: pb.GetSyncStateRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetSyncStateResponse:
        stats = [e.stats() for e in self.engines]
        closed = any(e.admission_closed_reason is not None for e in self.engines)
        admission = admission_state(self._failure_reason, closed)
        return pb.GetSyncStateResponse(
            paused=self.paused,
            weight_version=self.weight_version,
            running_requests=sum(s.num_running for s in stats),
            waiting_requests=sum(s.num_waiting for s in stats),
            admission=admission,
            failure_reason=self._failure_reason or "",
        )

    async def FailSync(self, request: pb.FailSyncRequest, context: grpc.aio.ServicerContext) -> pb.FailSyncResponse:
        # Not behind the sync lock: a failure must close admission even while a pause or load is under way.
        self._failure_reason = request.reason or "no reason given"
        for engine in self.engines:
            engine.close_admission(closed_reason(self._failure_reason))
        logger.warning("sync failed: %s", self._failure_reason)
        return pb.FailSyncResponse(weight_version=self.weight_version)


def admission_state(failure: str | None, closed: bool) -> pb.Admission:
    """GetSyncState's admission: FAILED after a failed sync, else PAUSED while admission is closed, else OPEN."""
    if failure is not None:
        return pb.ADMISSION_FAILED
    return pb.ADMISSION_PAUSED if closed else pb.ADMISSION_OPEN


def closed_reason(failure: str | None) -> str:
    """Why a Generate is refused while admission is closed: the pause, or the failed sync."""
    return PAUSED_REASON if failure is None else f"the weight sync failed: {failure}"


async def pause_mode(request: pb.PauseGenerationRequest, context: grpc.aio.ServicerContext) -> PauseMode:
    mode = PAUSE_MODES.get(request.mode)
    if mode is None:
        await invalid_argument(context, f"unknown pause mode {request.mode}")
    return mode


async def invalid_argument(context: grpc.aio.ServicerContext, message: str) -> NoReturn:
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)
    raise AssertionError("context.abort returned")  # it always raises
