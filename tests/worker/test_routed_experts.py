"""psrl.experts.RoutedExperts on the reference replica: a Generate that asks (metadata) has each choice's routing
kept until it is taken once, nothing is kept for one that does not ask, a dense model says it has none, and the
store forgets what nobody takes (TTL, byte budget)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from _moe import reference_routing
from _procs import Proc, start_replica
from smg_grpc_proto.generated import vllm_engine_pb2, vllm_engine_pb2_grpc

from psrl._proto import routed_experts_pb2 as pb
from psrl._proto import routed_experts_pb2_grpc as pb_grpc
from psrl.engine import AsyncEngine, CacheConfig, Engine
from psrl.gateway.processes import stop_processes
from psrl.worker.grpc_services import replica_grpc_server
from psrl.worker.model_folder import load_model_folder
from psrl.worker.moe_model_folder import build_tiny_moe_model_folder
from psrl.worker.routed_experts import ROUTED_EXPERTS_METADATA_KEY, RoutedExpertsStore
from psrl.worker.servicer import ReferenceServicer

PROMPT = [5, 17, 42, 99, 7, 3, 250, 11]


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_moe_model_folder(tmp_path_factory.mktemp("tiny-moe"))


@pytest.fixture(scope="module")
def moe_replica(moe_dir: Path, log_dir: Path) -> Iterator[Proc]:
    proc = start_replica(moe_dir, log_dir, dp_size=2)
    yield proc
    stop_processes([proc.proc])


@pytest.fixture
async def channel(moe_replica: Proc) -> AsyncIterator[grpc.aio.Channel]:
    async with grpc.aio.insecure_channel(moe_replica.url.removeprefix("grpc://")) as ch:
        yield ch


def _req(rid: str, *, stream: bool, n: int = 1, max_tokens: int = 10, rank: int = 0) -> vllm_engine_pb2.GenerateRequest:
    sp = vllm_engine_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True, n=n)
    if n == 1:
        sp.temperature = 0.0
    else:
        sp.temperature, sp.seed = 1.0, 7
    return vllm_engine_pb2.GenerateRequest(
        request_id=rid,
        tokenized=vllm_engine_pb2.TokenizedInput(input_ids=PROMPT),
        sampling_params=sp,
        stream=stream,
        data_parallel_rank=rank,
    )


def _ask(start: int) -> tuple[tuple[str, str], ...]:
    return ((ROUTED_EXPERTS_METADATA_KEY, str(start)),)


async def _generate(channel, req, metadata=None) -> dict[int, list[int]]:
    """Each choice's output ids."""
    ids: dict[int, list[int]] = {}
    done: set[int] = set()
    async for frame in vllm_engine_pb2_grpc.VllmEngineStub(channel).Generate(req, metadata=metadata):
        if frame.WhichOneof("response") == "chunk":
            ids.setdefault(frame.chunk.index, []).extend(frame.chunk.token_ids)
        else:
            if frame.complete.index not in ids:
                ids[frame.complete.index] = list(frame.complete.output_ids)
            done.add(frame.complete.index)
    assert done == set(ids)
    return ids


async def _take(channel, rid: str, index: int = 0) -> pb.TakeRoutedExpertsResponse:
    return await pb_grpc.RoutedExpertsStub(channel).TakeRoutedExperts(
        pb.TakeRoutedExpertsRequest(request_id=rid, index=index), timeout=10
    )


def _rows(reply: pb.TakeRoutedExpertsResponse) -> np.ndarray:
    assert reply.status == pb.ROUTED_EXPERTS_OK, reply.reason
    return np.frombuffer(reply.data, dtype=np.dtype(reply.dtype)).reshape(reply.num_rows, reply.num_layers, reply.top_k)


@pytest.mark.parametrize("stream", [True, False])
async def test_an_asking_generate_has_its_routing_kept_until_taken_once(channel, moe_dir, stream: bool) -> None:
    rid = f"re-{stream}"
    [ids] = (await _generate(channel, _req(rid, stream=stream, rank=1), _ask(3))).values()
    reply = await _take(channel, rid)
    assert (reply.dtype, reply.prompt_start, reply.num_layers, reply.top_k) == ("uint8", 3, 2, 2)
    np.testing.assert_array_equal(_rows(reply), reference_routing(moe_dir, (PROMPT + ids)[:-1])[3:])
    again = await _take(channel, rid)
    assert again.status == pb.ROUTED_EXPERTS_NOT_RECORDED and "already taken" in again.reason


async def test_each_choice_of_an_n_request_has_its_own_rows(channel, moe_dir) -> None:
    choices = await _generate(channel, _req("re-n", stream=False, n=2), _ask(0))
    assert choices[0] != choices[1]
    for index, ids in choices.items():
        want = reference_routing(moe_dir, (PROMPT + ids)[:-1])
        np.testing.assert_array_equal(_rows(await _take(channel, "re-n", index)), want)


async def test_an_aborted_generate_keeps_the_rows_of_what_it_fed(channel, moe_dir) -> None:
    stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
    ids: list[int] = []
    call = stub.Generate(_req("re-abort", stream=True, max_tokens=2000), metadata=_ask(0))
    async for frame in call:
        if frame.WhichOneof("response") == "chunk":
            ids += frame.chunk.token_ids
            if len(ids) >= 5 and len(ids) - len(frame.chunk.token_ids) < 5:
                await stub.Abort(vllm_engine_pb2.AbortRequest(request_ids=["re-abort"]))
        else:
            assert frame.complete.finish_reason == "abort"
    want = reference_routing(moe_dir, (PROMPT + ids)[:-1])
    np.testing.assert_array_equal(_rows(await _take(channel, "re-abort")), want)


async def test_a_bad_ask_is_an_invalid_argument(channel) -> None:
    for value in ("-1", "three", str(len(PROMPT) + 1)):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await _generate(channel, _req("re-bad", stream=True), ((ROUTED_EXPERTS_METADATA_KEY, value),))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "routed_experts" in (err.value.details() or "") or ROUTED_EXPERTS_METADATA_KEY in err.value.details()


async def test_nothing_is_kept_for_a_generate_that_does_not_ask(moe_dir: Path) -> None:
    folder = load_model_folder(moe_dir)
    engine = AsyncEngine(Engine(folder.model_config, CacheConfig(block_size=16, num_blocks=64)))
    servicer = ReferenceServicer([engine], folder, "tiny-moe")
    server, target = replica_grpc_server("127.0.0.1", 0)
    vllm_engine_pb2_grpc.add_VllmEngineServicer_to_server(servicer, server)
    pb_grpc.add_RoutedExpertsServicer_to_server(servicer.routed_experts, server)
    await server.start()
    try:
        async with grpc.aio.insecure_channel(target) as ch:
            await _generate(ch, _req("plain", stream=True))
            await _generate(ch, _req("plain-ns", stream=False))
            assert len(servicer.routed_experts.store) == 0
            assert (await _take(ch, "plain")).status == pb.ROUTED_EXPERTS_NOT_RECORDED
            await _generate(ch, _req("asked", stream=True), _ask(0))
            assert len(servicer.routed_experts.store) == 1
    finally:
        await server.stop(None)
        engine.shutdown()


async def test_a_dense_model_says_it_records_no_routing(replica) -> None:
    async with grpc.aio.insecure_channel(replica.url.removeprefix("grpc://")) as ch:
        await _generate(ch, _req("dense", stream=True), _ask(0))  # asking a dense model is no error (as vLLM)
        reply = await _take(ch, "dense")
    assert reply.status == pb.ROUTED_EXPERTS_UNSUPPORTED and "no MoE layers" in reply.reason


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_store_forgets_what_nobody_takes() -> None:
    clock = _Clock()
    store = RoutedExpertsStore(ttl_s=10.0, max_bytes=3 * 8, clock=clock)
    rows = np.ones((2, 2, 2), dtype=np.uint8)  # 8 bytes
    store.put("a", 0, rows, 0)
    clock.now = 6.0
    store.put("b", 0, rows, 0)
    store.put("b", 1, rows, 0)
    assert len(store) == 3 and store.num_bytes == 24
    store.put("c", 0, rows, 0)  # over the budget: the oldest goes
    assert store.take("a", 0) is None and len(store) == 3
    clock.now = 16.5  # past b's and c's TTL (put at 6.0)
    assert store.take("b", 0) is None and store.take("c", 0) is None
    assert len(store) == 0 and store.num_bytes == 0
    store.put("d", 0, rows, 4)
    kept = store.take("d", 0)
    assert kept is not None and kept[1] == 4 and store.take("d", 0) is None
    store.put("huge", 0, np.zeros((8, 2, 2), dtype=np.uint8), 0)  # larger than the whole budget: not kept
    assert len(store) == 0
