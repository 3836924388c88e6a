"""SubscribeKvEvents and prefix caching on a real replica process (dp_size 2) over gRPC."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc
import pytest
from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2, vllm_engine_pb2_grpc

from psrl.worker.config import parse_args

BLOCK = 16
LONG = [(7 * i + 3) % 500 + 2 for i in range(60)]

Batch = common_pb2.KvEventBatch
State = dict[int, tuple[int | None, tuple[int, ...]]]  # block hash -> (parent hash, token ids)


@pytest.fixture
async def channel(replica):
    async with grpc.aio.insecure_channel(replica.url.removeprefix("grpc://")) as ch:
        yield ch


class Subscription:
    """One SubscribeKvEvents call, read in the background; per rank: its batches and the state they build."""

    def __init__(self, channel: grpc.aio.Channel, start: int = 0) -> None:
        stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
        self.call = stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(start_sequence_number=start))
        self.batches: dict[int, list[Batch]] = {0: [], 1: []}
        self.state: dict[int, State] = {0: {}, 1: {}}
        self._changed = asyncio.Event()
        self._task = asyncio.create_task(self._read())

    async def _read(self) -> None:
        async for batch in self.call:
            self.batches[batch.dp_rank].append(batch)
            _apply(self.state[batch.dp_rank], batch)
            self._changed.set()

    async def wait_for(self, done: Callable[[], bool], timeout: float = 10.0) -> None:
        async with asyncio.timeout(timeout):
            while not done():
                if self._task.done():
                    self._task.result()  # the call failed: raise its error
                    raise AssertionError("the subscription ended")
                self._changed.clear()
                await self._changed.wait()

    async def close(self) -> None:
        self.call.cancel()
        await asyncio.gather(self._task, return_exceptions=True)


def _apply(state: State, batch: Batch) -> None:
    for event in batch.events:
        kind = event.WhichOneof("data")
        if kind == "cleared":
            state.clear()
        elif kind == "removed":
            for h in event.removed.block_hashes:
                state.pop(h, None)
        else:
            stored = event.stored
            parent = stored.parent_block_hash if stored.HasField("parent_block_hash") else None
            for blk in stored.blocks:
                state[blk.block_hash] = (parent, tuple(blk.token_ids))
                parent = blk.block_hash


async def _generate(channel: grpc.aio.Channel, rid: str, prompt: list[int], rank: int = 0):
    stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
    req = vllm_engine_pb2.GenerateRequest(
        request_id=rid,
        tokenized=vllm_engine_pb2.TokenizedInput(input_ids=prompt),
        sampling_params=vllm_engine_pb2.SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
        data_parallel_rank=rank,
    )
    frames = [f async for f in stub.Generate(req)]
    return frames[-1].complete


async def test_stored_events_chain_and_a_shared_prefix_hits_the_cache(channel) -> None:
    sub = Subscription(channel)
    try:
        await sub.wait_for(lambda: all(sub.batches[r] for r in (0, 1)))
        for rank in (0, 1):  # each rank opens with its (empty) snapshot
            first = sub.batches[rank][0]
            assert first.sequence_number == 1 and first.dp_rank == rank
            assert [e.WhichOneof("data") for e in first.events] == ["cleared"]
            assert first.snapshot.count == 1 and first.snapshot.index == 0 and first.snapshot.blocks == 0
            assert first.load.max_running_requests > 0

        a = await _generate(channel, "kv-a", LONG[:40])
        b = await _generate(channel, "kv-b", [*LONG[:36], 1, 2, 3])
        assert a.cached_tokens == 0 and b.cached_tokens == 2 * BLOCK
        assert list(b.output_ids) != [] and a.finish_reason == b.finish_reason == "length"

        # a: 40 prompt + 3 computed output tokens = 2 full blocks; b adds no full block of its own.
        await sub.wait_for(lambda: len(sub.state[0]) >= 2)
        stored = [e.stored for batch in sub.batches[0][1:] for e in batch.events]
        blocks = [blk for s in stored for blk in s.blocks]
        assert [list(blk.token_ids) for blk in blocks] == [LONG[:16], LONG[16:32]]
        assert all(blk.block_size == BLOCK for blk in blocks)
        assert not stored[0].HasField("parent_block_hash")
        if len(stored) == 2:  # the two blocks in one chain, or the second naming the first as its parent
            assert stored[1].parent_block_hash == blocks[0].block_hash
        assert sub.state[0][blocks[1].block_hash] == (blocks[0].block_hash, tuple(LONG[16:32]))
        for s in stored:
            assert s.tier == common_pb2.KV_CACHE_TIER_DEVICE and s.medium == "CPU"
            assert s.locality == common_pb2.KV_CACHE_LOCALITY_LOCAL
        assert sub.state[1] == {}  # rank 1 served nothing
        seqs = [batch.sequence_number for batch in sub.batches[0]]
        assert seqs == list(range(1, len(seqs) + 1))
        assert all(e.event_id > 0 for batch in sub.batches[0][1:] for e in batch.events)

        # A subscriber joining now gets the live blocks first: a clear, then the blocks parents first.
        late = Subscription(channel)
        try:
            await late.wait_for(lambda: all(late.batches[r] for r in (0, 1)))
            snap = late.batches[0][0]
            assert snap.sequence_number == 1 and snap.snapshot.blocks == 2
            assert snap.events[0].WhichOneof("data") == "cleared"
            assert all(e.WhichOneof("data") == "stored" and e.event_id == 0 for e in snap.events[1:])
            assert late.state[0] == sub.state[0]
        finally:
            await late.close()
    finally:
        await sub.close()


async def test_many_subscribers_come_and_go_and_a_resume_continues_the_numbering(channel) -> None:
    subs = [Subscription(channel) for _ in range(3)]
    for sub in subs:
        await sub.wait_for(lambda sub=sub: bool(sub.batches[0]))
    for sub in subs[:2]:
        await sub.close()  # clients that go away must not stop the others
    await _generate(channel, "kv-c", LONG[20:60], rank=1)
    await subs[2].wait_for(lambda: len(subs[2].state[1]) >= 2)

    stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
    flushed = await stub.FlushCache(common_pb2.FlushCacheRequest())
    assert flushed.success
    await subs[2].wait_for(lambda: subs[2].state[1] == {} and subs[2].state[0] == {})
    await subs[2].close()

    resumed = Subscription(channel, start=41)
    try:
        await resumed.wait_for(lambda: all(resumed.batches[r] for r in (0, 1)))
        assert [resumed.batches[r][0].sequence_number for r in (0, 1)] == [42, 42]
        assert resumed.state == {0: {}, 1: {}}
    finally:
        await resumed.close()
    again = await _generate(channel, "kv-d", LONG[20:60], rank=1)
    assert again.cached_tokens == 0  # flushed


def test_no_prefix_caching_flag() -> None:
    assert parse_args([]).enable_prefix_caching is True
    assert parse_args(["--no-prefix-caching"]).enable_prefix_caching is False


async def test_disconnected_subscribers_leave_nothing_behind(model_dir) -> None:
    """In-process server, to look inside: a client that goes away unsubscribes from every rank's engine."""
    from psrl.engine import AsyncEngine, CacheConfig, Engine
    from psrl.worker.model_folder import load_model_folder
    from psrl.worker.servicer import ReferenceServicer

    folder = load_model_folder(model_dir)
    engines = [AsyncEngine(Engine(folder.model_config, CacheConfig(num_blocks=64))) for _ in range(2)]
    server = grpc.aio.server()
    vllm_engine_pb2_grpc.add_VllmEngineServicer_to_server(ReferenceServicer(engines, folder, "tiny"), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            subs = [Subscription(ch) for _ in range(2)]
            for sub in subs:
                await sub.wait_for(lambda sub=sub: all(sub.batches[r] for r in (0, 1)))
            assert [e.num_kv_subscribers for e in engines] == [2, 2]
            assert all(e.engine.kv_events_enabled for e in engines)
            await _generate(ch, "in-proc", LONG[:40], rank=1)
            for sub in subs:
                await sub.wait_for(lambda sub=sub: len(sub.state[1]) == 2)
            await subs[0].close()
            async with asyncio.timeout(5):
                while [e.num_kv_subscribers for e in engines] != [1, 1]:
                    await asyncio.sleep(0.01)
            await subs[1].close()
            async with asyncio.timeout(5):
                while any(e.num_kv_subscribers or e.engine.kv_events_enabled for e in engines):
                    await asyncio.sleep(0.01)
    finally:
        await server.stop(grace=None)
        for e in engines:
            e.shutdown()
