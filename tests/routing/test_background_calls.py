"""The calls the router's background loops make to every gRPC worker (HealthCheck, GetLoads): they go over the
Generate client (libcurl), answer as grpc.aio answered them, and their failures read as a worker that is not
healthy or a poll that is missed, never as a crash."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import httpx
import pytest
from _procs import Proc, free_port, start_router
from smg_grpc_proto.generated import vllm_engine_pb2 as pb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as pb_grpc

from psrl.gateway.processes import stop_processes
from psrl.router.registry import Worker, WorkerRegistry
from psrl.router.worker_client import WorkerClients


def _worker(target: str) -> Worker:
    return WorkerRegistry().create_worker("w", f"grpc://{target}", models=["m"], labels={})


@pytest.fixture
async def clients() -> AsyncIterator[WorkerClients]:
    c = WorkerClients()
    yield c
    await c.close()


async def test_health_and_loads_answer_as_grpc_aio_does_without_its_channel(
    clients: WorkerClients, replica: Proc
) -> None:
    worker = _worker(replica.url.removeprefix("grpc://"))
    assert await clients.is_healthy(worker, 5.0)
    ours = await clients.loads(worker, 5.0)
    async with grpc.aio.insecure_channel(worker.target) as channel:
        theirs = await pb_grpc.VllmEngineStub(channel).GetLoads(pb.GetLoadsRequest(), timeout=5.0)
    assert [(x.dp_rank, x.num_running_reqs) for x in ours.loads] == [
        (x.dp_rank, x.num_running_reqs) for x in theirs.loads
    ]
    assert len(ours.loads) == 2 and ours.timestamp
    assert not clients._channels  # neither call opened a grpc.aio channel


def _generic(method: str, handler: grpc.RpcMethodHandler) -> grpc.GenericRpcHandler:
    return grpc.method_handlers_generic_handler("vllm.grpc.engine.VllmEngine", {method: handler})


@pytest.fixture
async def odd_replica() -> AsyncIterator[str]:
    """A server whose HealthCheck goes wrong in turn: the first call answers no message, the second two, the
    third is refused as unauthenticated, the fourth stalls."""
    calls = 0

    async def health(request: pb.HealthCheckRequest, context: grpc.aio.ServicerContext) -> AsyncIterator:
        nonlocal calls
        calls += 1
        if calls == 2:
            yield pb.HealthCheckResponse(healthy=True)
            yield pb.HealthCheckResponse(healthy=True)
        elif calls == 3:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "no token")
        elif calls == 4:
            await asyncio.sleep(30)

    handler = grpc.unary_stream_rpc_method_handler(
        health,
        request_deserializer=pb.HealthCheckRequest.FromString,
        response_serializer=pb.HealthCheckResponse.SerializeToString,
    )
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((_generic("HealthCheck", handler),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield f"127.0.0.1:{port}"
    await server.stop(None)


async def test_a_replica_that_answers_wrong_is_not_healthy(
    clients: WorkerClients, odd_replica: str, caplog: pytest.LogCaptureFixture
) -> None:
    worker = _worker(odd_replica)
    request = pb.HealthCheckRequest()
    for why in ("no message", "more than one message"):
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await clients._unary(
                odd_replica, "/vllm.grpc.engine.VllmEngine/HealthCheck", request, pb.HealthCheckResponse.FromString, 5.0
            )
        assert e.value.code() == grpc.StatusCode.INTERNAL and why in (e.value.details() or "")
    assert not await clients.is_healthy(worker, 5.0)  # refused: named once in the log
    assert "refused the router's call as unauthenticated" in caplog.text
    start = time.monotonic()
    assert not await clients.is_healthy(worker, 0.5)  # stalled past the timeout
    assert time.monotonic() - start < 5
    assert not await clients.is_healthy(_worker(f"127.0.0.1:{free_port()}"), 5.0)  # nobody there


async def test_loads_a_router_polls_show_what_runs_on_its_replica(replica: Proc, log_dir: Path) -> None:
    """End to end: a request held decoding on the replica shows in the router's /workers through the poll alone
    (the replica's count of running requests, which the router reads from GetLoads)."""
    router = start_router(log_dir, [replica.url], args=["--load-poll-interval-s", "0.1"])
    try:
        body = {
            "messages": [{"role": "user", "content": "count"}],
            "max_tokens": 1500,
            "ignore_eos": True,
            "stream": True,
        }
        with httpx.Client(timeout=60) as client, client.stream("POST", f"{router.url}/v1/chat/completions", json=body):
            deadline = time.monotonic() + 20
            running = 0
            while running < 1 and time.monotonic() < deadline:
                workers = client.get(f"{router.url}/workers").json()["workers"]
                running = sum(i["running_requests"] for w in workers for i in w["instances"])
                time.sleep(0.05)
            assert running == 1
    finally:
        stop_processes([router.proc])
