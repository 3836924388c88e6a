"""The reference replica over real gRPC: framing exactly like smg-grpc-servicer, management RPCs, errors."""

from __future__ import annotations

import asyncio
import hashlib

import grpc
import pytest
from _loads import wait_decoding
from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2, vllm_engine_pb2_grpc

from psrl.tokenizer import Tokenizer

PROMPT = [5, 17, 42, 99, 7, 3, 250, 11]


def _req(
    rid: str,
    *,
    stream: bool,
    max_tokens: int = 12,
    rank: int = 0,
    logprobs: int | None = 0,
    ignore_eos: bool = True,
    prompt: list[int] = PROMPT,
) -> vllm_engine_pb2.GenerateRequest:
    sp = vllm_engine_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos)
    if logprobs is not None:
        sp.logprobs = logprobs
    return vllm_engine_pb2.GenerateRequest(
        request_id=rid,
        tokenized=vllm_engine_pb2.TokenizedInput(input_ids=prompt),
        sampling_params=sp,
        stream=stream,
        data_parallel_rank=rank,
    )


@pytest.fixture
async def stub(replica):
    async with grpc.aio.insecure_channel(replica.url.removeprefix("grpc://")) as channel:
        yield vllm_engine_pb2_grpc.VllmEngineStub(channel)


async def _frames(stub, req) -> list[vllm_engine_pb2.GenerateResponse]:
    return [f async for f in stub.Generate(req)]


async def test_non_streaming_complete_frame_holds_every_id(stub) -> None:
    frames = await _frames(stub, _req("ns-1", stream=False))
    assert [f.WhichOneof("response") for f in frames] == ["complete"]
    c = frames[0].complete
    assert c.finish_reason == "length"
    assert len(c.output_ids) == 12 == c.completion_tokens
    assert c.prompt_tokens == len(PROMPT)
    assert list(c.output_logprobs.token_ids) == list(c.output_ids)
    assert all(lp <= 0 for lp in c.output_logprobs.token_logprobs)


async def test_streaming_chunks_then_complete_with_last_delta(stub) -> None:
    full = (await _frames(stub, _req("ref", stream=False)))[0].complete
    frames = await _frames(stub, _req("s-1", stream=True))
    kinds = [f.WhichOneof("response") for f in frames]
    assert kinds[-1] == "complete" and set(kinds[:-1]) == {"chunk"}
    ids = [t for f in frames[:-1] for t in f.chunk.token_ids]
    lps = [lp for f in frames[:-1] for lp in f.chunk.output_logprobs.token_logprobs]
    assert ids == list(full.output_ids)  # greedy: same tokens streamed or not
    assert lps == pytest.approx(list(full.output_logprobs.token_logprobs), abs=1e-5)
    last_chunk, complete = frames[-2].chunk, frames[-1].complete
    assert list(complete.output_ids) == list(last_chunk.token_ids)  # only the last delta
    assert complete.finish_reason == "length"


async def test_abort_while_streaming_ends_with_empty_abort_frame(stub) -> None:
    call = stub.Generate(_req("abort-s", stream=True, max_tokens=2000))
    got: list[int] = []
    async for frame in call:
        if frame.WhichOneof("response") == "chunk":
            got.extend(frame.chunk.token_ids)
            if len(got) >= 3:
                await stub.Abort(vllm_engine_pb2.AbortRequest(request_ids=["abort-s"]))
        else:
            assert frame.complete.finish_reason == "abort"
            assert list(frame.complete.output_ids) == []
            break
    else:
        pytest.fail("stream ended without a complete frame")
    assert 3 <= len(got) < 2000


async def test_abort_without_streaming_returns_ids_so_far(stub) -> None:
    task = asyncio.ensure_future(_frames(stub, _req("abort-ns", stream=False, max_tokens=2000)))
    await wait_decoding(stub)
    await stub.Abort(vllm_engine_pb2.AbortRequest(request_ids=["abort-ns"]))
    frames = await asyncio.wait_for(task, 30)
    c = frames[-1].complete
    assert c.finish_reason == "abort"
    assert 0 < len(c.output_ids) < 2000
    assert len(c.output_logprobs.token_ids) == len(c.output_ids)


async def test_dp_ranks_are_separate_engines_with_the_same_weights(stub) -> None:
    r0 = (await _frames(stub, _req("dp0", stream=False, rank=0)))[0].complete
    r1 = (await _frames(stub, _req("dp1", stream=False, rank=1)))[0].complete
    assert list(r0.output_ids) == list(r1.output_ids)


async def test_out_of_range_rank_is_invalid_argument(stub) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await _frames(stub, _req("bad-rank", stream=False, rank=2))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "data_parallel_rank" in err.value.details()


async def test_bad_requests_are_invalid_argument(stub) -> None:
    bad_kv = _req("e5", stream=False)
    bad_kv.kv_transfer_params_json = '{"source": {"target": "h:1"}, "request_id": "r", "mode": "eventually"}'
    no_input = _req("e6", stream=False)
    no_input.ClearField("tokenized")
    cases = {
        "empty prompt": _req("e1", stream=False, prompt=[]),
        "outside the vocabulary": _req("e2", stream=False, prompt=[10**6]),
        "longer than the maximum model length": _req("e3", stream=False, prompt=[1] * 5000),
        "request_id is required": _req("", stream=False),
        "kv_transfer_params_json": bad_kv,
        "neither tokenized input nor text": no_input,
    }
    for detail, req in cases.items():
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await _frames(stub, req)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, detail
        assert detail in (err.value.details() or ""), (detail, err.value.details())
    # the replica still serves afterwards
    assert (await _frames(stub, _req("after", stream=False)))[0].complete.finish_reason == "length"


async def test_server_info_loads_and_model_info(stub) -> None:
    info = await stub.GetServerInfo(vllm_engine_pb2.GetServerInfoRequest())
    assert info.data_parallel_size == 2 and info.block_size == 16
    loads = await stub.GetLoads(vllm_engine_pb2.GetLoadsRequest())
    assert [entry.dp_rank for entry in loads.loads] == [0, 1]
    assert all(entry.max_total_num_tokens > 0 for entry in loads.loads)
    one = await stub.GetLoads(vllm_engine_pb2.GetLoadsRequest(dp_rank=1))
    assert [entry.dp_rank for entry in one.loads] == [1]
    model = await stub.GetModelInfo(vllm_engine_pb2.GetModelInfoRequest())
    assert model.max_context_length > 0 and model.eos_token_ids
    assert (await stub.HealthCheck(vllm_engine_pb2.HealthCheckRequest())).healthy


async def test_get_tokenizer_streams_a_zip_with_its_sha256(stub, tokenizer) -> None:
    data, sha = b"", ""
    async for chunk in stub.GetTokenizer(common_pb2.GetTokenizerRequest()):
        data += chunk.data
        sha = chunk.sha256 or sha
    assert sha == hashlib.sha256(data).hexdigest()
    fetched = Tokenizer.from_zip_bytes(data, sha)
    text = "Hello, how are you today?"
    assert fetched.encode(text) == tokenizer.encode(text)
    msgs = [{"role": "user", "content": "hi"}]
    assert fetched.apply_chat_template(msgs) == tokenizer.apply_chat_template(msgs)
