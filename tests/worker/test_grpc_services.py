"""grpc.health.v1.Health and server reflection on a replica's gRPC server, asked by real gRPC clients: the states
vLLM's grpc_server reports, on a replica process and in process."""

from __future__ import annotations

import asyncio
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


async def test_a_silent_non_streamed_call_survives_the_routers_keepalive_pings(inproc_replica) -> None:
    """A non-streamed Generate sends nothing until it ends; the router pings its channel meanwhile (without
    limit). gRPC's default server ends such a connection after two pings ("too_many_pings"); the replica's does
    not count them."""
    from smg_grpc_proto.generated import vllm_engine_pb2, vllm_engine_pb2_grpc

    from psrl.engine import PauseMode

    pings = [
        ("grpc.keepalive_time_ms", 1000),
        ("grpc.keepalive_timeout_ms", 5000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]
    engine = inproc_replica.engines[0]
    request = vllm_engine_pb2.GenerateRequest(
        request_id="silent",
        tokenized=vllm_engine_pb2.TokenizedInput(input_ids=[5, 6, 7]),
        sampling_params=vllm_engine_pb2.SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True),
    )
    async with grpc.aio.insecure_channel(inproc_replica.target, options=pings) as channel:
        call = vllm_engine_pb2_grpc.VllmEngineStub(channel).Generate(request, timeout=60)
        while engine.stats().num_running == 0:
            await asyncio.sleep(0.001)
        await engine.pause(PauseMode.KEEP)  # frozen mid-decode: the call stays silent while pings go by
        assert engine.stats().num_running == 1, "the request ended before the pause: nothing was tested"
        await asyncio.sleep(4.5)  # pings at 1 s: past the default server's two strikes
        engine.resume()
        frames = [frame async for frame in call]
    assert [f.WhichOneof("response") for f in frames] == ["complete"]
    assert len(frames[0].complete.output_ids) == 300
