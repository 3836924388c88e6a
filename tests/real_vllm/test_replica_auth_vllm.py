"""The replicas' shared token on real vLLM replicas of ours (`--engine vllm`): every service on the replica's
server (the stock servicer, ReplicaControl, KvMigration) refuses a tokenless call, a router with the token
serves through it, one without it is told why, and the engine core's KV pull from a tokened peer carries it."""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path

import grpc
import httpx
import pytest
from _procs import Proc, start_router
from _vllm import greedy_request, start_vllm_replica
from grpc_health.v1 import health_pb2, health_pb2_grpc
from smg_grpc_proto.generated import vllm_engine_pb2 as pb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as pb_grpc

from psrl._proto import kv_migration_pb2 as kv
from psrl._proto import kv_migration_pb2_grpc as kv_grpc
from psrl._proto import replica_control_pb2 as rc
from psrl._proto import replica_control_pb2_grpc as rc_grpc
from psrl.credentials import TOKEN_ENV
from psrl.gateway.processes import stop_processes
from psrl.replica_auth import token_interceptors

TOKEN = "vllm-tok-0123456789"
BLOCK = 128  # vLLM's CPU block size
N = 1000


def _target(p: Proc) -> str:
    return p.url.removeprefix("grpc://")


def _channel(target: str) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(target, interceptors=token_interceptors(TOKEN))


async def _generate(target: str, request: pb.GenerateRequest, ids: list[int]) -> pb.GenerateComplete:
    async with _channel(target) as channel:
        async for frame in pb_grpc.VllmEngineStub(channel).Generate(request, timeout=300):
            if frame.WhichOneof("response") == "chunk":
                ids.extend(frame.chunk.token_ids)
            else:
                return frame.complete
    raise AssertionError("no complete frame")


async def _migrate(source: str, dest: str, prompt: list[int]) -> tuple[list[int], list[int], pb.GenerateComplete]:
    """The reference ids of `prompt` on `source`; then the same request sync-aborted there mid-decode and
    continued on `dest` with params naming `source`, as the router loops it back: its ids and complete frame."""
    reference: list[int] = []
    await _generate(source, greedy_request("ref", prompt, N), reference)
    got: list[int] = []
    run = asyncio.ensure_future(_generate(source, greedy_request("mig", prompt, N), got))
    while len(got) < 300:
        assert not run.done(), "the request ended before the sync"
        await asyncio.sleep(0.005)
    async with _channel(source) as channel:
        control = rc_grpc.ReplicaControlStub(channel)
        paused = await control.PauseGeneration(rc.PauseGenerationRequest(mode=rc.PAUSE_MODE_ABORT), timeout=60)
        assert list(paused.aborted_request_ids) == ["mig"]
        await control.ResumeGeneration(rc.ResumeGenerationRequest(), timeout=60)
    assert (await run).finish_reason == "abort"
    looped = prompt + got
    params = {
        "source": {"target": source, "dp_rank": 0},
        "request_id": "mig",
        "num_tokens": len(looped) - 1,
        "mode": "sync",
        "timeout_ms": 5000,
    }
    rest: list[int] = []
    complete = await _generate(dest, greedy_request("mig-2", looped, N - len(got), params), rest)
    return reference, got + rest, complete


def test_a_tokened_vllm_replica_serves_a_tokened_router_and_refuses_tokenless_calls(
    vllm_model_dir: Path, log_dir: Path, tmp_path: Path
) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    token_file.chmod(0o600)
    procs: list[Proc] = []
    try:
        # One reads the token from a file (so does its engine core), the other from the environment.
        procs.append(start_vllm_replica(vllm_model_dir, log_dir, args=["--replica-token-file", str(token_file)]))
        with pytest.MonkeyPatch.context() as env:
            env.setenv(TOKEN_ENV, TOKEN)
            procs.append(start_vllm_replica(vllm_model_dir, log_dir))
        dest, source = procs
        with grpc.insecure_channel(_target(dest)) as channel:
            tokenless = [
                lambda: pb_grpc.VllmEngineStub(channel).GetModelInfo(pb.GetModelInfoRequest(), timeout=10),
                lambda: rc_grpc.ReplicaControlStub(channel).GetSyncState(rc.GetSyncStateRequest(), timeout=10),
                lambda: kv_grpc.KvMigrationStub(channel).GetKvMigrationStats(kv.GetKvMigrationStatsRequest()),
            ]
            for call in tokenless:
                with pytest.raises(grpc.RpcError) as refused:
                    call()
                assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert TOKEN_ENV in refused.value.details()
            # vLLM's own health service stays open, for probes.
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert health.status == health_pb2.HealthCheckResponse.SERVING

        router = start_router(log_dir, [dest.url], args=["--replica-token-file", str(token_file)])
        procs.append(router)
        model = httpx.get(f"{router.url}/v1/models").json()["data"][0]["id"]
        chat = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        r = httpx.post(f"{router.url}/v1/chat/completions", json=chat, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] >= 1

        tokenless_router = start_router(log_dir, [])
        procs.append(tokenless_router)
        r = httpx.post(f"{tokenless_router.url}/workers", json={"url": dest.url}, timeout=60)
        assert r.status_code == 503 and r.headers["x-smg-error-code"] == "worker_unauthenticated", r.text

        # The destination's engine core pulls the KV from its tokened source with the token: it moves.
        prompt = [random.Random(4242).randrange(3, 700) for _ in range(300)]
        reference, ids, complete = asyncio.run(_migrate(_target(source), _target(dest), prompt))
        assert ids == reference
        moved = json.loads(complete.kv_transfer_params_json)["moved_tokens"]
        assert moved >= BLOCK and moved % BLOCK == 0
    finally:
        stop_processes([p.proc for p in procs])
