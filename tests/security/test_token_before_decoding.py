"""The replica's token check comes before its request parsing (psrl.replica_auth, then psrl.grpc_decode): a call
without the token is UNAUTHENTICATED whatever its bytes, and its payload is never parsed; with the token, bytes
that are not the request are INVALID_ARGUMENT. Health, open without the token, parses as any method does."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from _procs import Proc, start_replica
from grpc_health.v1 import health_pb2

from psrl.gateway.processes import stop_processes
from psrl.replica_auth import token_metadata
from psrl.worker.grpc_services import replica_grpc_server

TOKEN = "tok-decode-0123456789"
NOT_A_MESSAGE = b"\x0a\xff\xff\xff\xff\x07"  # field 1, a length far past the end
GOOD = health_pb2.HealthCheckRequest(service="x").SerializeToString()


class _CountingParser:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, raw: bytes) -> Any:
        self.calls += 1
        return health_pb2.HealthCheckRequest.FromString(raw)


@pytest.fixture
async def tokened_server() -> AsyncIterator[tuple[str, _CountingParser]]:
    """A server built as a replica's is, with the token, serving one method whose parser counts its calls."""
    parser = _CountingParser()

    async def check(request: Any, context: Any) -> Any:
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)

    server, target = replica_grpc_server("127.0.0.1", 0, token=TOKEN)
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "t.Guarded",
                {
                    "Check": grpc.unary_unary_rpc_method_handler(
                        check, parser, health_pb2.HealthCheckResponse.SerializeToString
                    )
                },
            ),
        )
    )
    await server.start()
    try:
        yield target, parser
    finally:
        await server.stop(None)


async def test_an_unauthenticated_payload_is_never_parsed(tokened_server: tuple[str, _CountingParser]) -> None:
    target, parser = tokened_server
    async with grpc.aio.insecure_channel(target) as ch:
        call = ch.unary_unary("/t.Guarded/Check")
        for raw in (NOT_A_MESSAGE, GOOD):
            for metadata in ((), token_metadata("wrong-token")):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await call(raw, metadata=metadata, timeout=10)
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert parser.calls == 0
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call(NOT_A_MESSAGE, metadata=token_metadata(TOKEN), timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        # A parser that is no generated FromString: the message is named by its method.
        assert err.value.details().startswith("request is not a valid request of /t.Guarded/Check: ")
        reply = health_pb2.HealthCheckResponse.FromString(await call(GOOD, metadata=token_metadata(TOKEN), timeout=10))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING and parser.calls == 2


@pytest.fixture(scope="module")
def tokened_replica(model_dir: Path, log_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    token_file = tmp_path_factory.mktemp("secret") / "token"
    token_file.write_text(TOKEN)
    token_file.chmod(0o600)
    proc = start_replica(model_dir, log_dir, args=["--replica-token-file", str(token_file)])
    yield proc
    stop_processes([proc.proc])


@pytest.mark.parametrize(
    "path",
    [
        "/vllm.grpc.engine.VllmEngine/GetLoads",
        "/psrl.kv.KvMigration/TransferKv",
        "/psrl.control.ReplicaControl/GetSyncState",
    ],
)
def test_a_tokened_replica_checks_the_token_before_the_bytes(tokened_replica: Proc, path: str) -> None:
    with grpc.insecure_channel(tokened_replica.url.removeprefix("grpc://")) as ch:
        call = ch.unary_unary(path)
        with pytest.raises(grpc.RpcError) as err:
            call(NOT_A_MESSAGE, timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as err:
            call(NOT_A_MESSAGE, metadata=token_metadata(TOKEN), timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details().startswith("request is not a valid "), err.value.details()


def test_health_stays_open_and_parses_like_any_method(tokened_replica: Proc) -> None:
    with grpc.insecure_channel(tokened_replica.url.removeprefix("grpc://")) as ch:
        check = ch.unary_unary(
            "/grpc.health.v1.Health/Check", response_deserializer=health_pb2.HealthCheckResponse.FromString
        )
        assert check(b"", timeout=10).status == health_pb2.HealthCheckResponse.SERVING  # no token needed
        with pytest.raises(grpc.RpcError) as err:
            check(NOT_A_MESSAGE, timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
