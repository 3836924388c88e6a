"""The reference replica over real gRPC, on what vLLM does with a GenerateRequest: the requests it refuses, stop
strings, n > 1 frame for frame like the stock servicer, seeds."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from _loads import wait_decoding
from smg_grpc_proto.generated import vllm_engine_pb2, vllm_engine_pb2_grpc

from psrl._proto import kv_migration_pb2, kv_migration_pb2_grpc, replica_control_pb2, replica_control_pb2_grpc
from psrl.tokenizer import IncrementalDecoder, Tokenizer

PROMPT = [5, 17, 42, 99, 7, 3, 250, 11]
Frame = vllm_engine_pb2.GenerateResponse


def _req(rid: str, *, stream: bool = False, rank: int = 0, prompt: list[int] = PROMPT, **sp: Any) -> Any:
    """A request sampled at temperature 1, 12 tokens, EOS ignored, unless `sp` says otherwise (SamplingParams
    fields; setting an optional one marks it present)."""
    params = vllm_engine_pb2.SamplingParams(**{"temperature": 1.0, "max_tokens": 12, "ignore_eos": True, **sp})
    return vllm_engine_pb2.GenerateRequest(
        request_id=rid,
        tokenized=vllm_engine_pb2.TokenizedInput(input_ids=prompt),
        sampling_params=params,
        stream=stream,
        data_parallel_rank=rank,
    )


@pytest.fixture
async def channel(replica) -> AsyncIterator[grpc.aio.Channel]:
    async with grpc.aio.insecure_channel(replica.url.removeprefix("grpc://")) as ch:
        yield ch


@pytest.fixture
def stub(channel: grpc.aio.Channel) -> vllm_engine_pb2_grpc.VllmEngineStub:
    return vllm_engine_pb2_grpc.VllmEngineStub(channel)


async def _frames(stub: vllm_engine_pb2_grpc.VllmEngineStub, req: Any) -> list[Frame]:
    return [f async for f in stub.Generate(req)]


def _ids(frames: list[Frame]) -> dict[int, list[int]]:
    """Each choice's ids: its chunks' when streamed, else its complete frame's."""
    out: dict[int, list[int]] = {}
    for f in frames:
        if f.WhichOneof("response") == "chunk":
            out.setdefault(f.chunk.index, []).extend(f.chunk.token_ids)
    if not out:
        out = {f.complete.index: list(f.complete.output_ids) for f in frames}
    return out


# ---- what vLLM refuses, or reads specially ---------------------------------------------------------


async def test_present_but_invalid_fields_are_invalid_argument(stub) -> None:
    def with_kv(raw: str) -> Any:
        req = _req("kv")
        req.kv_transfer_params_json = raw  # present, even when empty
        return req

    cases = {
        "Invalid kv_transfer_params_json: Expecting value": with_kv(""),
        "Invalid kv_transfer_params_json: kv_transfer_params_json must be a JSON object": with_kv("[1]"),
        "Invalid kv_transfer_params_json: Expecting property name": with_kv("{bad"),
        "Invalid kv_transfer_params_json: mode": with_kv(
            '{"source": {"target": "h:1"}, "request_id": "r", "mode": "x"}'
        ),
        "max_tokens": _req("mt", max_tokens=0),
        "max allowed: 20": _req("lp", logprobs=21),
        "Requested sample logprobs of 704": _req("lp-1", logprobs=-1),  # -1 is the whole vocabulary
        "logprobs must be": _req("lp-2", logprobs=-2),
        "temperature": _req("t", temperature=2.5),
        "top_p": _req("tp", top_p=1.5),
        "n must be 1 when using greedy sampling": _req("ng", temperature=0.0, n=2),
        "n must be in": _req("nn", n=100_000),
        "stop cannot contain an empty string": _req("se", stop=["a", ""]),
        "out-of-vocab token ids": _req("st", stop_token_ids=[10**6]),
        "data_parallel_rank -1 is out of range [0, 2).": _req("r", rank=-1),
        "prompt_logprobs is not supported": _req("pl", prompt_logprobs=0),
        "logit_bias is not supported": _req("lb", logit_bias={5: 1.0}),
        "min_tokens is not supported": _req("mn", min_tokens=2),
        "min_p is not supported": _req("mp", min_p=0.1),
        "penalty is not supported": _req("pp", presence_penalty=0.5),
        "repetition_penalty is not supported": _req("rp", repetition_penalty=1.2),
        "structured output": _req("so", regex="a+"),
    }
    for detail, req in cases.items():
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await _frames(stub, req)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, detail
        assert detail in (err.value.details() or ""), (detail, err.value.details())


async def test_what_vllm_reads_as_defaults_is_accepted(stub) -> None:
    empty_kv = _req("kv-empty-object")
    empty_kv.kv_transfer_params_json = "{}"  # an empty object asks for nothing
    accepted = {
        "n 0 is 1": _req("n0", n=0),
        "seed -1 is no seed": _req("seed-1", seed=-1),
        "the proto's unset repetition_penalty": _req("rp0", repetition_penalty=0.0),
        "an empty kv object": empty_kv,
        "logprobs at the limit": _req("lp20", logprobs=20),
    }
    for name, req in accepted.items():
        (frame,) = await _frames(stub, req)
        assert frame.complete.finish_reason == "length" and len(frame.complete.output_ids) == 12, name
        assert not frame.complete.HasField("kv_transfer_params_json"), name
    # max_tokens past the model length is no error: the request ends at max_model_len (4096 here).
    (frame,) = await _frames(stub, _req("long", prompt=[7] * 4090, max_tokens=100))
    assert frame.complete.finish_reason == "length" and len(frame.complete.output_ids) == 6


# ---- seeds ---------------------------------------------------------------------------------------


async def test_a_seed_reproduces_a_request_on_any_rank_and_beside_any_traffic(stub) -> None:
    alone = _ids(await _frames(stub, _req("s-alone", seed=1234)))[0]
    noise = [asyncio.ensure_future(_frames(stub, _req(f"noise-{i}", max_tokens=30))) for i in range(3)]
    busy, other_rank = await asyncio.gather(
        _frames(stub, _req("s-busy", seed=1234, stream=True)), _frames(stub, _req("s-rank1", seed=1234, rank=1))
    )
    await asyncio.gather(*noise)
    assert _ids(busy)[0] == _ids(other_rank)[0] == alone
    assert _ids(await _frames(stub, _req("s-other", seed=1235)))[0] != alone


# ---- stop strings --------------------------------------------------------------------------------


async def _stop_case(stub, tokenizer: Tokenizer) -> tuple[list[int], str, int]:
    """A seeded run's ids, a stop string spanning two tokens in its middle (decoded as vLLM decodes it for
    the proto: special tokens included), and the index of the token that completes it."""
    ids = _ids(await _frames(stub, _req("stop-ref", seed=99, max_tokens=40)))[0]
    decoder = IncrementalDecoder(tokenizer, skip_special_tokens=False)
    pieces = [decoder.push([t]) for t in ids]
    text = "".join(pieces)
    ends = [len("".join(pieces[: i + 1])) for i in range(len(ids))]
    k = next(k for k in range(12, len(ids)) if pieces[k - 1] and pieces[k])
    stop = text[ends[k - 1] - 1 : ends[k - 1] + 1]
    return ids, stop, next(i for i, end in enumerate(ends) if stop in text[:end])


async def test_a_stop_string_ends_the_request_on_the_token_completing_it(stub, tokenizer) -> None:
    ids, stop, at = await _stop_case(stub, tokenizer)
    base = {"seed": 99, "max_tokens": 40}
    for include in (False, True):  # the text cut is the router's: the ids are the same either way
        (frame,) = await _frames(
            stub, _req(f"stop-{include}", stop=["zzz", stop], include_stop_str_in_output=include, **base)
        )
        c = frame.complete
        assert list(c.output_ids) == ids[: at + 1] and c.completion_tokens == at + 1
        assert c.finish_reason == "stop" and c.WhichOneof("matched_stop") == "matched_stop_str"
        assert c.matched_stop_str == stop
    frames = await _frames(stub, _req("stop-stream", stream=True, stop=[stop], **base))
    assert [t for f in frames[:-1] for t in f.chunk.token_ids] == ids[: at + 1]
    complete = frames[-1].complete
    assert list(complete.output_ids) == [ids[at]] and complete.matched_stop_str == stop  # the last delta
    # On the last allowed token the stop string still wins over the length limit.
    (frame,) = await _frames(stub, _req("stop-len", stop=[stop], **{**base, "max_tokens": at + 1}))
    assert frame.complete.finish_reason == "stop" and frame.complete.matched_stop_str == stop


# ---- n > 1 ---------------------------------------------------------------------------------------


async def test_n_streamed_interleaves_choices_and_completes_each_when_it_finishes(stub) -> None:
    frames = await _frames(stub, _req("n-s", stream=True, n=3, seed=7, max_tokens=6, logprobs=0))
    kinds = [(f.WhichOneof("response"), getattr(f, f.WhichOneof("response")).index) for f in frames]
    assert kinds[:3] == [("chunk", 0), ("chunk", 1), ("chunk", 2)]  # one step, one chunk per choice
    assert [k for k in kinds if k[0] == "complete"] == [("complete", 0), ("complete", 1), ("complete", 2)]
    for i, frame in enumerate(frames):
        if frame.WhichOneof("response") == "complete":  # right after its choice's last chunk
            assert kinds[i - 1] == ("chunk", frame.complete.index)
            assert list(frame.complete.output_ids) == list(frames[i - 1].chunk.token_ids)
    ids = _ids(frames)
    assert sorted(ids) == [0, 1, 2] and all(len(v) == 6 for v in ids.values())
    assert all(len(f.chunk.output_logprobs.token_ids) == 1 for f in frames if f.WhichOneof("response") == "chunk")


async def test_n_choices_are_seed_plus_index_and_reproducible(stub) -> None:
    frames = await _frames(stub, _req("n-ns", n=3, seed=7))
    assert [(f.WhichOneof("response"), f.complete.index) for f in frames] == [("complete", i) for i in range(3)]
    ids = _ids(frames)
    assert len({tuple(v) for v in ids.values()}) == 3
    for i in range(3):  # vLLM's rule: choice i samples as a request seeded seed + i
        assert _ids(await _frames(stub, _req(f"n-alone-{i}", seed=7 + i)))[0] == ids[i]
    assert _ids(await _frames(stub, _req("n-ns", n=3, seed=7, stream=True))) == ids
    unseeded = _ids(await _frames(stub, _req("n-u", n=3)))
    assert len({tuple(v) for v in unseeded.values()}) == 3


async def test_abort_of_the_request_ends_every_choice(stub) -> None:
    call = stub.Generate(_req("n-abort-s", stream=True, n=2, max_tokens=3000))
    frames: list[Frame] = []
    async for frame in call:
        frames.append(frame)
        if len(frames) == 4:
            await stub.Abort(vllm_engine_pb2.AbortRequest(request_ids=["n-abort-s"]))
    completes = [f.complete for f in frames if f.WhichOneof("response") == "complete"]
    assert [(c.index, c.finish_reason, list(c.output_ids)) for c in completes] == [(0, "abort", []), (1, "abort", [])]

    task = asyncio.ensure_future(_frames(stub, _req("n-abort-ns", n=2, max_tokens=3000)))
    await wait_decoding(stub, running=2)
    await stub.Abort(vllm_engine_pb2.AbortRequest(request_ids=["n-abort-ns"]))
    frames = await asyncio.wait_for(task, 30)
    assert [(f.complete.index, f.complete.finish_reason) for f in frames] == [(0, "abort"), (1, "abort")]
    assert all(0 < len(f.complete.output_ids) < 3000 for f in frames)


async def test_a_sync_abort_ends_every_choice(channel, stub) -> None:
    control = replica_control_pb2_grpc.ReplicaControlStub(channel)
    task = asyncio.ensure_future(_frames(stub, _req("n-sync", stream=True, n=2, max_tokens=3000)))
    try:
        for _ in range(500):
            loads = await stub.GetLoads(vllm_engine_pb2.GetLoadsRequest(dp_rank=0))
            if loads.loads[0].num_running_reqs == 2:
                break
            await asyncio.sleep(0.01)
        paused = await control.PauseGeneration(
            replica_control_pb2.PauseGenerationRequest(mode=replica_control_pb2.PAUSE_MODE_ABORT)
        )
        assert sorted(paused.aborted_request_ids) == ["0_n-sync", "1_n-sync"]  # the engine's ids of the choices
        frames = await asyncio.wait_for(task, 30)
    finally:
        await control.ResumeGeneration(replica_control_pb2.ResumeGenerationRequest())
    completes = [f.complete for f in frames if f.WhichOneof("response") == "complete"]
    assert sorted((c.index, c.finish_reason) for c in completes) == [(0, "abort"), (1, "abort")]
    migration = kv_migration_pb2_grpc.KvMigrationStub(channel)
    stats = await migration.GetKvMigrationStats(kv_migration_pb2.GetKvMigrationStatsRequest(data_parallel_rank=0))
    assert stats.pinned_requests == 0  # KV migration moves whole requests: no choice's KV is pinned


async def test_n_with_kv_transfer_params_is_prefilled(channel, stub) -> None:
    migration = kv_migration_pb2_grpc.KvMigrationStub(channel)
    before = await migration.GetKvMigrationStats(kv_migration_pb2.GetKvMigrationStatsRequest(data_parallel_rank=0))
    req = _req("n-kv", n=2)
    req.kv_transfer_params_json = json.dumps({"source": {"target": "127.0.0.1:9"}, "request_id": "x", "mode": "sync"})
    frames = await _frames(stub, req)
    assert [json.loads(f.complete.kv_transfer_params_json) for f in frames] == [{"moved_tokens": 0}] * 2
    after = await migration.GetKvMigrationStats(kv_migration_pb2.GetKvMigrationStatsRequest(data_parallel_rank=0))
    assert after.fallbacks == before.fallbacks and after.transfers_in == before.transfers_in  # no pull was tried


async def test_without_kv_migration_the_field_is_still_checked_then_ignored(inproc_replica) -> None:
    async with grpc.aio.insecure_channel(inproc_replica.target) as ch:
        stub = vllm_engine_pb2_grpc.VllmEngineStub(ch)
        for raw in ("", "null", "[]"):
            req = _req("kv-off-bad")
            req.kv_transfer_params_json = raw
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await _frames(stub, req)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert (err.value.details() or "").startswith("Invalid kv_transfer_params_json"), raw
        req = _req("kv-off")
        req.kv_transfer_params_json = json.dumps({"source": {"target": "h:1"}, "request_id": "r", "mode": "sync"})
        (frame,) = await _frames(stub, req)
        assert frame.complete.finish_reason == "length" and not frame.complete.HasField("kv_transfer_params_json")
