"""Routed experts through the router over real processes (reference replicas on a tiny Qwen2-MoE): /generate's
meta_info.routed_experts (base64 .npy) holds the routing of every position fed, from routed_experts_start_len;
a weight sync that interrupts the request mid-decode loops it back (its KV moved) and the merged routing is
exactly an uninterrupted run's; a dense fleet answers null; bad fields are 400s.

vLLM's CPU build cannot return routed experts (its capture needs Model Runner V2, which needs Triton), so
this path is proven on the reference engine's MoE, which decodes exactly as vLLM's Qwen2-MoE does with the
same weights (tests/real_vllm/test_routed_experts.py)."""

from __future__ import annotations

import asyncio
import base64
import io
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import numpy as np
import pytest
from _moe import reference_routing
from _procs import Proc, start_replica, start_router
from _wait import until

from psrl._proto import replica_control_pb2 as rc
from psrl._proto import replica_control_pb2_grpc as rc_grpc
from psrl.coordinator import RolloutCoordinator
from psrl.gateway.processes import stop_processes
from psrl.router.pipeline.context import GenerationInput, SamplingSpec
from psrl.router.pipeline.execute import WorkerCall
from psrl.router.registry import WorkerRegistry
from psrl.router.worker_client import WorkerClients
from psrl.tito import build_training_arrays
from psrl.worker.moe_model_folder import build_tiny_moe_model_folder

PROMPT = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30]


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_moe_model_folder(tmp_path_factory.mktemp("tiny-moe"))


@pytest.fixture(scope="module")
def moe_fleet(moe_dir: Path, log_dir: Path) -> Iterator[tuple[Proc, Proc, Proc]]:
    a = start_replica(moe_dir, log_dir)
    b = start_replica(moe_dir, log_dir)
    args = ["--enable-routing-loop", "--policy", "least_load", "--load-poll-interval-s", "0", "--kv-transfer-enable"]
    router = start_router(log_dir, [a.url, b.url], args=args)
    yield router, a, b
    stop_processes([router.proc, a.proc, b.proc])


def _body(n: int, **extra: object) -> dict:
    return {
        "input_ids": PROMPT,
        "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True, "detokenize": False},
        **extra,
    }


def _psrl(rid: int) -> dict[str, str]:
    return {"x-request-id": str(rid), "x-prompt-id": str(rid)}


def _decode(b64: str) -> np.ndarray:
    return np.load(io.BytesIO(base64.b64decode(b64)), allow_pickle=False)


def test_generate_returns_the_routing_of_every_position_fed(moe_fleet, moe_dir) -> None:
    router = moe_fleet[0]
    out = httpx.post(f"{router.url}/generate", json=_body(8, return_routed_experts=True), timeout=60).json()
    meta = out["meta_info"]
    rows = _decode(meta["routed_experts"])
    assert (
        rows.dtype == np.uint8 and rows.shape == (len(PROMPT) + 8 - 1, 2, 2) and meta["routed_experts_start_len"] == 0
    )
    np.testing.assert_array_equal(rows, reference_routing(moe_dir, (PROMPT + out["output_ids"])[:-1]))
    tail = httpx.post(
        f"{router.url}/generate", json=_body(8, return_routed_experts=True, routed_experts_start_len=15), timeout=60
    ).json()
    assert tail["output_ids"] == out["output_ids"] and tail["meta_info"]["routed_experts_start_len"] == 15
    np.testing.assert_array_equal(_decode(tail["meta_info"]["routed_experts"]), rows[15:])
    plain = httpx.post(f"{router.url}/generate", json=_body(8), timeout=60).json()
    assert "routed_experts" not in plain["meta_info"] and plain["output_ids"] == out["output_ids"]


def test_bad_routed_experts_fields_are_400s(moe_fleet) -> None:
    router = moe_fleet[0]
    for extra in (
        {"return_routed_experts": "yes"},
        {"return_routed_experts": True, "routed_experts_start_len": -2},
        {"return_routed_experts": True, "routed_experts_start_len": len(PROMPT) + 1},
    ):
        r = httpx.post(f"{router.url}/generate", json=_body(2, **extra), timeout=60)
        assert r.status_code == 400, (extra, r.text)


def test_a_request_a_sync_interrupts_merges_its_routing_exactly(moe_fleet, moe_dir) -> None:
    router, a, b = moe_fleet
    n = 2000
    body = _body(n, return_routed_experts=True, routed_experts_start_len=4)

    async def running() -> bool:
        for p in (a, b):
            async with grpc.aio.insecure_channel(p.url.removeprefix("grpc://")) as channel:
                state = await rc_grpc.ReplicaControlStub(channel).GetSyncState(rc.GetSyncStateRequest(), timeout=5)
            if state.running_requests:
                return True
        return False

    async def scenario() -> tuple[dict, dict]:
        async with (
            httpx.AsyncClient(base_url=router.url, timeout=300) as client,
            RolloutCoordinator(router.url) as coordinator,
        ):
            first = await client.post("/generate", json=body, headers=_psrl(1))
            assert first.status_code == 200, first.text
            task = asyncio.ensure_future(client.post("/generate", json=body, headers=_psrl(2)))
            await until(running, "the request runs on a replica", timeout_s=60, poll_s=0.01)
            await asyncio.sleep(0.2)  # mid-decode
            report = await coordinator.sync_weights(1, seed=0)  # the same weights: greedy goes on unchanged
            assert report.aborted_requests == 1
            second = await task
            assert second.status_code == 200, second.text
            metrics = (await client.get("/metrics")).text
            assert 'psrl_router_kv_transfers_total{outcome="moved"} 1.0' in metrics  # its KV came along
            return first.json(), second.json()

    first, second = asyncio.run(scenario())
    assert second["output_ids"] == first["output_ids"] and len(second["output_ids"]) == n
    versions = second["meta_info"]["output_token_versions"]
    assert 0 in versions and 1 in versions  # it did loop back: tokens before and after the sync
    merged = _decode(second["meta_info"]["routed_experts"])
    assert merged.shape == (len(PROMPT) + n - 1 - 4, 2, 2)
    np.testing.assert_array_equal(merged, _decode(first["meta_info"]["routed_experts"]))
    np.testing.assert_array_equal(merged, reference_routing(moe_dir, (PROMPT + first["output_ids"])[:-1])[4:])


def test_a_dense_fleet_answers_null(router) -> None:
    out = httpx.post(f"{router.url}/generate", json=_body(3, return_routed_experts=True), timeout=60).json()
    assert out["meta_info"]["routed_experts"] is None and len(out["output_ids"]) == 3


@pytest.mark.parametrize("stream", [True, False])
async def test_a_stop_string_the_router_sees_after_a_loop_back_keeps_the_rows_of_the_ids_kept(
    moe_fleet, moe_dir, stream: bool
) -> None:
    """The replica never saw a stop string begun before a loop-back, so the router ends the segment itself
    (end_at_stop) and cuts its ids: a stream's replica is aborted there, and the rows of the ids kept are taken.
    A non-streamed call's rows came with its one frame, before the cut: those of the ids kept are kept."""
    replica = moe_fleet[1]
    registry = WorkerRegistry()
    worker = registry.create_worker("w", replica.url, models=["m"], labels={})
    [instance] = worker.instances
    clients = WorkerClients()
    budget = 2000 if stream else 12  # a non-streamed call's one delta holds every id
    gen = GenerationInput(
        f"cut-{stream}",
        PROMPT,
        SamplingSpec(temperature=0.0, max_tokens=budget, ignore_eos=True),
        stream,
        routed_experts_start=5,
    )
    call = WorkerCall(clients, instance, gen, timeout_s=60)
    try:
        await call.start()
        deltas = call.deltas()
        async for delta in deltas:
            if len(call.result.output_ids) >= 6:
                cut = call.end_at_stop(delta, 1 if stream else 4, "stop")  # keep the delta's first id(s)
                break
        await deltas.aclose()
        await call.routed_experts_after_cut()
    finally:
        call.cancel()
        await clients.close()
    kept = call.result.output_ids
    assert cut.token_ids == delta.token_ids[: 1 if stream else 4] and len(kept) >= (6 if stream else 4)
    routed = call.result.routed_experts
    assert routed is not None and routed.prompt_start == 5
    np.testing.assert_array_equal(routed.rows, reference_routing(moe_dir, (PROMPT + kept)[:-1])[5:])


def test_tito_turns_record_their_routing_for_training(moe_fleet, moe_dir, log_dir) -> None:
    """With --tito-routed-experts, each turn's record carries its rows: the training arrays hold the routing of
    every position of the trajectory the model was fed, the second turn's rows starting where the first's end."""
    _, a, b = moe_fleet
    router = start_router(log_dir, [a.url, b.url], args=["--tito-routed-experts"])
    try:
        sid = httpx.post(f"{router.url}/tito/sessions", timeout=30).json()["session_id"]
        headers = {"x-smg-tito-session-id": sid}
        messages = [{"role": "user", "content": "hello there"}]
        for turn in range(2):
            body = {"messages": messages, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
            r = httpx.post(f"{router.url}/v1/chat/completions", json=body, headers=headers, timeout=60)
            assert r.status_code == 200, r.text
            messages = [*messages, r.json()["choices"][0]["message"], {"role": "user", "content": f"more {turn}"}]
        snapshot = httpx.get(f"{router.url}/tito/sessions/{sid}", timeout=30).json()
        arrays = build_training_arrays(snapshot)
        assert arrays.num_turns == 2 and arrays.routed_experts is not None
        fed = [*arrays.prompt_ids, *arrays.response_ids][:-1]
        assert arrays.routed_experts.shape == (len(fed), 2, 2)
        np.testing.assert_array_equal(arrays.routed_experts, reference_routing(moe_dir, fed))
    finally:
        stop_processes([router.proc])
