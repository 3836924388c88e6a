"""`psrl.control.ReplicaControl` over vLLM's AsyncLLM: the replica side of a weight sync on a real vLLM engine.

PauseGeneration closes admission (a new Generate gets the empty "abort" frame) and calls
`AsyncLLM.pause_generation(mode, clear_cache)`; vLLM's own abort ends each running request's stream with an
"abort" frame carrying its tokens, exactly as the stock servicer ends it, so the router's partial rollout needs
nothing new. LoadWeights reloads a checkpoint in place on every worker (`reload_weights`, vLLM's weight-update
path) and resets the prefix cache. State-changing calls run one at a time; GetSyncState never waits.
"""

from __future__ import annotations

import asyncio
import logging
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc

from psrl._proto import replica_control_pb2 as pb
from psrl._proto import replica_control_pb2_grpc as pb_grpc
from psrl.engine import PauseMode
from psrl.worker.admission import AdmissionGate
from psrl.worker.control import admission_state, closed_reason, invalid_argument, pause_mode

logger = logging.getLogger(__name__)

# How long a pause waits for the streams vLLM aborted to deliver their last frame (they come out of the engine
# before pause_generation returns, but through the output handler's tasks).
ABORT_DELIVERY_S = 5.0


def checkpoint_dir(path: str, scratch: Path) -> Path:
    """The folder vLLM reloads from: `path` itself, or for a single safetensors file a folder in `scratch`
    holding only a link to it (vLLM's loader reads every `*.safetensors` of a folder)."""
    p = Path(path)
    if p.is_dir():
        return p
    if not p.is_file():
        raise FileNotFoundError(f"no such weights file or folder: {path}")
    if p.suffix != ".safetensors":
        raise ValueError(f"LoadWeights reads safetensors, not {p.name}")
    (scratch / p.name).symlink_to(p.resolve())
    return scratch


class VllmReplicaControl(pb_grpc.ReplicaControlServicer):
    def __init__(
        self,
        llm: Any,  # vllm.v1.engine.async_llm.AsyncLLM (imported by the launcher, not here)
        gate: AdmissionGate,
        waiting: Callable[[], Awaitable[int]],
        *,
        weight_version: int = 0,
    ) -> None:
        self.llm = llm
        self.gate = gate
        self.waiting = waiting  # requests queued in the engine, over the replica's ranks (vLLM's last stats)
        self.weight_version = weight_version
        self._sync_lock = asyncio.Lock()
        self._failure_reason: str | None = None
        # vLLM points its model config at the folder it last loaded: a single file's folder lives until the next.
        self._loaded_from: tempfile.TemporaryDirectory[str] | None = None

    async def PauseGeneration(
        self, request: pb.PauseGenerationRequest, context: grpc.aio.ServicerContext
    ) -> pb.PauseGenerationResponse:
        mode = await pause_mode(request, context)
        async with self._sync_lock:
            self.gate.close(closed_reason(self._failure_reason))
            running = set(self.gate.in_flight)
            self.gate.watch_aborts()
            try:
                await self.llm.pause_generation(mode=mode.value, clear_cache=request.clear_cache)
                if mode is PauseMode.ABORT:
                    # A call admitted just before the gate closed may reach the engine only after the pause
                    # (queued there until resume): abort it too, so it loops back like the others.
                    late = list(running & self.gate.in_flight)
                    if late:
                        await self.llm.abort(late)
                    await self._delivered(running)
            finally:
                aborted = self.gate.take_aborts()
            logger.info("paused (%s): %d request(s) aborted", mode.value, len(aborted))
            return pb.PauseGenerationResponse(
                weight_version=self.weight_version, aborted_request_ids=aborted, paused=await self.llm.is_paused()
            )

    async def _delivered(self, running: set[str]) -> None:
        """Wait (bounded) until the streams that were running have ended or can no longer end by this pause."""
        deadline = asyncio.get_running_loop().time() + ABORT_DELIVERY_S
        while running & self.gate.in_flight and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)

    async def LoadWeights(
        self, request: pb.LoadWeightsRequest, context: grpc.aio.ServicerContext
    ) -> pb.LoadWeightsResponse:
        which = request.WhichOneof("source")
        if which != "path":
            await invalid_argument(context, "the vLLM replica loads weights from a path (a safetensors file or folder)")
        async with self._sync_lock:
            scratch = tempfile.TemporaryDirectory(prefix="psrl-weights-")
            try:
                folder = checkpoint_dir(request.path, Path(scratch.name))
                await self.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(folder)})
            except (OSError, ValueError, NotImplementedError) as e:
                scratch.cleanup()
                await invalid_argument(context, f"cannot load {request.path}: {e}")
            except Exception as e:  # raised inside the engine (a mismatched checkpoint, a dummy loader)
                scratch.cleanup()
                await invalid_argument(context, f"vLLM could not reload {request.path}: {e}")
            if self._loaded_from is not None:
                self._loaded_from.cleanup()
            self._loaded_from = scratch
            await self.llm.reset_prefix_cache()
            self.weight_version = request.version
            logger.info("loaded weights version %d from %s", request.version, request.path)
            return pb.LoadWeightsResponse(weight_version=self.weight_version)

    async def ResumeGeneration(
        self, request: pb.ResumeGenerationRequest, context: grpc.aio.ServicerContext
    ) -> pb.ResumeGenerationResponse:
        async with self._sync_lock:
            self._failure_reason = None
            await self.llm.resume_generation()
            self.gate.open()
            logger.info("resumed at weight version %d", self.weight_version)
            return pb.ResumeGenerationResponse(weight_version=self.weight_version, paused=False)

    async def GetSyncState(
        self, request: pb.GetSyncStateRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetSyncStateResponse:
        admission = admission_state(self._failure_reason, self.gate.closed_reason is not None)
        return pb.GetSyncStateResponse(
            paused=await self.llm.is_paused(),
            weight_version=self.weight_version,
            # Exact, unlike vLLM's stats snapshot (which can still show a request that ended): a sync waits on it.
            running_requests=len(self.gate.in_flight),
            waiting_requests=await self.waiting(),
            admission=admission,
            failure_reason=self._failure_reason or "",
        )

    async def FailSync(self, request: pb.FailSyncRequest, context: grpc.aio.ServicerContext) -> pb.FailSyncResponse:
        # Not behind the sync lock: a failure must close admission even while a pause or load is under way.
        self._failure_reason = request.reason or "no reason given"
        self.gate.close(closed_reason(self._failure_reason))
        logger.warning("sync failed: %s", self._failure_reason)
        return pb.FailSyncResponse(weight_version=self.weight_version)
