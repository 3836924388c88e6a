"""KV migration between real vLLM replicas of ours (`--engine vllm` loads psrl's KV connector): a request a weight
sync aborts mid-decode continues elsewhere with its prompt's KV moved, not prefilled, and with exactly the ids
an uninterrupted run makes; every failure recomputes."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from _procs import Proc, start_replica, start_router
from _vllm import greedy_request, start_vllm_replica
from _wait import until
from smg_grpc_proto.generated import vllm_engine_pb2 as pb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as pb_grpc

from psrl._proto import kv_migration_pb2 as kv
from psrl._proto import kv_migration_pb2_grpc as kv_grpc
from psrl._proto import replica_control_pb2 as rc
from psrl._proto import replica_control_pb2_grpc as rc_grpc
from psrl.coordinator import RolloutCoordinator
from psrl.gateway.processes import stop_processes
from psrl.kv import KVCacheSpec, LayoutError
from psrl.worker.model_folder import WEIGHTS_FILE

BLOCK = 128  # vLLM's CPU block size
N = 1000  # greedy tokens: the tiny model decodes hundreds a second here, so a sync lands mid-decode


def _prompt(seed: int, n: int = 300) -> list[int]:
    """A prompt no other test uses, so no replica's prefix cache holds any of it."""
    rng = random.Random(seed)
    return [rng.randrange(3, 700) for _ in range(n)]


def _target(proc: Proc) -> str:
    return proc.url.removeprefix("grpc://")


async def _generate(
    target: str, rid: str, prompt: list[int], n: int, params: dict[str, Any] | None = None
) -> tuple[list[int], pb.GenerateComplete]:
    ids: list[int] = []
    async with grpc.aio.insecure_channel(target) as channel:
        request = greedy_request(rid, prompt, n, params)
        async for frame in pb_grpc.VllmEngineStub(channel).Generate(request, timeout=300):
            if frame.WhichOneof("response") == "chunk":
                ids += frame.chunk.token_ids
            else:
                return ids, frame.complete
    raise AssertionError("no complete frame")


async def _interrupted(target: str, rid: str, prompt: list[int], weights: str | None, after: int = 300) -> list[int]:
    """Run `rid` on `target` until it made `after` tokens, then a weight sync there (pause with abort, reload
    `weights` unless None, resume); the ids it made before the abort."""
    ids: list[int] = []

    async def run() -> str:
        async with grpc.aio.insecure_channel(target) as channel:
            request = greedy_request(rid, prompt, N)
            async for frame in pb_grpc.VllmEngineStub(channel).Generate(request, timeout=300):
                if frame.WhichOneof("response") == "chunk":
                    ids.extend(frame.chunk.token_ids)
                else:
                    return frame.complete.finish_reason
        raise AssertionError("no complete frame")

    task = asyncio.ensure_future(run())
    while len(ids) < after:
        assert not task.done(), "the request ended before the sync"
        await asyncio.sleep(0.005)
    async with grpc.aio.insecure_channel(target) as channel:
        control = rc_grpc.ReplicaControlStub(channel)
        paused = await control.PauseGeneration(rc.PauseGenerationRequest(mode=rc.PAUSE_MODE_ABORT), timeout=60)
        assert list(paused.aborted_request_ids) == [rid]
        if weights is not None:
            await control.LoadWeights(rc.LoadWeightsRequest(path=weights, version=1), timeout=120)
        await control.ResumeGeneration(rc.ResumeGenerationRequest(), timeout=60)
    assert await task == "abort"
    assert after <= len(ids) < N
    return ids


async def _reload(target: str, weights: str) -> None:
    """A weight sync with nothing running: vLLM's prefix cache is reset."""
    async with grpc.aio.insecure_channel(target) as channel:
        control = rc_grpc.ReplicaControlStub(channel)
        await control.PauseGeneration(rc.PauseGenerationRequest(mode=rc.PAUSE_MODE_ABORT), timeout=60)
        await control.LoadWeights(rc.LoadWeightsRequest(path=weights, version=1), timeout=120)
        await control.ResumeGeneration(rc.ResumeGenerationRequest(), timeout=60)


async def _stats(target: str) -> kv.KvMigrationStats:
    async with grpc.aio.insecure_channel(target) as channel:
        return await kv_grpc.KvMigrationStub(channel).GetKvMigrationStats(kv.GetKvMigrationStatsRequest(), timeout=10)


def _params(source: str, rid: str, prompt: list[int], mode: str = "sync") -> dict[str, Any]:
    """What the router's loop-back sends (psrl.router.dispatch.Dispatcher.kv_transfer_params)."""
    return {
        "source": {"target": source, "dp_rank": 0},
        "request_id": rid,
        "num_tokens": len(prompt) - 1,
        "mode": mode,
        "timeout_ms": 5000,
    }


async def _continued(
    dest: str, source: str, rid: str, prompt: list[int], got: list[int], mode: str = "sync"
) -> tuple[list[int], pb.GenerateComplete]:
    """The aborted `rid` looped back to `dest` as the router sends it (params naming `source`): every id it made,
    before and after the abort, and the complete frame."""
    looped = prompt + got
    rest, complete = await _generate(dest, f"{rid}-2", looped, N - len(got), _params(source, rid, looped, mode))
    return got + rest, complete


async def _recomputed(dest: str, source: str, rid: str, looped: list[int], n: int) -> list[int]:
    """Loop `rid` back to `dest` with params naming `source`, where the pull must fail: the ids it makes, after
    checking that nothing moved, the fallback was counted and the whole prompt was prefilled."""
    before = await _stats(dest)
    ids, complete = await _generate(dest, f"{rid}-2", looped, n, _params(source, rid, looped))
    assert json.loads(complete.kv_transfer_params_json) == {"moved_tokens": 0}
    after = await _stats(dest)
    assert after.fallbacks == before.fallbacks + 1 and after.transfers_in == before.transfers_in
    assert after.prompt_tokens_computed - before.prompt_tokens_computed == len(looped)
    return ids


def _whole_blocks(prompt: list[int]) -> int:
    """The tokens whose KV moves: whole blocks, never the prompt's last token."""
    return (len(prompt) - 1) // BLOCK * BLOCK


def test_cache_views_move_whole_blocks_of_either_vllm_layout() -> None:
    from psrl.worker.vllm_kv import _copy_blocks, cache_views

    torch = pytest.importorskip("torch")
    gen = torch.Generator().manual_seed(0)
    # vLLM's CPU cache (K transposed beside V in each block: opaque bytes) and a [num_blocks, 2, ...] GPU-style one.
    for make, layout in (
        (lambda: torch.randn(8, 2, BLOCK, 64, generator=gen), "opaque"),
        (lambda: torch.randn(8, 2, BLOCK, 2, 32, generator=gen), "NHD"),
    ):
        src_raw, dst_raw = [make() for _ in range(2)], [make() for _ in range(2)]
        src, spec = cache_views(src_raw, BLOCK)
        dst, _ = cache_views(dst_raw, BLOCK)
        assert (spec.num_layers, spec.block_size, spec.num_kv_heads, spec.head_size) == (2, BLOCK, 2, 32)
        assert spec.block_layout == layout
        _copy_blocks(src, [5, 3], dst, [1, 6])
        for s_layer, d_layer in zip(src_raw, dst_raw, strict=True):
            assert torch.equal(d_layer[1], s_layer[5]) and torch.equal(d_layer[6], s_layer[3])
    with pytest.raises(LayoutError, match="block size"):
        cache_views([torch.zeros(4, 2, 64, 64)], BLOCK)


@pytest.fixture(scope="module")
def weights(vllm_model_dir: Path) -> str:
    return str(vllm_model_dir / WEIGHTS_FILE)  # what the replicas started with: a sync that changes nothing


@pytest.mark.parametrize("mode", ["sync", "async", "pin_sync"])
def test_a_request_aborted_mid_decode_continues_on_a_peer_without_prefill(vllm_pair, weights, mode: str) -> None:
    a, b = (_target(p) for p in vllm_pair)
    prompt = _prompt({"sync": 1001, "async": 1002, "pin_sync": 1003}[mode])

    async def scenario() -> None:
        reference, _ = await _generate(a, f"ref-{mode}", prompt, N)
        got = await _interrupted(a, f"mig-{mode}", prompt, weights)
        before_a, before_b = await _stats(a), await _stats(b)
        ids, complete = await _continued(b, a, f"mig-{mode}", prompt, got, mode)
        assert ids == reference
        looped = prompt + got
        moved = _whole_blocks(looped)
        assert json.loads(complete.kv_transfer_params_json) == {"moved_tokens": moved}
        assert complete.cached_tokens == moved
        after_a, after_b = await _stats(a), await _stats(b)
        assert after_b.transfers_in == before_b.transfers_in + 1
        assert after_b.tokens_in == before_b.tokens_in + moved
        assert after_b.bytes_in > before_b.bytes_in and after_b.fallbacks == before_b.fallbacks
        # Only what did not move was prefilled on B.
        assert after_b.prompt_tokens_computed - before_b.prompt_tokens_computed == len(looped) - moved
        assert after_a.transfers_out == before_a.transfers_out + 1
        # B's ReleaseKv (sent in the background) ends A's pin.
        for _ in range(200):
            if (await _stats(a)).pinned_requests == before_a.pinned_requests - 1:
                break
            await asyncio.sleep(0.02)
        assert (await _stats(a)).pinned_requests == before_a.pinned_requests - 1

    asyncio.run(scenario())


def test_back_on_its_own_replica_a_request_takes_its_pin_without_a_transfer(vllm_pair, weights) -> None:
    a = _target(vllm_pair[0])
    prompt = _prompt(2001)

    async def scenario() -> None:
        reference, _ = await _generate(a, "own-ref", prompt, N)
        # A reload resets vLLM's prefix cache: the request's KV is only in its pin, copied in locally.
        got = await _interrupted(a, "own", prompt, weights)
        # A sibling with the same prompt puts its whole blocks back into the prefix cache: the pin fills the rest.
        await _generate(a, "own-sibling", prompt, 1)
        before = await _stats(a)
        assert before.pinned_requests >= 1
        ids, complete = await _continued(a, a, "own", prompt, got)
        assert ids == reference
        looped = prompt + got
        assert json.loads(complete.kv_transfer_params_json) == {"moved_tokens": _whole_blocks(looped)}
        assert complete.cached_tokens == _whole_blocks(looped)
        after = await _stats(a)
        assert (after.transfers_in, after.transfers_out) == (before.transfers_in, before.transfers_out)
        assert after.prompt_tokens_computed - before.prompt_tokens_computed == len(looped) - _whole_blocks(looped)
        assert after.pinned_requests == before.pinned_requests - 1

        # No reload: vLLM's prefix cache still holds the blocks, nothing is copied and the pin is dropped.
        got = await _interrupted(a, "own-b", prompt, None)
        before = await _stats(a)
        ids, complete = await _continued(a, a, "own-b", prompt, got)
        assert ids == reference
        looped = prompt + got
        assert json.loads(complete.kv_transfer_params_json) == {"moved_tokens": _whole_blocks(looped)}
        assert complete.cached_tokens == _whole_blocks(looped)
        after = await _stats(a)
        assert after.pinned_requests == before.pinned_requests - 1
        assert (after.transfers_in, after.transfers_out, after.fallbacks) == (
            before.transfers_in,
            before.transfers_out,
            before.fallbacks,
        )

    asyncio.run(scenario())


def test_a_source_killed_before_the_pull_recomputes_exactly(vllm_model_dir, vllm_pair, weights, log_dir) -> None:
    b = _target(vllm_pair[1])
    prompt = _prompt(3001)
    source = start_vllm_replica(vllm_model_dir, log_dir)
    try:

        async def scenario() -> None:
            c = _target(source)
            reference, _ = await _generate(c, "gone-ref", prompt, N)
            got = await _interrupted(c, "gone", prompt, weights)
            stop_processes([source.proc])
            assert got + await _recomputed(b, c, "gone", prompt + got, N - len(got)) == reference

        asyncio.run(scenario())
    finally:
        stop_processes([source.proc])


@pytest.mark.parametrize("params", ["[" * 5000, '{"a": ' * 3000 + "1" + "}" * 3000])
def test_kv_transfer_params_that_do_not_parse_within_bounds_are_invalid_argument(vllm_pair, params: str) -> None:
    """Refused before the stock servicer's unbounded json.loads (a field the connector cannot use only makes it
    recompute)."""
    request = greedy_request("bad-params", _prompt(5), 2)
    request.kv_transfer_params_json = params

    async def call() -> grpc.StatusCode:
        async with grpc.aio.insecure_channel(_target(vllm_pair[0])) as channel:
            try:
                async for _ in pb_grpc.VllmEngineStub(channel).Generate(request, timeout=60):
                    pass
            except grpc.aio.AioRpcError as e:
                return e.code()
        return grpc.StatusCode.OK

    assert asyncio.run(call()) == grpc.StatusCode.INVALID_ARGUMENT


def test_a_layout_mismatch_recomputes(vllm_model_dir, vllm_pair, weights, log_dir) -> None:
    a = _target(vllm_pair[0])
    prompt = _prompt(4001)
    other = start_vllm_replica(vllm_model_dir, log_dir, engine_args=["--block-size", "64"])
    try:

        async def scenario() -> None:
            d = _target(other)
            # The source refuses a peer whose blocks differ, with the reason.
            async with grpc.aio.insecure_channel(a) as channel:
                layout = KVCacheSpec(2, BLOCK, 2, 32, "float32", "NHD").to_dict()
                reply = await kv_grpc.KvMigrationStub(channel).TransferKv(
                    kv.TransferKvRequest(request_id="x", token_ids=prompt, layout_json=json.dumps(layout)), timeout=10
                )
                # PinKv has no meaning on vLLM (a request is pinned when it is aborted): the proxy passes the
                # side channel's refusal through with its code and words.
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await kv_grpc.KvMigrationStub(channel).PinKv(kv.PinKvRequest(request_id="x", ttl_ms=1000))
            assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED and "when the request is aborted" in str(
                info.value.details()
            )
            assert (
                reply.num_tokens == 0 and reply.reason.startswith("layout mismatch") and "block_layout" in reply.reason
            )

            reference, _ = await _generate(d, "shape-ref", prompt, N)
            await _reload(d, weights)  # so D's prefix cache holds none of it
            got = await _interrupted(a, "shape", prompt, weights)
            assert got + await _recomputed(d, a, "shape", prompt + got, N - len(got)) == reference

        asyncio.run(scenario())
    finally:
        stop_processes([other.proc])


def test_a_mixed_fleet_never_exchanges_kv(vllm_model_dir, vllm_pair, weights, log_dir) -> None:
    """A reference replica and a vLLM replica: each asks the other, each is refused (their blocks differ), and
    each recomputes exactly what it would have without the loop-back's params."""
    a = _target(vllm_pair[0])
    ref_proc = start_replica(vllm_model_dir, log_dir)
    try:

        async def scenario() -> None:
            r = ref_proc.url.removeprefix("grpc://")
            for source, dest, rid, seed in ((a, r, "mixed-v", 5001), (r, a, "mixed-r", 5002)):
                prompt = _prompt(seed)
                got = await _interrupted(source, rid, prompt, None)
                looped = prompt + got
                rest = await _recomputed(dest, source, rid, looped, 50)
                plain, _ = await _generate(dest, f"{rid}-plain", looped, 50)
                assert rest == plain

        asyncio.run(scenario())
    finally:
        stop_processes([ref_proc.proc])


@pytest.fixture(scope="module")
def kv_router(vllm_pair: list[Proc], log_dir: Path) -> Iterator[Proc]:
    args = ["--enable-routing-loop", "--policy", "least_load", "--load-poll-interval-s", "0", "--kv-transfer-enable"]
    proc = start_router(log_dir, [p.url for p in vllm_pair], args=args)
    yield proc
    stop_processes([proc.proc])


def test_through_the_router_a_synced_request_moves_its_kv(kv_router: Proc, vllm_pair, weights) -> None:
    """The user's path: the router's partial rollout loops the aborted request back with kv_transfer_params."""
    body = {
        "input_ids": _prompt(6001),
        "sampling_params": {"max_new_tokens": N, "temperature": 0, "ignore_eos": True, "detokenize": False},
    }

    async def running() -> bool:
        for p in vllm_pair:
            async with grpc.aio.insecure_channel(_target(p)) as channel:
                state = await rc_grpc.ReplicaControlStub(channel).GetSyncState(rc.GetSyncStateRequest(), timeout=5)
            if state.running_requests:
                return True
        return False

    async def scenario() -> None:
        async with (
            httpx.AsyncClient(base_url=kv_router.url, timeout=300) as client,
            RolloutCoordinator(kv_router.url) as coordinator,
        ):
            first = await client.post("/generate", json=body, headers={"x-request-id": "1", "x-prompt-id": "1"})
            assert first.status_code == 200, first.text
            task = asyncio.ensure_future(
                client.post("/generate", json=body, headers={"x-request-id": "2", "x-prompt-id": "2"})
            )
            await until(running, "the request runs on a replica", timeout_s=60, poll_s=0.01)
            await asyncio.sleep(0.5)  # mid-decode, past the prompt's first block
            report = await coordinator.sync_weights(1, path=weights)
            assert report.aborted_requests == 1
            second = await task
            assert second.status_code == 200, second.text
            assert second.json()["output_ids"] == first.json()["output_ids"]
            metrics = (await client.get("/metrics")).text
            assert 'psrl_router_kv_transfers_total{outcome="moved"} 1.0' in metrics

    asyncio.run(scenario())
