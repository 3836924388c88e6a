"""Weight syncs driven by the RolloutCoordinator over real processes: an interrupted greedy request finishes on
the other replica with exactly the tokens of an uninterrupted run, and under load with repeated syncs no
request loses a token or runs below its version floor."""

from __future__ import annotations

import asyncio
import random

import grpc
import httpx
import pytest
from _loads import wait_decoding
from _procs import start_replica, start_router
from _wait import until
from smg_grpc_proto.generated import vllm_engine_pb2_grpc

from psrl.coordinator import BlockingRolloutCoordinator, RolloutCoordinator, SyncError
from psrl.gateway.processes import stop_processes

PROMPT = [21, 22, 23, 24, 25, 26]


@pytest.fixture
def fleet(model_dir, log_dir):
    a = start_replica(model_dir, log_dir)
    b = start_replica(model_dir, log_dir)
    router = start_router(
        log_dir, [a.url, b.url], args=["--enable-routing-loop", "--policy", "least_load", "--load-poll-interval-s", "0"]
    )
    yield router, a, b
    stop_processes([router.proc, a.proc, b.proc])


def _body(n: int, prompt: list[int] = PROMPT) -> dict:
    return {
        "input_ids": prompt,
        "return_logprob": True,
        "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True, "detokenize": False},
    }


def _psrl(rid: int, version: int | None = None) -> dict[str, str]:
    headers = {"x-request-id": str(rid), "x-prompt-id": str(rid)}
    if version is not None:
        headers["x-version-tag"] = str(version)
    return headers


async def _wait_running(client: httpx.AsyncClient) -> tuple[str, str]:
    """The worker id and URL the (single) running request sits on."""
    for _ in range(500):
        workers = (await client.get("/workers")).json()["workers"]
        for w in workers:
            if any(i["inflight_requests"] for i in w["instances"]):
                return w["worker_id"], w["url"]
        await asyncio.sleep(0.01)
    raise AssertionError("the request never started")


def test_sync_interrupts_and_the_request_finishes_elsewhere_exactly(fleet) -> None:
    router, _, _ = fleet
    n = 1000

    async def scenario() -> None:
        async with (
            httpx.AsyncClient(base_url=router.url, timeout=120) as client,
            RolloutCoordinator(router.url) as coordinator,
        ):
            reference = (await client.post("/generate", json=_body(n), headers=_psrl(1))).json()
            task = asyncio.ensure_future(client.post("/generate", json=_body(n), headers=_psrl(2)))
            source, source_url = await _wait_running(client)
            async with grpc.aio.insecure_channel(source_url.removeprefix("grpc://")) as channel:
                await wait_decoding(vllm_engine_pb2_grpc.VllmEngineStub(channel))  # tokens before the sync
            # Make the source look busy, so the loop-back goes to the other replica.
            await client.post(
                "/workers/update_stats",
                json=[
                    {
                        "worker_id": source,
                        "dp_rank": 0,
                        "timestamp": "2099-01-01T00:00:00Z",
                        "scheduler_stats": {"num_running_reqs": 99},
                    }
                ],
            )
            report = await coordinator.sync_weights(1, seed=0)  # same weights as the replicas' start-up seed
            assert report.aborted_requests == 1 and set(report.phases) >= {"pause_routing", "load_weights"}
            r = await task
            assert r.status_code == 200, r.text
            out = r.json()
            assert r.headers["x-base-worker-id"] != source
            assert out["output_ids"] == reference["output_ids"]
            got = [lp for lp, _ in out["meta_info"]["output_token_logprobs"]]
            want = [lp for lp, _ in reference["meta_info"]["output_token_logprobs"]]
            assert got == pytest.approx(want, abs=1e-3)
            versions = out["meta_info"]["output_token_versions"]
            assert versions[0] == 0 and versions[-1] == 1 and versions == sorted(versions)
            status = (await client.get("/routing_loop/status")).json()
            assert not status["paused"] and status["running_request_num"] == 0

    asyncio.run(scenario())


def test_many_requests_survive_ten_syncs_with_real_weight_changes(fleet) -> None:
    router, replica, _ = fleet
    rng = random.Random(0)

    async def scenario() -> None:
        current = 0
        results: list[tuple[int, int, httpx.Response]] = []

        async def one(client: httpx.AsyncClient, rid: int) -> None:
            n = rng.randint(100, 200)
            floor = current if rid % 3 == 0 else None  # a third carry the version current when sent
            prompt = [rng.randrange(1, 600) for _ in range(rng.randint(3, 40))]
            r = await client.post("/generate", json=_body(n, prompt), headers=_psrl(rid, floor))
            results.append((n, -1 if floor is None else floor, r))

        async with (
            httpx.AsyncClient(base_url=router.url, timeout=300) as client,
            RolloutCoordinator(router.url) as coordinator,
        ):
            load = [asyncio.ensure_future(one(client, 1000 + i)) for i in range(64)]

            async def half_running() -> bool:
                ended = [r.status_code for _, _, r in results]
                assert not all(t.done() for t in load), f"the load ended before 32 of it ran at once: {ended}"
                return (await client.get("/routing_loop/status")).json()["running_request_num"] >= 32

            await until(half_running, "32 of the requests run at once", timeout_s=120, poll_s=0.02)
            # The first sync comes once requests hold tokens: on a quiet machine the whole load could end in a
            # fixed wait, and then no request would span two versions.
            async with grpc.aio.insecure_channel(replica.url.removeprefix("grpc://")) as channel:
                await wait_decoding(vllm_engine_pb2_grpc.VllmEngineStub(channel))
            for version in range(1, 11):
                if version > 1:
                    await asyncio.sleep(0.25)  # the syncs spread over the load (what is tested), not back to back
                await coordinator.sync_weights(version, seed=version)
                current = version
            await asyncio.gather(*load)

        assert len(results) == 64
        for n, floor, r in results:
            assert r.status_code == 200, r.text
            meta = r.json()["meta_info"]
            assert len(r.json()["output_ids"]) == n and meta["finish_reason"] == {"type": "length", "length": n}
            versions = meta["output_token_versions"]
            assert len(versions) == n and versions == sorted(versions)
            assert min(versions) >= floor, (floor, versions)
            assert len(meta["output_token_logprobs"]) == n
        assert any(len(set(r.json()["meta_info"]["output_token_versions"])) > 1 for _, _, r in results)

    asyncio.run(scenario())


def test_blocking_client_and_a_failed_replica(fleet, model_dir, log_dir) -> None:
    router, a, b = fleet
    ids = {w["url"]: w["worker_id"] for w in httpx.get(f"{router.url}/workers").json()["workers"]}
    good, bad = ids[a.url], ids[b.url]
    with BlockingRolloutCoordinator(router.url) as coordinator:
        assert {r.worker_id for r in coordinator.replicas()} == {good, bad}
        assert coordinator.push_stats()["updated"] == 2
        stop_processes([b.proc])
        with pytest.raises(SyncError) as err:
            coordinator.sync_weights(3, seed=3)
        assert err.value.failed == [bad]
    workers = {w["worker_id"]: w for w in httpx.get(f"{router.url}/workers").json()["workers"]}
    assert workers[bad]["instances"][0]["paused"] and not workers[good]["instances"][0]["paused"]
    assert workers[good]["instances"][0]["weight_version"] == 3
    status = httpx.get(f"{router.url}/routing_loop/status").json()
    assert not status["paused"]
    r = httpx.post(f"{router.url}/generate", json=_body(4), headers=_psrl(77), timeout=60)
    assert r.status_code == 200 and r.headers["x-base-worker-id"] == good
