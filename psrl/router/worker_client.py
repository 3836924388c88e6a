"""gRPC side of the router: one channel per worker, and the calls the router makes on it (with the replicas'
shared token on every one when the router has it: psrl.replica_auth). Generate, the call every request makes,
goes over psrl.router.grpc_stream instead of the channel, and so do the two calls the background loops make
to every worker every few seconds (HealthCheck, GetLoads): through grpc.aio, a call woke its core's threads
and the event loop, about 1.2 ms of CPU a poll on the development VM, a cost that grows with the fleet."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TypeVar

import grpc
from google.protobuf.message import Message
from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2, vllm_engine_pb2_grpc

from psrl._proto import routed_experts_pb2, routed_experts_pb2_grpc
from psrl.replica_auth import REFUSED_ERROR_CODE, token_interceptors, token_metadata
from psrl.router.errors import WorkerUnavailable
from psrl.router.grpc_stream import CurlGrpc, StreamCall
from psrl.router.registry import Worker
from psrl.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

_ENGINE = vllm_engine_pb2.DESCRIPTOR.services_by_name["VllmEngine"]


def _method(name: str) -> str:
    return f"/{_ENGINE.full_name}/{_ENGINE.methods_by_name[name].name}"


GENERATE_METHOD = _method("Generate")
HEALTH_CHECK_METHOD = _method("HealthCheck")
GET_LOADS_METHOD = _method("GetLoads")
M = TypeVar("M", bound=Message)

_CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.max_pings_without_data", 0),
    # A dead replica must fail fast so the router can answer 503, not hang in reconnect backoff.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1_000),
]


@dataclass(frozen=True)
class WorkerFacts:
    dp_size: int
    max_context_length: int
    block_size: int
    served_model_name: str


def refused(target: str, e: grpc.aio.AioRpcError) -> WorkerUnavailable:
    """A replica that refused the router's credentials: a misconfiguration, named as one."""
    return WorkerUnavailable(
        f"the replica at {target} refused the router's call as unauthenticated ({e.details()}); the router "
        "needs the replicas' token: PSRL_REPLICA_TOKEN or --replica-token-file",
        code=REFUSED_ERROR_CODE,
    )


class WorkerClients:
    """The channel pool: channels are opened lazily and reused by every request to that worker. With
    `replica_token`, every call on them carries it."""

    def __init__(self, replica_token: str | None = None) -> None:
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._stubs: dict[str, vllm_engine_pb2_grpc.VllmEngineStub] = {}
        self._routed_experts_stubs: dict[str, routed_experts_pb2_grpc.RoutedExpertsStub] = {}
        self._interceptors = token_interceptors(replica_token)
        self._token_metadata = token_metadata(replica_token)
        self._streams = CurlGrpc()
        self._refusals_logged: set[str] = set()

    def stub(self, target: str) -> vllm_engine_pb2_grpc.VllmEngineStub:
        stub = self._stubs.get(target)
        if stub is None:
            channel = grpc.aio.insecure_channel(target, options=_CHANNEL_OPTIONS, interceptors=self._interceptors)
            self._channels[target] = channel
            stub = self._stubs[target] = vllm_engine_pb2_grpc.VllmEngineStub(channel)
        return stub

    def generate(
        self,
        target: str,
        request: bytes,
        timeout_s: float | None,
        metadata: tuple[tuple[str, str], ...] = (),
    ) -> StreamCall[vllm_engine_pb2.GenerateResponse]:
        """Start a Generate on `target` (`request`: a serialized GenerateRequest); its frames are read from the
        call it returns."""
        return self._streams.unary_stream(
            target,
            GENERATE_METHOD,
            request,
            vllm_engine_pb2.GenerateResponse.FromString,
            timeout_s=timeout_s,
            metadata=self._token_metadata + metadata,
        )

    async def _unary(
        self, target: str, method: str, request: Message, deserialize: Callable[[bytes], M], timeout_s: float
    ) -> M:
        """A unary call on the Generate client: its one message once the call ended OK, else the call's
        `grpc.aio.AioRpcError` (as grpc.aio raises it). A call the caller stops waiting for is reset."""
        call = self._streams.unary_stream(
            target, method, request.SerializeToString(), deserialize, timeout_s=timeout_s, metadata=self._token_metadata
        )
        try:
            reply = await call.read()
            extra = await call.read() if reply is not None else None  # the end: the call's status
        finally:
            call.cancel()
        if reply is None or extra is not None:
            why = "no message" if reply is None else "more than one message"
            raise grpc.aio.AioRpcError(grpc.StatusCode.INTERNAL, details=f"{method} on {target} answered {why}")
        return reply

    async def take_routed_experts(
        self, target: str, request_id: str, index: int, timeout_s: float
    ) -> routed_experts_pb2.TakeRoutedExpertsResponse:
        """The routed experts a replica of ours kept for one choice of a Generate (psrl.experts.RoutedExperts, on
        the worker's channel); a stock replica answers UNIMPLEMENTED."""
        stub = self._routed_experts_stubs.get(target)
        if stub is None:
            self.stub(target)  # opens the channel
            stub = self._routed_experts_stubs[target] = routed_experts_pb2_grpc.RoutedExpertsStub(
                self._channels[target]
            )
        request = routed_experts_pb2.TakeRoutedExpertsRequest(request_id=request_id, index=index)
        return await stub.TakeRoutedExperts(request, timeout=timeout_s)

    async def drop(self, target: str) -> None:
        """The worker at `target` left the registry: its calls end (CANCELLED, as a closed channel ends them)."""
        self._streams.fail_target(target, f"the worker at {target} was removed")
        self._stubs.pop(target, None)
        self._routed_experts_stubs.pop(target, None)
        self._refusals_logged.discard(target)
        channel = self._channels.pop(target, None)
        if channel is not None:
            await channel.close(grace=None)

    async def close(self) -> None:
        self._streams.close()
        await asyncio.gather(*(self.drop(t) for t in list(self._channels)))

    async def facts(self, target: str, timeout_s: float) -> WorkerFacts:
        """What registration asks a gRPC worker. WorkerUnavailable (code worker_unauthenticated) when it refused
        the router's token; other failures raise as gRPC errors."""
        stub = self.stub(target)
        try:
            server, model = await asyncio.gather(
                stub.GetServerInfo(vllm_engine_pb2.GetServerInfoRequest(), timeout=timeout_s),
                stub.GetModelInfo(vllm_engine_pb2.GetModelInfoRequest(), timeout=timeout_s),
            )
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.UNAUTHENTICATED:
                raise refused(target, e) from e
            raise
        return WorkerFacts(
            dp_size=max(1, server.data_parallel_size),
            max_context_length=model.max_context_length,
            block_size=server.block_size,
            served_model_name=model.served_model_name,
        )

    async def is_healthy(self, worker: Worker, timeout_s: float) -> bool:
        try:
            reply = await self._unary(
                worker.target,
                HEALTH_CHECK_METHOD,
                vllm_engine_pb2.HealthCheckRequest(),
                vllm_engine_pb2.HealthCheckResponse.FromString,
                timeout_s,
            )
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.UNAUTHENTICATED and worker.target not in self._refusals_logged:
                self._refusals_logged.add(worker.target)  # once: it recurs every health interval
                logger.warning("worker %s: %s", worker.worker_id, refused(worker.target, e).message)
            logger.debug("health check of worker %s failed: %s", worker.worker_id, e.code())
            return False
        self._refusals_logged.discard(worker.target)
        return reply.healthy

    async def loads(self, worker: Worker, timeout_s: float) -> vllm_engine_pb2.GetLoadsResponse:
        return await self._unary(
            worker.target,
            GET_LOADS_METHOD,
            vllm_engine_pb2.GetLoadsRequest(),
            vllm_engine_pb2.GetLoadsResponse.FromString,
            timeout_s,
        )

    def kv_events(self, worker: Worker) -> AsyncIterator[common_pb2.KvEventBatch]:
        return self.stub(worker.target).SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest())

    async def tokenizer(self, target: str, timeout_s: float = 60.0) -> Tokenizer:
        data = bytearray()
        sha = ""
        async for chunk in self.stub(target).GetTokenizer(common_pb2.GetTokenizerRequest(), timeout=timeout_s):
            data += chunk.data
            sha = chunk.sha256 or sha
        return await asyncio.to_thread(Tokenizer.from_zip_bytes, bytes(data), sha or None)
