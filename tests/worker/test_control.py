"""ReplicaControl on a real replica process (dp_size 2): pause modes, weight loads, resume, FailSync."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest
from _loads import wait_decoding
from smg_grpc_proto.generated import vllm_engine_pb2, vllm_engine_pb2_grpc

from psrl._proto import replica_control_pb2 as pb
from psrl._proto import replica_control_pb2_grpc as pb_grpc
from psrl.worker.admission import ACCEPTED_METADATA_KEY

PROMPT = [5, 17, 42, 99, 7, 3, 250, 11]
RANKS = (0, 1)


def _req(rid: str, *, stream: bool, max_tokens: int = 12, rank: int = 0) -> vllm_engine_pb2.GenerateRequest:
    sp = vllm_engine_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    return vllm_engine_pb2.GenerateRequest(
        request_id=rid,
        tokenized=vllm_engine_pb2.TokenizedInput(input_ids=PROMPT),
        sampling_params=sp,
        stream=stream,
        data_parallel_rank=rank,
    )


class Stubs:
    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.engine = vllm_engine_pb2_grpc.VllmEngineStub(channel)
        self.control = pb_grpc.ReplicaControlStub(channel)

    async def frames(self, req: vllm_engine_pb2.GenerateRequest) -> list[vllm_engine_pb2.GenerateResponse]:
        return [f async for f in self.engine.Generate(req)]

    async def greedy_ids(self, rid: str, *, rank: int = 0, max_tokens: int = 12) -> list[int]:
        (frame,) = await self.frames(_req(rid, stream=False, rank=rank, max_tokens=max_tokens))
        assert frame.complete.finish_reason == "length"
        return list(frame.complete.output_ids)

    async def state(self) -> pb.GetSyncStateResponse:
        return await self.control.GetSyncState(pb.GetSyncStateRequest())

    async def pause(self, mode: int, *, clear_cache: bool = False) -> pb.PauseGenerationResponse:
        return await self.control.PauseGeneration(pb.PauseGenerationRequest(mode=mode, clear_cache=clear_cache))

    async def resume(self) -> pb.ResumeGenerationResponse:
        return await self.control.ResumeGeneration(pb.ResumeGenerationRequest())


class StreamReader:
    """One streamed Generate read in the background; `ids` grows as chunks arrive."""

    def __init__(self, stubs: Stubs, req: vllm_engine_pb2.GenerateRequest) -> None:
        self.call = stubs.engine.Generate(req)
        self.frames: list[vllm_engine_pb2.GenerateResponse] = []
        self.ids: list[int] = []
        self.task = asyncio.create_task(self._read())

    async def _read(self) -> None:
        async for frame in self.call:
            self.frames.append(frame)
            self.ids.extend(frame.chunk.token_ids)

    async def wait_for_ids(self, n: int) -> None:
        async with asyncio.timeout(30):
            while len(self.ids) < n:
                assert not self.task.done(), self.frames
                await asyncio.sleep(0.005)


@pytest.fixture
async def stubs(replica) -> AsyncIterator[Stubs]:
    async with grpc.aio.insecure_channel(replica.url.removeprefix("grpc://")) as channel:
        s = Stubs(channel)
        yield s
        await s.resume()  # every test leaves the replica serving (weights are restored by the test)


async def _assert_refused(stubs: Stubs, rid: str, rank: int) -> None:
    call = stubs.engine.Generate(_req(rid, stream=True, rank=rank))
    frames = [f async for f in call]
    assert [f.WhichOneof("response") for f in frames] == ["complete"]
    c = frames[0].complete
    assert c.finish_reason == "abort" and list(c.output_ids) == [] and c.completion_tokens == 0
    assert await call.code() == grpc.StatusCode.OK  # a frame, not a gRPC error
    assert ACCEPTED_METADATA_KEY not in dict(await call.initial_metadata())


async def test_abort_pause_ends_running_requests_like_abort(stubs: Stubs) -> None:
    streamed = StreamReader(stubs, _req("sync-s", stream=True, max_tokens=2000, rank=0))
    plain = asyncio.ensure_future(stubs.frames(_req("sync-ns", stream=False, max_tokens=2000, rank=1)))
    await streamed.wait_for_ids(3)
    await wait_decoding(stubs.engine, rank=1)  # the non-streamed one shows no ids until it ends

    resp = await stubs.pause(pb.PAUSE_MODE_ABORT)
    assert resp.paused and sorted(resp.aborted_request_ids) == ["sync-ns", "sync-s"]
    assert resp.weight_version == 0

    await asyncio.wait_for(streamed.task, 10)
    kinds = [f.WhichOneof("response") for f in streamed.frames]
    assert kinds[-1] == "complete" and set(kinds[:-1]) == {"chunk"}
    last_chunk, complete = streamed.frames[-2].chunk, streamed.frames[-1].complete
    assert list(last_chunk.token_ids) == [] and list(complete.output_ids) == []
    assert complete.finish_reason == "abort"
    assert 3 <= len(streamed.ids) < 2000

    (frame,) = await asyncio.wait_for(plain, 10)
    c = frame.complete
    assert c.finish_reason == "abort" and 0 < len(c.output_ids) < 2000
    assert list(c.output_logprobs.token_ids) == list(c.output_ids)
    assert len(c.output_logprobs.token_logprobs) == len(c.output_ids)

    state = await stubs.state()
    assert state.paused and state.admission == pb.ADMISSION_PAUSED
    assert state.running_requests == 0 and state.waiting_requests == 0
    info = await stubs.engine.GetServerInfo(vllm_engine_pb2.GetServerInfoRequest())
    assert info.is_paused

    # Both carried every id produced so far: prefixes of an uninterrupted greedy run.
    await stubs.resume()
    full = await stubs.greedy_ids("ref", max_tokens=max(len(streamed.ids), len(c.output_ids)))
    assert streamed.ids == full[: len(streamed.ids)]
    assert list(c.output_ids) == full[: len(c.output_ids)]


async def test_generate_while_paused_gets_an_empty_abort_frame_until_resume(stubs: Stubs) -> None:
    await stubs.pause(pb.PAUSE_MODE_ABORT)
    for rank in RANKS:
        await _assert_refused(stubs, f"refused-{rank}", rank)
    (frame,) = await stubs.frames(_req("refused-ns", stream=False))
    assert frame.complete.finish_reason == "abort" and list(frame.complete.output_ids) == []

    resp = await stubs.resume()
    assert not resp.paused
    state = await stubs.state()
    assert not state.paused and state.admission == pb.ADMISSION_OPEN
    for rank in RANKS:
        assert len(await stubs.greedy_ids(f"after-{rank}", rank=rank)) == 12
    info = await stubs.engine.GetServerInfo(vllm_engine_pb2.GetServerInfoRequest())
    assert not info.is_paused


async def test_load_weights_changes_outputs_on_every_rank_and_sets_the_version(stubs: Stubs) -> None:
    before = [await stubs.greedy_ids(f"w-before-{rank}", rank=rank) for rank in RANKS]
    try:
        await stubs.pause(pb.PAUSE_MODE_ABORT, clear_cache=True)
        loaded = await stubs.control.LoadWeights(pb.LoadWeightsRequest(version=3, seed=1234))
        assert loaded.weight_version == 3
        state = await stubs.state()
        assert state.weight_version == 3 and state.paused  # loading does not resume
        resumed = await stubs.resume()
        assert resumed.weight_version == 3
        after = [await stubs.greedy_ids(f"w-after-{rank}", rank=rank) for rank in RANKS]
        assert after[0] == after[1] and after[0] != before[0]

        # Unpaused loads are allowed too; bad sources change nothing.
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stubs.control.LoadWeights(pb.LoadWeightsRequest(version=4, path="/no/such/weights.safetensors"))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stubs.control.LoadWeights(pb.LoadWeightsRequest(version=4))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (await stubs.state()).weight_version == 3
    finally:
        restored = await stubs.control.LoadWeights(pb.LoadWeightsRequest(version=0, seed=0))
    assert restored.weight_version == 0
    assert [await stubs.greedy_ids(f"w-restored-{rank}", rank=rank) for rank in RANKS] == before


async def test_wait_pause_returns_once_running_requests_finished(stubs: Stubs) -> None:
    readers = [StreamReader(stubs, _req(f"wait-{rank}", stream=True, max_tokens=1500, rank=rank)) for rank in RANKS]
    for reader in readers:
        await reader.wait_for_ids(1)
    pause = asyncio.ensure_future(stubs.pause(pb.PAUSE_MODE_WAIT))
    async with asyncio.timeout(10):
        while (await stubs.state()).admission != pb.ADMISSION_PAUSED:
            await asyncio.sleep(0.005)
    await _assert_refused(stubs, "wait-refused", 0)  # refused while the pause waits
    state = await stubs.state()
    assert not pause.done() and not state.paused and state.running_requests == 2

    resp = await asyncio.wait_for(pause, 30)
    assert resp.paused and list(resp.aborted_request_ids) == []
    for reader in readers:
        await asyncio.wait_for(reader.task, 10)
        assert reader.frames[-1].complete.finish_reason == "length" and len(reader.ids) == 1500
    assert (await stubs.state()).running_requests == 0


async def test_keep_pause_freezes_and_resumes_the_same_greedy_tokens(stubs: Stubs) -> None:
    expected = await stubs.greedy_ids("keep-ref", max_tokens=600)
    readers = [StreamReader(stubs, _req(f"keep-{rank}", stream=True, max_tokens=600, rank=rank)) for rank in RANKS]
    for reader in readers:
        await reader.wait_for_ids(3)

    resp = await stubs.pause(pb.PAUSE_MODE_KEEP)
    assert resp.paused and list(resp.aborted_request_ids) == []
    state = await stubs.state()
    assert state.paused and state.running_requests == 2
    # The behaviour under test is time passing with nothing moving: the frames the last step sent arrive, then
    # the paused requests hold still for a while.
    await asyncio.sleep(0.2)
    frozen = [len(r.ids) for r in readers]
    await asyncio.sleep(0.3)
    assert [len(r.ids) for r in readers] == frozen and all(n < 600 for n in frozen)
    assert not any(r.task.done() for r in readers)
    await _assert_refused(stubs, "keep-refused", 1)

    await stubs.resume()
    for reader in readers:
        await asyncio.wait_for(reader.task, 30)
        assert reader.frames[-1].complete.finish_reason == "length"
        assert reader.ids == expected  # exactly an uninterrupted run


async def test_fail_sync_refuses_until_resume(stubs: Stubs) -> None:
    resp = await stubs.control.FailSync(pb.FailSyncRequest(reason="trainer died"))
    assert resp.weight_version == 0
    state = await stubs.state()
    assert state.admission == pb.ADMISSION_FAILED and state.failure_reason == "trainer died"
    assert not state.paused
    for rank in RANKS:
        await _assert_refused(stubs, f"failed-{rank}", rank)
    # A pause after the failure keeps the failure visible until resume.
    await stubs.pause(pb.PAUSE_MODE_ABORT)
    assert (await stubs.state()).admission == pb.ADMISSION_FAILED

    await stubs.resume()
    state = await stubs.state()
    assert state.admission == pb.ADMISSION_OPEN and state.failure_reason == ""
    for rank in RANKS:
        assert len(await stubs.greedy_ids(f"healed-{rank}", rank=rank)) == 12


async def test_unknown_pause_mode_is_invalid_argument(stubs: Stubs) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stubs.pause(7)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (await stubs.state()).admission == pb.ADMISSION_OPEN
