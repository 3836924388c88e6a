"""Bytes that are not a method's request message, and JSON-holding string fields past their bounds, answer
INVALID_ARGUMENT (or a specific reply), never grpc's UNKNOWN: on a replica process (VllmEngine, ReplicaControl,
KvMigration, Health, reflection) and the PSManager's (psrl.grpc_decode, psrl.worker.kv_migration), and on an
in-process server for every handler shape grpc.aio has (psrl.grpc_decode's wrappers)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from _procs import Proc, start_psmanager
from grpc_health.v1 import health_pb2, health_pb2_grpc
from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2, vllm_engine_pb2_grpc

from psrl._proto import kv_migration_pb2, kv_migration_pb2_grpc, psrl_manager_pb2
from psrl.gateway.processes import stop_processes
from psrl.grpc_decode import RequestDecodeInterceptor
from psrl.serving.json_body import MAX_JSON_DEPTH

BAD_UTF8 = b"\x0a\x02\xff\xfe"  # field 1, a string of two bytes that are not UTF-8
PAST_THE_END = b"\x0a\xff\xff\xff\xff\x07"  # field 1, a length far past the end
WRONG_WIRE_TYPE = b"\x0f\x01\x02\x03\x04"  # field 1 with the reserved wire type 7


def _target(p: Proc) -> str:
    return p.url.removeprefix("grpc://")


def _raw(target: str, path: str, raw: bytes, kind: str = "unary", timeout: float = 10.0) -> grpc.RpcError:
    """Send `raw` as the request of `path` ("unary", "stream": a streamed reply, "bidi": both streamed); the
    error it ends with."""
    with grpc.insecure_channel(target) as ch, pytest.raises(grpc.RpcError) as err:
        if kind == "unary":
            ch.unary_unary(path)(raw, timeout=timeout)
        elif kind == "stream":
            list(ch.unary_stream(path)(raw, timeout=timeout))
        else:
            list(ch.stream_stream(path)(iter([raw]), timeout=timeout))
    return err.value


# ---- a replica process ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "kind", "message"),
    [
        ("/vllm.grpc.engine.VllmEngine/GetLoads", "unary", "vllm.grpc.engine.GetLoadsRequest"),
        ("/vllm.grpc.engine.VllmEngine/Generate", "stream", "vllm.grpc.engine.GenerateRequest"),
        ("/vllm.grpc.engine.VllmEngine/Abort", "unary", "vllm.grpc.engine.AbortRequest"),
        ("/vllm.grpc.engine.VllmEngine/GetTokenizer", "stream", "smg.grpc.common.GetTokenizerRequest"),
        ("/vllm.grpc.engine.VllmEngine/Embed", "unary", "vllm.grpc.engine.EmbedRequest"),  # unimplemented: sync
        ("/psrl.control.ReplicaControl/GetSyncState", "unary", "psrl.control.GetSyncStateRequest"),
        ("/psrl.control.ReplicaControl/LoadWeights", "unary", "psrl.control.LoadWeightsRequest"),
        ("/psrl.kv.KvMigration/TransferKv", "unary", "psrl.kv.TransferKvRequest"),
        ("/psrl.kv.KvMigration/ReleaseKv", "unary", "psrl.kv.ReleaseKvRequest"),
        ("/grpc.health.v1.Health/Check", "unary", "grpc.health.v1.HealthCheckRequest"),
        ("/grpc.health.v1.Health/Watch", "stream", "grpc.health.v1.HealthCheckRequest"),
        ("/grpc.health.v1.Health/List", "unary", "grpc.health.v1.HealthListRequest"),  # unimplemented: sync
        (
            "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
            "bidi",
            "grpc.reflection.v1alpha.ServerReflectionRequest",
        ),
    ],
)
def test_a_replica_answers_bytes_that_are_not_the_request_with_invalid_argument(
    replica: Proc, path: str, kind: str, message: str
) -> None:
    for raw in (PAST_THE_END, WRONG_WIRE_TYPE):  # not any message (BAD_UTF8 is, where field 1 is no string)
        err = _raw(_target(replica), path, raw, kind)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (path, raw, err.details())
        assert err.details().startswith(f"request is not a valid {message}: "), err.details()


def test_a_replica_still_serves_after_bytes_that_are_not_the_request(replica: Proc) -> None:
    target = _target(replica)
    for path, kind in (("/vllm.grpc.engine.VllmEngine/Generate", "stream"), ("/grpc.health.v1.Health/Check", "unary")):
        err = _raw(target, path, BAD_UTF8, kind)  # field 1 is a string there: its bytes are not UTF-8
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "String field had bad UTF-8" in err.details()
    with grpc.insecure_channel(target) as ch:
        health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        loads = vllm_engine_pb2_grpc.VllmEngineStub(ch).GetLoads(vllm_engine_pb2.GetLoadsRequest(), timeout=10)
        assert len(loads.loads) == 2  # dp_size 2
        frames = list(
            vllm_engine_pb2_grpc.VllmEngineStub(ch).Generate(
                vllm_engine_pb2.GenerateRequest(
                    request_id="after-bad-bytes",
                    tokenized=vllm_engine_pb2.TokenizedInput(input_ids=[1, 2, 3]),
                    sampling_params=vllm_engine_pb2.SamplingParams(max_tokens=2, temperature=0.0),
                ),
                timeout=30,
            )
        )
        assert frames[-1].complete.finish_reason == "length" and len(frames[-1].complete.output_ids) == 2
        # An unimplemented method read from valid bytes is still UNIMPLEMENTED.
        with pytest.raises(grpc.RpcError) as err:
            vllm_engine_pb2_grpc.VllmEngineStub(ch).Embed(vllm_engine_pb2.EmbedRequest(), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_a_layout_json_nested_past_the_bound_is_a_refusal_not_a_recursion_error(replica: Proc) -> None:
    with grpc.insecure_channel(_target(replica)) as ch:
        stub = kv_migration_pb2_grpc.KvMigrationStub(ch)
        for layout_json in ("[" * 5000, '{"a": ' * 3000 + "1" + "}" * 3000):
            reply = stub.TransferKv(
                kv_migration_pb2.TransferKvRequest(
                    token_ids=list(range(64)), channel="shm", allow_prefix_cache=True, layout_json=layout_json
                ),
                timeout=10,
            )
            assert reply.num_tokens == 0 and reply.reason == (
                f"layout mismatch: bad layout_json: nested deeper than {MAX_JSON_DEPTH} levels"
            )


def _generate_error(target: str, kv_transfer_params_json: str) -> grpc.RpcError:
    request = vllm_engine_pb2.GenerateRequest(
        request_id="kv-params",
        tokenized=vllm_engine_pb2.TokenizedInput(input_ids=[1, 2, 3]),
        sampling_params=vllm_engine_pb2.SamplingParams(max_tokens=2),
        kv_transfer_params_json=kv_transfer_params_json,
    )
    with grpc.insecure_channel(target) as ch, pytest.raises(grpc.RpcError) as err:
        list(vllm_engine_pb2_grpc.VllmEngineStub(ch).Generate(request, timeout=10))
    return err.value


@pytest.mark.parametrize(
    ("timeout_ms", "words"),
    [("1e999", "got inf"), ("-1e999", "got -inf"), ("1e300", "got 1e+300"), ("2.5", "got 2.5")],
)
def test_kv_transfer_params_numbers_out_of_range_are_invalid_argument(
    replica: Proc, timeout_ms: str, words: str
) -> None:
    raw = '{"source": {"target": "127.0.0.1:1"}, "request_id": "x", "timeout_ms": ' + timeout_ms + "}"
    err = _generate_error(_target(replica), raw)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details().startswith("Invalid kv_transfer_params_json: timeout_ms must be an integer in [1, ")
    assert err.details().endswith(words)


@pytest.mark.parametrize("raw", ["[" * 5000, '{"a": ' * 3000 + "1" + "}" * 3000])
def test_kv_transfer_params_nested_past_the_bound_are_invalid_argument(replica: Proc, raw: str) -> None:
    err = _generate_error(_target(replica), raw)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
    assert err.details() == f"Invalid kv_transfer_params_json: nested deeper than {MAX_JSON_DEPTH} levels"


def test_a_start_sequence_number_without_room_for_the_next_one_is_invalid_argument(replica: Proc) -> None:
    with grpc.insecure_channel(_target(replica)) as ch:
        stub = vllm_engine_pb2_grpc.VllmEngineStub(ch)
        with pytest.raises(grpc.RpcError) as err:
            list(stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(start_sequence_number=2**64 - 1)))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
        # The largest accepted start: the snapshot comes numbered from it + 1.
        call = stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(start_sequence_number=2**63 - 1))
        first = next(iter(call))
        call.cancel()
        assert first.sequence_number == 2**63


# ---- the PSManager -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def psmanager(log_dir: Path) -> Iterator[Proc]:
    proc = start_psmanager(log_dir)
    yield proc
    stop_processes([proc.proc])


@pytest.mark.parametrize(
    ("path", "raw", "message"),
    [
        (
            "/psrl.state.PSManagerState/UpdateRequestStatus",
            b"\x12\x02\xff\xfe",
            "psrl.state.UpdateRequestStatusRequest",
        ),
        ("/psrl.state.PSManagerState/CanReserve", PAST_THE_END, "psrl.state.CanReserveRequest"),
        ("/psrl.state.PSManagerAdmin/GetSnapshot", WRONG_WIRE_TYPE, "psrl.state.GetSnapshotRequest"),
        ("/psrl.state.PSManagerAdmin/ConsumeBuffer", b"\x08\xff", "psrl.state.ConsumeBufferRequest"),
    ],
)
def test_the_psmanager_answers_bytes_that_are_not_the_request_with_invalid_argument(
    psmanager: Proc, path: str, raw: bytes, message: str
) -> None:
    err = _raw(psmanager.url, path, raw)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
    assert err.details().startswith(f"request is not a valid {message}: "), err.details()
    with grpc.insecure_channel(psmanager.url) as ch:
        snapshot = ch.unary_unary(
            "/psrl.state.PSManagerAdmin/GetSnapshot",
            request_serializer=psrl_manager_pb2.GetSnapshotRequest.SerializeToString,
            response_deserializer=psrl_manager_pb2.GetSnapshotResponse.FromString,
        )(psrl_manager_pb2.GetSnapshotRequest(), timeout=10)
        assert snapshot.state_json


# ---- every handler shape, in process ---------------------------------------------------------------------

Request = health_pb2.HealthCheckRequest  # a message with one string field: invalid UTF-8 fails to parse
Reply = health_pb2.HealthCheckResponse


class _Shapes:
    """One behavior per kind grpc.aio runs: async unary, async generator, coroutine writer, streamed requests,
    and the sync ones grpc runs in its thread pool."""

    def __init__(self) -> None:
        self.cleaned_up = asyncio.Event()

    async def unary(self, request: Any, context: Any) -> Any:
        return Reply(status=len(request.service))

    async def generator(self, request: Any, context: Any) -> AsyncIterator[Any]:
        try:
            for _ in range(len(request.service) or 10**9):
                yield Reply(status=1)
                await asyncio.sleep(0.01)
        finally:
            self.cleaned_up.set()

    async def writer(self, request: Any, context: Any) -> None:
        for _ in range(len(request.service)):
            await context.write(Reply(status=2))

    async def requests_in(self, requests: Any, context: Any) -> Any:
        return Reply(status=sum([len(r.service) async for r in requests]))

    async def both_streamed(self, requests: Any, context: Any) -> AsyncIterator[Any]:
        async for r in requests:
            yield Reply(status=len(r.service))

    async def reader_writer(self, requests: Any, context: Any) -> None:
        while (r := await context.read()) is not grpc.aio.EOF:
            await context.write(Reply(status=len(r.service)))

    def sync_unary(self, request: Any, context: Any) -> Any:
        return Reply(status=len(request.service))

    def sync_generator(self, request: Any, context: Any) -> Iterator[Any]:
        for _ in range(len(request.service)):
            yield Reply(status=3)


def _shape_handlers(s: _Shapes) -> grpc.GenericRpcHandler:
    de, se = Request.FromString, Reply.SerializeToString
    return grpc.method_handlers_generic_handler(
        "t.Shapes",
        {
            "Unary": grpc.unary_unary_rpc_method_handler(s.unary, de, se),
            "Generator": grpc.unary_stream_rpc_method_handler(s.generator, de, se),
            "Writer": grpc.unary_stream_rpc_method_handler(s.writer, de, se),
            "RequestsIn": grpc.stream_unary_rpc_method_handler(s.requests_in, de, se),
            "BothStreamed": grpc.stream_stream_rpc_method_handler(s.both_streamed, de, se),
            "ReaderWriter": grpc.stream_stream_rpc_method_handler(s.reader_writer, de, se),
            "SyncUnary": grpc.unary_unary_rpc_method_handler(s.sync_unary, de, se),
            "SyncGenerator": grpc.unary_stream_rpc_method_handler(s.sync_generator, de, se),
        },
    )


@pytest.fixture
async def shapes() -> AsyncIterator[tuple[str, _Shapes]]:
    s = _Shapes()
    server = grpc.aio.server(interceptors=[RequestDecodeInterceptor()])
    server.add_generic_rpc_handlers((_shape_handlers(s),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}", s
    finally:
        await server.stop(None)


KINDS = {
    "Unary": "unary",
    "Generator": "stream",
    "Writer": "stream",
    "RequestsIn": "requests",
    "BothStreamed": "bidi",
    "ReaderWriter": "bidi",
    "SyncUnary": "unary",
    "SyncGenerator": "stream",
}


async def _call(ch: grpc.aio.Channel, method: str, payloads: list[bytes]) -> list[int]:
    """The statuses of the replies to `payloads` (serialized requests) sent to t.Shapes/`method`."""
    path, kind, reply = f"/t.Shapes/{method}", KINDS[method], Reply.FromString
    if kind == "unary":
        return [(await ch.unary_unary(path, response_deserializer=reply)(payloads[0], timeout=10)).status]
    if kind == "stream":
        return [r.status async for r in ch.unary_stream(path, response_deserializer=reply)(payloads[0], timeout=10)]

    async def send() -> AsyncIterator[bytes]:
        for p in payloads:
            yield p

    if kind == "requests":
        return [(await ch.stream_unary(path, response_deserializer=reply)(send(), timeout=10)).status]
    return [r.status async for r in ch.stream_stream(path, response_deserializer=reply)(send(), timeout=10)]


@pytest.mark.parametrize("method", list(KINDS))
async def test_every_handler_shape_parses_inside_the_handler(shapes: tuple[str, _Shapes], method: str) -> None:
    target, _ = shapes
    good = Request(service="abc").SerializeToString()
    async with grpc.aio.insecure_channel(target) as ch:
        statuses = await _call(ch, method, [good, good] if KINDS[method] in ("requests", "bidi") else [good])
        assert (
            statuses
            == {
                "Unary": [3],
                "Generator": [1, 1, 1],
                "Writer": [2, 2, 2],
                "RequestsIn": [6],
                "BothStreamed": [3, 3],
                "ReaderWriter": [3, 3],
                "SyncUnary": [3],
                "SyncGenerator": [3, 3, 3],
            }[method]
        )
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await _call(ch, method, [good, BAD_UTF8] if KINDS[method] in ("requests", "bidi") else [BAD_UTF8])
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
        assert err.value.details().startswith("request is not a valid grpc.health.v1.HealthCheckRequest: ")


async def test_a_departed_client_still_ends_the_behavior_behind_the_relay(shapes: tuple[str, _Shapes]) -> None:
    """The wrapped async generator relays the behavior's; a client that leaves mid-stream still runs the
    behavior's cleanup (Generate aborts its request there), as it does unwrapped."""
    target, s = shapes
    async with grpc.aio.insecure_channel(target) as ch:
        call = ch.unary_stream("/t.Shapes/Generator", response_deserializer=Reply.FromString)(
            Request().SerializeToString()  # an endless stream
        )
        assert (await call.read()).status == 1
        call.cancel()
    await asyncio.wait_for(s.cleaned_up.wait(), timeout=10)


async def test_the_wrapped_handler_is_built_once_per_method(shapes: tuple[str, _Shapes]) -> None:
    interceptor = RequestDecodeInterceptor()
    handler = grpc.unary_unary_rpc_method_handler(_Shapes().unary, Request.FromString, Reply.SerializeToString)

    async def resolve(details: Any) -> Any:
        return handler

    details = type("Details", (), {"method": "/t.Shapes/Unary", "invocation_metadata": ()})()
    first = await interceptor.intercept_service(resolve, details)
    assert first is not handler and first.request_deserializer is None
    assert await interceptor.intercept_service(resolve, details) is first
