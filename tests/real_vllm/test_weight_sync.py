"""Weight syncs on real vLLM replicas of ours (`--engine vllm`), driven by the RolloutCoordinator through the
router: ReplicaControl maps onto AsyncLLM's pause/resume and in-place weight reload, and the router's partial
rollout carries every interrupted request over the sync without losing a token."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from _procs import Proc, start_router
from _wait import until
from smg_grpc_proto.generated import vllm_engine_pb2, vllm_engine_pb2_grpc

from psrl._proto import replica_control_pb2 as rc
from psrl._proto import replica_control_pb2_grpc as rc_grpc
from psrl.coordinator import BlockingRolloutCoordinator, RolloutCoordinator, SyncError
from psrl.gateway.processes import stop_processes
from psrl.worker.model_folder import WEIGHTS_FILE

PROMPTS = [[21, 22, 23, 24, 25, 26], [300, 12, 77], [5, 6, 7, 8, 9, 10, 11], [640, 2, 640, 3]]


@pytest.fixture(scope="module")
def router(vllm_pair: list[Proc], log_dir: Path) -> Iterator[Proc]:
    args = ["--enable-routing-loop", "--policy", "least_load", "--load-poll-interval-s", "0"]
    proc = start_router(log_dir, [p.url for p in vllm_pair], args=args)
    yield proc
    stop_processes([proc.proc])


@pytest.fixture(scope="module")
def weights(vllm_model_dir: Path) -> str:
    return str(vllm_model_dir / WEIGHTS_FILE)  # the same weights the replicas started with


def _body(n: int, prompt: list[int]) -> dict:
    return {
        "input_ids": prompt,
        "return_logprob": True,
        "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True, "detokenize": False},
    }


def _psrl(rid: int) -> dict[str, str]:
    return {"x-request-id": str(rid), "x-prompt-id": str(rid)}


async def _any_running(targets: list[str]) -> bool:
    """Whether a request runs on one of these replicas (their GetSyncState)."""

    async def running(target: str) -> int:
        async with grpc.aio.insecure_channel(target) as channel:
            state = await rc_grpc.ReplicaControlStub(channel).GetSyncState(rc.GetSyncStateRequest(), timeout=5)
        return state.running_requests

    return any(await asyncio.gather(*(running(t) for t in targets)))


def test_sync_interrupts_a_request_that_finishes_with_the_same_ids(router: Proc, vllm_pair, weights) -> None:
    n = 1000  # vLLM decodes the tiny model at hundreds of tokens/s here: long enough to be caught mid-decode

    async def scenario() -> None:
        async with (
            httpx.AsyncClient(base_url=router.url, timeout=300) as client,
            RolloutCoordinator(router.url) as coordinator,
        ):
            first = await client.post("/generate", json=_body(n, PROMPTS[0]), headers=_psrl(1))
            assert first.status_code == 200, first.text
            reference = first.json()
            assert len(set(reference["output_ids"])) > 5, "the test model must not repeat one token"
            task = asyncio.ensure_future(client.post("/generate", json=_body(n, PROMPTS[0]), headers=_psrl(2)))
            targets = [p.url.removeprefix("grpc://") for p in vllm_pair]
            await until(lambda: _any_running(targets), "the request reached vLLM", timeout_s=60, poll_s=0.01)
            await asyncio.sleep(0.2)  # mid-decode
            report = await coordinator.sync_weights(1, path=weights)
            assert report.aborted_requests == 1
            r = await task
            assert r.status_code == 200, r.text
            out = r.json()
            assert out["output_ids"] == reference["output_ids"]
            got = [lp for lp, _ in out["meta_info"]["output_token_logprobs"]]
            want = [lp for lp, _ in reference["meta_info"]["output_token_logprobs"]]
            assert got == pytest.approx(want, abs=1e-3)
            versions = out["meta_info"]["output_token_versions"]
            assert set(versions) == {0, 1} and versions == sorted(versions)

    asyncio.run(scenario())


def test_concurrent_requests_lose_no_token_over_three_syncs(router: Proc, weights) -> None:
    n = 400

    async def scenario() -> None:
        async with (
            httpx.AsyncClient(base_url=router.url, timeout=600) as client,
            RolloutCoordinator(router.url) as coordinator,
        ):
            expected = [
                (await client.post("/generate", json=_body(n, p), headers=_psrl(100 + i))).json()["output_ids"]
                for i, p in enumerate(PROMPTS)
            ]
            load = [
                asyncio.ensure_future(client.post("/generate", json=_body(n, PROMPTS[i % 4]), headers=_psrl(200 + i)))
                for i in range(16)
            ]

            async def half_running() -> bool:
                return (await client.get("/routing_loop/status")).json()["running_request_num"] >= 8

            await until(half_running, "8 of the requests run at once", timeout_s=120, poll_s=0.02)
            for version in (2, 3, 4):
                await coordinator.sync_weights(version, path=weights)
                await asyncio.sleep(0.2)  # the syncs spread over the load (what is tested), not back to back
            results = await asyncio.gather(*load)
        interrupted = 0
        for i, r in enumerate(results):
            assert r.status_code == 200, r.text
            out = r.json()
            assert out["output_ids"] == expected[i % 4]
            meta = out["meta_info"]
            assert meta["finish_reason"] == {"type": "length", "length": n} and len(meta["output_token_logprobs"]) == n
            versions = meta["output_token_versions"]
            assert versions == sorted(versions)
            interrupted += len(set(versions)) > 1
        assert interrupted > 0

    asyncio.run(scenario())


def test_each_choice_of_an_n2_request_continues_over_a_sync(router: Proc, vllm_pair, weights) -> None:
    """n = 2 on vLLM: a sync aborts both choices, each loops back on its own (n = 1, seed + index) and the
    response streams both to their full length. top_k 1 makes every choice the greedy run, so both must equal
    it exactly."""
    n = 600
    common = {"prompt": "partial rollout of every choice", "max_tokens": n, "ignore_eos": True}

    async def scenario() -> None:
        async with (
            httpx.AsyncClient(base_url=router.url, timeout=300) as client,
            RolloutCoordinator(router.url) as coordinator,
        ):
            greedy = await client.post("/v1/completions", json=common | {"temperature": 0}, headers=_psrl(300))
            assert greedy.status_code == 200, greedy.text
            want = greedy.json()["choices"][0]["text"]
            body = common | {"n": 2, "temperature": 1.0, "top_k": 1, "seed": 1, "stream": True}
            texts, finishes = ["", ""], [None, None]

            async def read() -> None:
                async with client.stream("POST", "/v1/completions", json=body, headers=_psrl(301)) as r:
                    assert r.status_code == 200
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            for c in json.loads(line[6:])["choices"]:
                                texts[c["index"]] += c["text"]
                                finishes[c["index"]] = c["finish_reason"] or finishes[c["index"]]

            task = asyncio.ensure_future(read())
            targets = [p.url.removeprefix("grpc://") for p in vllm_pair]
            await until(lambda: _any_running(targets), "the stream reached vLLM", timeout_s=60, poll_s=0.01)
            await asyncio.sleep(0.2)  # mid-decode
            report = await coordinator.sync_weights(5, path=weights)
            assert report.aborted_requests >= 1
            await task
            assert texts == [want, want] and finishes == ["length", "length"]

    asyncio.run(scenario())


def test_a_failed_replica_is_the_only_one_paused(router: Proc, vllm_pair, weights) -> None:
    ids = {w["url"]: w["worker_id"] for w in httpx.get(f"{router.url}/workers").json()["workers"]}
    good, bad = ids[vllm_pair[0].url], ids[vllm_pair[1].url]
    stuck = vllm_pair[1]
    os.killpg(stuck.proc.pid, signal.SIGSTOP)  # a replica that hangs mid-sync
    try:
        with BlockingRolloutCoordinator(router.url, rpc_timeout_s=5.0) as coordinator:
            with pytest.raises(SyncError) as err:
                coordinator.sync_weights(5, path=weights)
            assert err.value.failed == [bad] and bad in str(err.value)
        workers = {w["worker_id"]: w for w in httpx.get(f"{router.url}/workers").json()["workers"]}
        assert workers[bad]["instances"][0]["paused"] and not workers[good]["instances"][0]["paused"]
        assert workers[good]["instances"][0]["weight_version"] == 5
        assert not httpx.get(f"{router.url}/routing_loop/status").json()["paused"]
        r = httpx.post(f"{router.url}/generate", json=_body(4, PROMPTS[1]), headers=_psrl(77), timeout=60)
        assert r.status_code == 200 and r.headers["x-base-worker-id"] == good
    finally:
        os.killpg(stuck.proc.pid, signal.SIGCONT)
    # Put it back for the rest of the session: it runs what it received while stopped (the pause, maybe the
    # FailSync) first, then our Resume reopens it; the router takes it back.
    with grpc.insecure_channel(stuck.url.removeprefix("grpc://")) as channel:
        control = rc_grpc.ReplicaControlStub(channel)
        control.GetSyncState(rc.GetSyncStateRequest(), timeout=60)
        control.ResumeGeneration(rc.ResumeGenerationRequest(), timeout=60)
        state = control.GetSyncState(rc.GetSyncStateRequest(), timeout=5)
        assert state.admission == rc.ADMISSION_OPEN and not state.paused
        assert vllm_engine_pb2_grpc.VllmEngineStub(channel).HealthCheck(vllm_engine_pb2.HealthCheckRequest()).healthy
    resumed = httpx.post(f"{router.url}/workers/resume", json=[{"base_worker_id": bad}]).json()
    assert resumed["updated"] == 1
