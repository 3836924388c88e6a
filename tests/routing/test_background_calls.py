"""The calls the router's background loops make to every gRPC worker (HealthCheck, GetLoads): they go over the
Generate client (libcurl), answer as grpc.aio answered them, and their failures read as a worker that is not
healthy or a poll that is missed, never as a crash."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import httpx
import pytest
from _procs import Proc, free_port, silent_peer, start_router
from smg_grpc_proto.generated import vllm_engine_pb2 as pb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as pb_grpc

from psrl.gateway.processes import stop_processes
from psrl.router.background import BackgroundLoops
from psrl.router.http_backend import HttpWorkers
from psrl.router.registry import Worker, WorkerRegistry
from psrl.router.worker_client import HEALTH_CHECK_METHOD, WorkerClients


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
    third is refused as unauthenticated."""
    calls = 0

    async def health(request: pb.HealthCheckRequest, context: grpc.aio.ServicerContext) -> AsyncIterator:
        nonlocal calls
        calls += 1
        if calls == 2:
            yield pb.HealthCheckResponse(healthy=True)
            yield pb.HealthCheckResponse(healthy=True)
        elif calls == 3:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "no token")

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
            await clients._unary(odd_replica, HEALTH_CHECK_METHOD, request, pb.HealthCheckResponse.FromString, 5.0)
        assert e.value.code() == grpc.StatusCode.INTERNAL and why in (e.value.details() or "")
    assert not await clients.is_healthy(worker, 5.0)  # refused: named once in the log
    assert "refused the router's call as unauthenticated" in caplog.text
    assert not await clients.is_healthy(_worker(f"127.0.0.1:{free_port()}"), 5.0)  # nobody there


async def test_a_replica_that_never_answers_is_not_healthy_within_the_timeout(clients: WorkerClients) -> None:
    """A listening socket nobody reads (the kernel completes the connection; no HTTP/2 ever comes back): only
    the client's own timeout ends the check."""
    with silent_peer() as port:
        start = time.monotonic()
        assert not await clients.is_healthy(_worker(f"127.0.0.1:{port}"), 0.5)
        assert time.monotonic() - start < 5


async def test_a_probe_that_fails_unexpectedly_fails_only_its_own_worker_s_check() -> None:
    """A health round records every worker, even when one worker's probe raises something other than a failed
    call (a bug): that worker counts as not healthy, the others as they answered."""
    registry = WorkerRegistry()
    bad = registry.create_worker("bad", "grpc://127.0.0.1:1", models=["m"], labels={})
    good = registry.create_worker("good", "grpc://127.0.0.1:2", models=["m"], labels={})

    class Clients:
        async def is_healthy(self, worker: Worker, timeout_s: float) -> bool:
            if worker is bad:
                raise RuntimeError("a bug in the probe")
            return False

    loops = BackgroundLoops(
        registry,
        Clients(),  # type: ignore[arg-type]
        HttpWorkers(1.0, None),
        health_interval_s=1.0,
        health_timeout_s=1.0,
        load_poll_interval_s=0,
        kv_index=None,
        evict=lambda now: None,
    )
    assert bad.healthy and good.healthy
    for _ in range(bad.health.config.failure_threshold):
        await loops.check_health()
    assert not bad.healthy and not good.healthy


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
