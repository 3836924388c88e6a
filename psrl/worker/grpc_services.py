"""The standard services a replica's gRPC server carries beside its own, as vLLM's grpc_server serves them:
`grpc.health.v1.Health` (for Kubernetes probes and grpc_health_probe) and server reflection (for grpcurl).

Health answers two names: "" (the whole server, liveness) and `vllm.grpc.engine.VllmEngine` (readiness),
SERVING while the replica's probe says its engine is healthy and NOT_SERVING otherwise or once
`set_not_serving()` was called (shutdown). Any other name is unknown: Check fails with NOT_FOUND, Watch sends
SERVICE_UNKNOWN. Like smg-grpc-servicer's health service, Watch sends the current status once and ends.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from smg_grpc_proto.generated import vllm_engine_pb2

from psrl._proto import kv_migration_pb2, replica_control_pb2
from psrl.grpc_decode import RequestDecodeInterceptor
from psrl.replica_auth import ReplicaTokenInterceptor

logger = logging.getLogger(__name__)

VLLM_ENGINE_SERVICE = vllm_engine_pb2.DESCRIPTOR.services_by_name["VllmEngine"].full_name
HEALTH_SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
# What a replica serves besides the standard services, either kind: VllmEngine, its ReplicaControl, KvMigration.
REPLICA_CONTROL_SERVICE = replica_control_pb2.DESCRIPTOR.services_by_name["ReplicaControl"].full_name
KV_MIGRATION_SERVICE = kv_migration_pb2.DESCRIPTOR.services_by_name["KvMigration"].full_name
REPLICA_SERVICES = (VLLM_ENGINE_SERVICE, REPLICA_CONTROL_SERVICE, KV_MIGRATION_SERVICE)

# Both replicas' servers: large frames (log-probs, KV descriptors), and a non-streamed Generate is silent while it
# decodes, so the router's keepalive pings on it are never strikes (gRPC's default ends the call after 2).
REPLICA_SERVER_OPTIONS = (
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
    ("grpc.http2.max_ping_strikes", 0),
    ("grpc.keepalive_permit_without_calls", True),
)


# Open even when the replica has a token: Kubernetes' gRPC probes send no metadata, and health tells only
# SERVING or not; reflection lists schemas that are public anyway (smg-grpc-proto, proto/). VllmEngine's own
# HealthCheck, ReplicaControl and KvMigration (TransferKv would tell whether a prompt is cached) need the token.
UNAUTHENTICATED_SERVICES = (HEALTH_SERVICE, reflection.SERVICE_NAME)


def replica_grpc_server(host: str, port: int, *, token: str | None = None) -> tuple[grpc.aio.Server, str]:
    """A replica's gRPC server bound at host:port (0: any free port) and its `host:port` target. With `token`,
    every call but health and reflection must carry it (psrl.replica_auth). Requests that do not parse answer
    INVALID_ARGUMENT (psrl.grpc_decode), parsed only once the token was checked."""
    interceptors: list[grpc.aio.ServerInterceptor] = [RequestDecodeInterceptor()]
    if token is not None:
        interceptors.insert(0, ReplicaTokenInterceptor(token, UNAUTHENTICATED_SERVICES))  # the outer one: first
    server = grpc.aio.server(options=list(REPLICA_SERVER_OPTIONS), interceptors=interceptors)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot bind {host}:{port}")
    return server, f"{host}:{bound}"


HealthProbe = Callable[[], Awaitable[bool]]  # True while the engine is healthy; raising counts as unhealthy


class ReplicaHealthServicer(health_pb2_grpc.HealthServicer):
    def __init__(self, probe: HealthProbe) -> None:
        self._probe = probe
        self._shutting_down = False
        self._failure_logged = False

    def set_not_serving(self) -> None:
        """From now on every service answers NOT_SERVING (call it before stopping the server)."""
        self._shutting_down = True

    async def _status(self, service: str) -> health_pb2.HealthCheckResponse.ServingStatus.ValueType | None:
        """None for a name this server does not know."""
        if service not in ("", VLLM_ENGINE_SERVICE):
            return None
        if self._shutting_down:
            return health_pb2.HealthCheckResponse.NOT_SERVING
        try:
            healthy = await self._probe()
        except Exception:
            healthy = False
            if not self._failure_logged:  # probes come every few seconds: the first failure is the one to read
                self._failure_logged = True
                logger.exception("the health probe failed")
        return health_pb2.HealthCheckResponse.SERVING if healthy else health_pb2.HealthCheckResponse.NOT_SERVING

    async def Check(
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> health_pb2.HealthCheckResponse:
        status = await self._status(request.service)
        if status is None:
            context.set_code(grpc.StatusCode.NOT_FOUND)
            context.set_details(f"Unknown service: {request.service}")
            return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVICE_UNKNOWN)
        return health_pb2.HealthCheckResponse(status=status)

    async def Watch(
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[health_pb2.HealthCheckResponse]:
        status = await self._status(request.service)
        # An unknown name is a status here, not an error code: a code would fail the stream.
        yield health_pb2.HealthCheckResponse(
            status=health_pb2.HealthCheckResponse.SERVICE_UNKNOWN if status is None else status
        )


def add_health_and_reflection(
    server: grpc.aio.Server, health: HealthProbe | Any, services: Iterable[str] = REPLICA_SERVICES
) -> Any:
    """Serve Health on `server` (a ReplicaHealthServicer over a probe, or a ready-made health servicer such as
    smg's), and reflection listing `services` (full names of what it serves), Health and reflection itself.
    Returns the health servicer, for `set_not_serving()` at shutdown."""
    if not isinstance(health, health_pb2_grpc.HealthServicer):
        health = ReplicaHealthServicer(health)
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection((*services, HEALTH_SERVICE, reflection.SERVICE_NAME), server)
    return health
