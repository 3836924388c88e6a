"""The KvMigration service and the destination's pull, in process over a real gRPC server: the error paths
(the happy paths run over real replica processes in tests/kv/test_migration_e2e.py)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import subprocess
import threading
import time
from collections.abc import AsyncIterator, Callable
from types import SimpleNamespace
from typing import Any

import grpc
import pytest

from psrl._proto import kv_migration_pb2 as pb
from psrl._proto import kv_migration_pb2_grpc as pb_grpc
from psrl.engine import AsyncEngine, CacheConfig, Engine, ModelConfig, SamplingOptions
from psrl.kv import DeviceKind
from psrl.worker import kv_migration
from psrl.worker.kv_migration import (
    EngineKvHolder,
    KvMigrationServicer,
    KvPuller,
    KvSourceClient,
    KvTransferParams,
    _in_thread,
    layout_of,
    remove_stale_segments,
    same_server,
)
from psrl.worker.servicer import ReferenceServicer, _KvMoved

PROMPT = list(range(1, 40))
NODE = "node-a"  # the in-process source's node


def _puller(
    servicer: KvMigrationServicer, self_target: str = "127.0.0.1:1", *, node_id: str = NODE, **kwargs: Any
) -> KvPuller:
    """A destination on `node_id` (the source's, unless told) whose own server is at `self_target`."""
    return KvPuller(servicer.counters, KvSourceClient(self_target, node_id=node_id), **kwargs)


def _engine() -> AsyncEngine:
    engine = Engine(ModelConfig(vocab_size=256), CacheConfig(block_size=16, num_blocks=64), seed=0)
    engine.kv_pin_ttl_s = 30.0
    return AsyncEngine(engine)


async def _abort(engine: AsyncEngine, request_id: str, stream: AsyncIterator[object]) -> None:
    """Abort and read the stream to its end: the abort notice comes after any forward that was in flight, so
    the blocks the abort freed behind that forward are free by then."""
    assert await engine.abort(request_id)
    async for _ in stream:
        pass


async def _collect(stream: AsyncIterator[object]) -> list[Any]:
    return [o async for o in stream]


async def _eventually(condition: Callable[[], bool], timeout_s: float = 20.0) -> bool:
    """Poll `condition` until it holds (True) or `timeout_s` passes (False); generous for a loaded CI box."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.02)
    return True


async def _pinned_and_aborted(target: str, engine: AsyncEngine, request_id: str, prompt: list[int]) -> int:
    """Run a request past its prefill, pin its KV through the service (PinKv), abort it as a sync pause would;
    returns the tokens pinned."""
    stream = engine.generate(request_id, prompt, SamplingOptions(temperature=0.0, max_tokens=50, ignore_eos=True))
    await stream.__anext__()  # prefilled: the prompt's KV is computed
    async with grpc.aio.insecure_channel(target) as ch:
        pinned = await pb_grpc.KvMigrationStub(ch).PinKv(pb.PinKvRequest(request_id=request_id, ttl_ms=10_000))
    await _abort(engine, request_id, stream)
    return pinned.num_tokens


@contextlib.asynccontextmanager
async def _serving(shm_pool_bytes: int) -> AsyncIterator[tuple[str, KvMigrationServicer]]:
    """A replica's migration service on its own port (a segment per transfer, or `shm_pool_bytes` pooled)."""
    servicer = KvMigrationServicer(EngineKvHolder([_engine()]), node_id=NODE, shm_pool_bytes=shm_pool_bytes)
    server = grpc.aio.server()
    pb_grpc.add_KvMigrationServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}", servicer
    finally:
        await server.stop(0)
        servicer.close()
        for e in servicer.holder.engines:
            e.shutdown()


@pytest.fixture(params=[0, 16 << 20], ids=["fresh-segments", "pooled-segments"])
async def source(request: pytest.FixtureRequest) -> AsyncIterator[tuple[str, KvMigrationServicer]]:
    async with _serving(request.param) as served:
        yield served


async def test_transfer_refusals_say_why(source) -> None:
    target, servicer = source
    async with grpc.aio.insecure_channel(target) as ch:
        stub = pb_grpc.KvMigrationStub(ch)
        reply = await stub.TransferKv(pb.TransferKvRequest(request_id="nope", token_ids=PROMPT, max_tokens=38))
        assert reply.num_tokens == 0 and "no KV held" in reply.reason
        reply = await stub.TransferKv(pb.TransferKvRequest(request_id="nope", token_ids=PROMPT, channel="nccl"))
        assert reply.num_tokens == 0 and "not served" in reply.reason
        theirs = layout_of(servicer.holder.engines[0]).to_dict() | {"num_kv_heads": 99}
        reply = await stub.TransferKv(
            pb.TransferKvRequest(request_id="nope", token_ids=PROMPT, layout_json=json.dumps(theirs))
        )
        assert reply.num_tokens == 0 and "layout mismatch" in reply.reason and "num_kv_heads" in reply.reason
        assert not (await stub.ReleaseKv(pb.ReleaseKvRequest(transfer_id="unknown"))).released
        assert not (await stub.UnpinKv(pb.UnpinKvRequest(request_id="nope"))).unpinned
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.PinKv(pb.PinKvRequest(request_id="nope", ttl_ms=1000))
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.GetKvMigrationStats(pb.GetKvMigrationStatsRequest(data_parallel_rank=3))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_pull_moves_the_pinned_prefix_and_falls_back_when_the_source_is_gone(source) -> None:
    target, servicer = source
    src = servicer.holder.engines[0]
    assert await _pinned_and_aborted(target, src, "r", PROMPT) >= len(PROMPT)
    dest = _engine()
    puller = _puller(servicer)
    try:
        params = KvTransferParams(target, 0, "r", num_tokens=0, mode="sync", timeout_ms=5000)
        kv = await puller.pull(dest, 0, PROMPT, params)
        assert kv is not None and kv.num_tokens == len(PROMPT) - 1
        assert servicer.counters[0].transfers_in == 1 and servicer.counters[0].transfers_out == 1
        # The acknowledgement that ends the pin goes out in the background.
        assert await _eventually(lambda: src.engine.num_pinned == 0)
        dest.engine.release_blocks(kv.block_ids)
        gone = KvTransferParams("127.0.0.1:9", 0, "r", num_tokens=0, mode="sync", timeout_ms=300)
        assert await puller.pull(dest, 0, PROMPT, gone) is None
        assert servicer.counters[0].fallbacks == 1 and dest.engine.num_used_blocks == 0
    finally:
        await puller.close()
        dest.shutdown()


@pytest.mark.parametrize(
    "data",
    [
        {},
        {"source": "h:1", "request_id": "r"},
        {"source": {"target": "h:1"}, "request_id": "r", "mode": "eventually"},
        {"source": {"target": "h:1"}, "request_id": "r", "timeout_ms": 0},
    ],
)
def test_bad_transfer_params_are_a_clear_error(data: dict) -> None:
    with pytest.raises(ValueError, match=r"^Invalid kv_transfer_params_json"):
        KvTransferParams.from_dict(data)
    good = {"source": {"target": "h:1", "dp_rank": 2}, "request_id": "r", "num_tokens": 7, "mode": "pin_sync"}
    assert KvTransferParams.from_dict(good) == KvTransferParams("h:1", 2, "r", 7, "pin_sync", 5000)


def test_segments_of_dead_processes_are_removed(tmp_path) -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    (tmp_path / f"psrl-kv-{dead.pid}-{'a' * 32}").write_bytes(b"x")
    (tmp_path / f"psrl-kv-{os.getpid()}-{'b' * 32}").write_bytes(b"x")  # alive: kept
    (tmp_path / "other-segment").write_bytes(b"x")
    assert remove_stale_segments(tmp_path) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other-segment", f"psrl-kv-{os.getpid()}-{'b' * 32}"]


async def test_what_the_destination_holds_already_is_not_moved(source) -> None:
    target, servicer = source
    src = servicer.holder.engines[0]
    prompt = list(range(1, 70))  # 69 tokens: 68 to have, 4 full blocks + 4 tokens
    await _pinned_and_aborted(target, src, "r", prompt)
    dest = _engine()
    warm = dest.generate("w", prompt[:40], SamplingOptions(temperature=0.0, max_tokens=1))
    async for _ in warm:  # the destination's prefix cache now holds the first 2 full blocks (32 tokens)
        pass
    puller = _puller(servicer)
    try:
        kv = await puller.pull(dest, 0, prompt, KvTransferParams(target, 0, "r", 0, "sync", 5000))
        assert kv is not None and kv.num_tokens == 68 and len(kv.block_ids) == 5
        assert servicer.counters[0].tokens_in == 68 - 32  # only [32, 68) came over
        # the KV it got equals the source's for every moved and held position
        src_layers, dst_layers = src.engine.kv_cache.layers, dest.engine.kv_cache.layers
        lease = src.engine.lease_kv("r", prompt, allow_prefix_cache=False)
        for pos in (0, 31, 32, 50, 67):
            s_block, d_block = lease.block_ids[pos // 16], kv.block_ids[pos // 16]
            for s_layer, d_layer in zip(src_layers, dst_layers):
                assert (s_layer[:, s_block, pos % 16] == d_layer[:, d_block, pos % 16]).all()
        src.engine.release_blocks(lease.block_ids)
        dest.engine.release_blocks(kv.block_ids)
    finally:
        await puller.close()
        dest.shutdown()


async def test_a_cancelled_copy_is_waited_for_and_its_result_discarded() -> None:
    """A pull that times out mid-copy must not free blocks the copy thread still writes."""
    copying, release, discarded = threading.Event(), threading.Event(), []

    def copy() -> str:
        copying.set()
        release.wait(5)
        return "segment"

    task = asyncio.create_task(_in_thread(copy, discard=discarded.append))
    assert await asyncio.to_thread(copying.wait, 5)
    task.cancel()
    await asyncio.sleep(0)  # one loop turn: the task takes the cancellation (and must wait on)
    assert not task.done()  # still waiting for the thread
    task.cancel()  # a second cancellation does not cut the wait short either
    await asyncio.sleep(0)
    assert not task.done()
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert discarded == ["segment"]


async def test_transfer_ranges_the_peer_already_holds_are_refused(source) -> None:
    target, servicer = source
    src = servicer.holder.engines[0]
    await _pinned_and_aborted(target, src, "r", PROMPT)
    async with grpc.aio.insecure_channel(target) as ch:
        stub = pb_grpc.KvMigrationStub(ch)
        used = src.engine.num_used_blocks
        reply = await stub.TransferKv(pb.TransferKvRequest(request_id="r", token_ids=PROMPT, start_token=5))
        assert reply.num_tokens == 0 and "not block-aligned" in reply.reason
        reply = await stub.TransferKv(pb.TransferKvRequest(request_id="r", token_ids=PROMPT, start_token=48))
        assert reply.num_tokens == 0 and "already holds 48" in reply.reason
        assert src.engine.num_used_blocks == used  # the lease was given back
        reply = await stub.TransferKv(pb.TransferKvRequest(request_id="r", token_ids=PROMPT, start_token=16))
        assert reply.num_tokens == len(PROMPT) and json.loads(reply.transfer_json)["num_tokens"] == len(PROMPT) - 16
        assert (await stub.ReleaseKv(pb.ReleaseKvRequest(transfer_id=reply.transfer_id))).released
    assert src.engine.num_pinned == 0 and src.engine.num_used_blocks == 0


async def test_a_prompt_the_destination_holds_needs_no_transfer(source) -> None:
    target, servicer = source
    dest = _engine()
    async for _ in dest.generate("w", [*PROMPT, 99], SamplingOptions(temperature=0.0, max_tokens=1)):
        pass  # the destination caches PROMPT's 2 full blocks (32 tokens)
    puller = _puller(servicer)
    try:
        kv = await puller.pull(dest, 0, PROMPT[:33], KvTransferParams(target, 0, "gone", 0, "sync", 5000))
        assert kv is not None and kv.num_tokens == 32  # all it needs is here: nothing asked of the source
        assert servicer.counters[0].transfers_in == 0 and servicer.counters[0].transfers_out == 0
        dest.engine.release_blocks(kv.block_ids)
    finally:
        await puller.close()
        dest.shutdown()


async def test_pooled_segments_serve_the_next_pull() -> None:
    async with _serving(16 << 20) as (target, servicer):
        assert servicer.shm_pool is not None
        src = servicer.holder.engines[0]
        dest = _engine()
        puller = _puller(servicer, shm_mappings_bytes=16 << 20)
        try:
            for i in range(3):  # another prompt each time: the reused segment holds the previous request's KV
                rid, prompt = f"r{i}", [t + 7 * i for t in PROMPT]
                await _pinned_and_aborted(target, src, rid, prompt)
                lease = src.engine.lease_kv(rid, prompt, allow_prefix_cache=False)
                kv = await puller.pull(dest, 0, prompt, KvTransferParams(target, 0, rid, 0, "pin_sync", 5000))
                assert kv is not None and lease is not None and kv.num_tokens == len(prompt) - 1
                for pos in range(kv.num_tokens):  # the destination holds exactly the source's KV
                    s_block, d_block = lease.block_ids[pos // 16], kv.block_ids[pos // 16]
                    for s_layer, d_layer in zip(src.engine.kv_cache.layers, dest.engine.kv_cache.layers, strict=True):
                        assert (s_layer[:, s_block, pos % 16] == d_layer[:, d_block, pos % 16]).all()
                src.engine.release_blocks(lease.block_ids)
                dest.engine.release_blocks(kv.block_ids)
                # The acknowledgement that recycles the segment goes out in the background.
                assert await _eventually(lambda: servicer.shm_pool is not None and servicer.shm_pool.idle_bytes > 0)
            assert (servicer.shm_pool.created, servicer.shm_pool.reused) == (1, 2)
            assert puller.shm_mappings is not None and puller.shm_mappings.opened == 1
        finally:
            await puller.close()
            dest.shutdown()


async def test_an_unacknowledged_pooled_segment_is_not_reused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kv_migration, "UNACKED_TRANSFER_TTL_S", 0.0)  # every transfer expires at the next call
    async with _serving(16 << 20) as (target, servicer):
        assert servicer.shm_pool is not None
        src = servicer.holder.engines[0]
        async for _ in src.generate("w", PROMPT, SamplingOptions(temperature=0.0, max_tokens=1)):
            pass  # PROMPT's 2 full blocks are in the source's prefix cache
        request = pb.TransferKvRequest(request_id="w", token_ids=PROMPT, allow_prefix_cache=True)
        async with grpc.aio.insecure_channel(target) as ch:
            stub = pb_grpc.KvMigrationStub(ch)
            first = await stub.TransferKv(request)
            second = await stub.TransferKv(request)  # the first one expired meanwhile: retired, not reused
            assert first.num_tokens == second.num_tokens == 32
            assert json.loads(first.transfer_json)["name"] != json.loads(second.transfer_json)["name"]
            assert (servicer.shm_pool.created, servicer.shm_pool.reused) == (2, 0)
            assert not (await stub.ReleaseKv(pb.ReleaseKvRequest(transfer_id=first.transfer_id))).released


def test_a_replica_knows_its_own_server_under_other_names() -> None:
    loopback = same_server("127.0.0.1:5000")
    assert loopback("127.0.0.1:5000") and loopback("localhost:5000") and loopback("[::1]:5000")
    assert not loopback("127.0.0.1:5001") and not loopback("10.1.2.3:5000") and not loopback("nonsense")
    wildcard = same_server("0.0.0.0:5000")
    assert wildcard("localhost:5000") and wildcard(f"{socket.gethostname()}:5000") and not wildcard("10.255.1.2:6000")
    specific = same_server("10.1.2.3:5000")  # another process may hold port 5000 on another address
    assert specific("10.1.2.3:5000") and not specific("127.0.0.1:5000")
    advertised = same_server("10.1.2.3:5000", "gpu-7.cluster:5000")  # --advertise-host gpu-7.cluster
    assert advertised("gpu-7.cluster:5000") and advertised("GPU-7.cluster:5000") and advertised("10.1.2.3:5000")
    assert not advertised("gpu-7.cluster:5001") and not advertised("gpu-8.cluster:5000")


async def test_the_two_ends_choose_the_channel_among_those_served(source, monkeypatch: pytest.MonkeyPatch) -> None:
    target, servicer = source
    src = servicer.holder.engines[0]
    await _pinned_and_aborted(target, src, "r", PROMPT)
    async with grpc.aio.insecure_channel(target) as ch:
        stub = pb_grpc.KvMigrationStub(ch)

        async def transfer(**fields: Any) -> pb.TransferKvResponse:
            return await stub.TransferKv(pb.TransferKvRequest(request_id="r", token_ids=PROMPT, **fields))

        for device in ("cpu", "cuda"):  # this source's KV is on the CPU: it crosses to no other node
            reply = await transfer(node_id="node-b", device=device)
            assert reply.num_tokens == 0 and reply.reason.startswith("CPU KV does not cross hosts")
            assert f"source is on node {NODE!r} (cpu), the destination on node 'node-b' ({device})" in reply.reason
        reply = await transfer(node_id=NODE, device="cpu", channel="nccl")
        assert reply.num_tokens == 0 and "'nccl' asked for; shm joins" in reply.reason
        reply = await transfer(node_id=NODE, device="tpu")
        assert reply.num_tokens == 0 and "unknown device kind 'tpu'" in reply.reason
        with monkeypatch.context() as m:
            m.setattr(servicer.holder, "device", lambda rank: DeviceKind.CUDA)  # as if its cache were on a GPU
            # one node, both CUDA: CUDA IPC is not served yet, so shared memory (staged through the host)
            reply = await transfer(node_id=NODE, device="cuda", keep_pin=True)
            assert reply.num_tokens == len(PROMPT) and reply.reason == ""
            assert (await stub.ReleaseKv(pb.ReleaseKvRequest(transfer_id=reply.transfer_id))).released
            reply = await transfer(node_id=NODE, device="cuda", channel="cuda_ipc")
            assert reply.num_tokens == 0 and "'cuda_ipc' asked for; shm joins" in reply.reason
            reply = await transfer(node_id="node-b", device="cuda")
            assert reply.num_tokens == 0 and reply.reason == "channel nccl is not served by this replica yet"
            # one node, a CUDA end and a CPU end: shared memory
            reply = await transfer(node_id=NODE, device="cpu", keep_pin=True)
            assert reply.num_tokens == len(PROMPT) and reply.reason == ""
            assert (await stub.ReleaseKv(pb.ReleaseKvRequest(transfer_id=reply.transfer_id))).released
        assert src.engine.num_pinned == 1  # no refusal and no kept transfer ended the pin
        reply = await transfer()  # a peer from before node ids: on this node, over shared memory as then
        assert reply.num_tokens == len(PROMPT)
        assert (await stub.ReleaseKv(pb.ReleaseKvRequest(transfer_id=reply.transfer_id))).released
    assert src.engine.num_pinned == 0


async def test_a_destination_on_another_node_recomputes_and_logs_why(source, caplog: pytest.LogCaptureFixture) -> None:
    target, servicer = source
    src = servicer.holder.engines[0]
    await _pinned_and_aborted(target, src, "r", PROMPT)
    dest = _engine()
    puller = _puller(servicer, node_id="node-b")
    try:
        with caplog.at_level(logging.WARNING, logger=kv_migration.__name__):
            kv = await puller.pull(dest, 0, PROMPT, KvTransferParams(target, 0, "r", 0, "sync", 5000))
        assert kv is None and dest.engine.num_used_blocks == 0
        assert servicer.counters[0].fallbacks == 1 and servicer.counters[0].transfers_out == 0
        assert "recomputing: KvNotOffered: CPU KV does not cross hosts" in caplog.text
        assert src.engine.num_pinned == 1  # kept (until its TTL) for a peer that can take it
    finally:
        await puller.close()
        dest.shutdown()


async def test_a_request_back_on_its_replica_under_another_name_adopts_its_pin(source) -> None:
    target, servicer = source
    src = servicer.holder.engines[0]
    await _pinned_and_aborted(target, src, "r", PROMPT)
    puller = _puller(servicer, target)  # bound at 127.0.0.1; the router knows it as localhost
    try:
        alias = target.replace("127.0.0.1", "localhost")
        kv = await puller.pull(src, 0, PROMPT, KvTransferParams(alias, 0, "r", 0, "sync", 5000))
        assert kv is not None and kv.num_tokens == len(PROMPT) - 1  # the pinned blocks, taken over
        assert servicer.counters[0].transfers_in == servicer.counters[0].transfers_out == 0  # nothing copied
        assert src.engine.num_pinned == 0
        src.engine.release_blocks(kv.block_ids)
    finally:
        await puller.close()


async def test_an_async_request_whose_pull_is_cancelled_is_prefilled_not_left_waiting() -> None:
    engine = _engine()

    class CancelledPuller:
        async def pull(self, *args: object) -> None:
            raise asyncio.CancelledError  # e.g. the replica shutting down mid-pull

    try:
        stream = engine.generate("r", PROMPT, SamplingOptions(temperature=0.0, max_tokens=2), kv_pending=True)
        stand_in = SimpleNamespace(kv_puller=CancelledPuller())
        params = KvTransferParams("127.0.0.1:1", 0, "r", 0, "async", 5000)
        with pytest.raises(asyncio.CancelledError):
            await ReferenceServicer._pull_then_attach(stand_in, engine, 0, "r", PROMPT, params, _KvMoved())  # type: ignore[arg-type]
        outs = await asyncio.wait_for(_collect(stream), 20)  # left waiting, it would never end
        assert outs[-1].finish_reason == "length" and engine.engine.num_used_blocks == 0
    finally:
        engine.shutdown()
