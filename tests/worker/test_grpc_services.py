"""grpc.health.v1.Health and server reflection on a replica's gRPC server, asked by real gRPC clients: the states
vLLM's grpc_server reports, on a replica process and in process."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from psrl.worker.grpc_services import VLLM_ENGINE_SERVICE, add_health_and_reflection

Status = health_pb2.HealthCheckResponse


async def _check(target: str, service: str) -> int:
    async with grpc.aio.insecure_channel(target) as ch:
        return (await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service))).status


async def _watch(target: str, service: str) -> list[int]:
    async with grpc.aio.insecure_channel(target) as ch:
        call = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(service=service), timeout=10)
        return [r.status async for r in call]


async def _reflect(target: str, **request: str) -> reflection_pb2.ServerReflectionResponse:
    async def one() -> AsyncIterator[reflection_pb2.ServerReflectionRequest]:
        yield reflection_pb2.ServerReflectionRequest(**request)

    async with grpc.aio.insecure_channel(target) as ch:
        (response,) = [r async for r in reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(one())]
        return response


async def test_a_replica_process_serves_health_like_vllm(replica) -> None:
    target = replica.url.removeprefix("grpc://")
    for service in ("", VLLM_ENGINE_SERVICE):  # liveness and readiness
        assert await _check(target, service) == Status.SERVING
        assert await _watch(target, service) == [Status.SERVING]  # the current status, once
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await _check(target, "psrl.nope")
    assert err.value.code() == grpc.StatusCode.NOT_FOUND and err.value.details() == "Unknown service: psrl.nope"
    assert await _watch(target, "psrl.nope") == [Status.SERVICE_UNKNOWN]  # a status on a stream, not an error


async def test_a_replica_process_serves_reflection_for_every_service(replica) -> None:
    target = replica.url.removeprefix("grpc://")
    listed = (await _reflect(target, list_services="")).list_services_response.service
    assert sorted(s.name for s in listed) == [
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
        "psrl.control.ReplicaControl",
        "psrl.kv.KvMigration",
        "vllm.grpc.engine.VllmEngine",
    ]
    for symbol in ("vllm.grpc.engine.VllmEngine", "psrl.kv.KvMigration", "psrl.control.ReplicaControl"):
        found = await _reflect(target, file_containing_symbol=symbol)
        assert found.WhichOneof("message_response") == "file_descriptor_response", symbol


async def test_health_turns_not_serving_on_shutdown_and_when_the_engine_dies(inproc_replica) -> None:
    target = inproc_replica.target
    assert await _check(target, VLLM_ENGINE_SERVICE) == Status.SERVING
    inproc_replica.engines[0].shutdown()
    for service in ("", VLLM_ENGINE_SERVICE):
        assert await _check(target, service) == Status.NOT_SERVING
    inproc_replica.health.set_not_serving()
    assert await _watch(target, "") == [Status.NOT_SERVING]


async def test_a_failing_probe_reads_as_not_serving() -> None:
    async def probe() -> bool:
        raise RuntimeError("the engine cannot tell")

    server = grpc.aio.server()
    health = add_health_and_reflection(server, probe, services=())
    target = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    await server.start()
    try:
        assert await _check(target, "") == Status.NOT_SERVING
        assert await _check(target, VLLM_ENGINE_SERVICE) == Status.NOT_SERVING
        listed = (await _reflect(target, list_services="")).list_services_response.service
        assert sorted(s.name for s in listed) == ["grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"]
        health.set_not_serving()
        assert await _check(target, "") == Status.NOT_SERVING
    finally:
        await server.stop(None)
