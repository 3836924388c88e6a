"""The PSManager gRPC service through the typed client: in-process for the RPC surface, and as a real
`python -m psrl.psmanager` process for the CLI, shutdown, and reconnecting after a crash."""

from __future__ import annotations

import asyncio
import math
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest
from _procs import start_psmanager

from psrl._proto import psrl_manager_pb2 as pb
from psrl._proto import psrl_manager_pb2_grpc as pb_grpc
from psrl.psmanager import PSManagerConfig, PSManagerState
from psrl.psmanager.client import PSManagerClient, PSManagerError, PSManagerUnavailable
from psrl.psmanager.server import build_server

REPO = Path(__file__).resolve().parents[2]
A = ("worker-a", 0)
B = ("worker-b", 1)


@pytest.fixture
async def served() -> AsyncIterator[tuple[PSManagerState, PSManagerClient, str]]:
    state = PSManagerState(PSManagerConfig(rollout_n=2, entries_per_buffer=2, max_pending_buffers=1, max_staleness=1))
    server = build_server(state)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    address = f"127.0.0.1:{port}"
    client = PSManagerClient(address, timeout_s=5.0)
    try:
        yield state, client, address
    finally:
        await client.close()
        await server.stop(None)


async def test_every_state_rpc_round_trips(served: tuple[PSManagerState, PSManagerClient, str]) -> None:
    state, client, _ = served
    assert await client.can_reserve([0, 1], [0, 1]) == [[True, True], [True, True]]
    assert await client.reserve_indicators(0, [0, 1]) == [-1.0, -1.0]

    r = await client.reserve([A], [0, 2], [0])
    assert r.success and r.buffer_ids == [0, 0] and r.entry_ids == [0, 1] and r.error_message == ""
    assert await client.reserve_indicators(1, [0, 1]) == [-math.inf, -1.0]
    assert await client.reserve_indicators(4, [0]) == [math.inf]
    assert await client.can_reserve([1, 4], [0], without_new_reserve_entry=True) == [[True], [False]]
    assert await client.can_reserve([4], [0], is_validate=[True]) == [[True]]
    refused = await client.reserve([A], [4], [0])
    assert not refused.success and refused.error_message

    assert await client.get_instance_model_version(A) == 0
    assert await client.get_instance_model_version(B) == -1
    assert await client.update_request_instance(0, B)
    assert not await client.update_request_instance(99, B)
    assert await client.update_request_version_tag(2, 1)
    assert not await client.update_request_version_tag(99, 1)
    rec = state.request(2)
    assert rec is not None and rec.version == 1

    assert await client.update_request_status([0, 99], "RUNNING", versions=[0], instances=[A]) == [True, False]
    assert await client.update_request_status([0], "FINISHED") == [True]
    assert await client.check_aborted_requests([0]) == [False]
    assert await client.update_request_status([0], "ABORTED") == [True]
    assert await client.check_aborted_requests([0, 2], remove=True) == [True, False]
    assert await client.check_aborted_requests([0]) == [False]
    assert await client.check_aborted_model_versions([0, 1]) == [False, False]


async def test_admin_rpcs(served: tuple[PSManagerState, PSManagerClient, str]) -> None:
    _, client, _ = served
    await client.reserve([A], [0, 1], [3], is_validate=False)
    assert await client.abort_requests([1, 50]) == [True, False]
    assert await client.abort_model_version(3) == [0, 1]
    assert await client.check_aborted_model_versions([3]) == [True]
    assert await client.set_instance_model_version(B, 5) == 5
    assert await client.get_instance_model_version(B) == 5
    assert await client.set_latest_version(7) == 7
    snap = await client.snapshot()
    assert snap["latest_version"] == 7 and snap["aborted_versions"] == [3]
    assert snap["aborted_requests"] == [0, 1, 50]
    assert await client.consume_buffer(3, 0) == [0, 1]
    with pytest.raises(PSManagerError) as err:
        await client.consume_buffer(3, 0)
    assert err.value.code == grpc.StatusCode.NOT_FOUND and not isinstance(err.value, PSManagerUnavailable)


async def test_bad_arguments_and_failures_map_to_status_codes(
    served: tuple[PSManagerState, PSManagerClient, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    state, client, address = served
    with pytest.raises(PSManagerError) as err:
        await client.can_reserve([1, 2, 3], [0], is_validate=[True, False])
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(PSManagerError) as err:
        await client.reserve([A], [1], [-1])
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(PSManagerError) as err:
        await client.update_request_status([1], "NOT_A_STATUS")
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(PSManagerError) as err:
        await client.update_request_instance(1, ("", 0))
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT

    def boom(*args: object, **kwargs: object) -> list[list[bool]]:
        raise RuntimeError("bookkeeping exploded")

    monkeypatch.setattr(state, "can_reserve", boom)
    with pytest.raises(PSManagerError) as err:
        await client.can_reserve([1], [0])
    assert err.value.code == grpc.StatusCode.INTERNAL and "bookkeeping exploded" in err.value.message

    # The wire itself, without our client: PSRL's message and field names.
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.PSManagerStateStub(channel)
        monkeypatch.undo()
        resp = await stub.CanReserve(pb.CanReserveRequest(request_ids=[10, 11, 12], model_versions=[0, 1]))
        assert resp.n_versions == 2 and list(resp.results) == [True] * 6
        with pytest.raises(grpc.aio.AioRpcError) as rpc_err:
            await stub.ReserveRolloutInstanceRequests(
                pb.ReserveRolloutInstanceRequestsRequest(request_ids=[1, 2], model_versions=[0, 1, 2])
            )
        assert rpc_err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_a_client_to_nowhere_raises_unavailable() -> None:
    from _procs import free_port

    client = PSManagerClient(f"grpc://127.0.0.1:{free_port()}", timeout_s=1.0)
    try:
        with pytest.raises(PSManagerUnavailable):
            await client.can_reserve([0], [0])
    finally:
        await client.close()


# ---- the real process ------------------------------------------------------------------------------------


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen]]:
    started: list[subprocess.Popen] = []
    yield started
    for p in started:
        if p.poll() is None:
            p.kill()
        p.wait(timeout=10)


async def test_process_serves_stops_on_sigterm(tmp_path: Path, procs: list[subprocess.Popen]) -> None:
    psm = start_psmanager(tmp_path, args=["--rollout-n", "4", "--entries-per-buffer", "1"])
    proc, address = psm.proc, psm.url
    procs.append(proc)
    assert address.startswith("127.0.0.1:") and int(address.rsplit(":", 1)[1]) > 0
    async with PSManagerClient(address, timeout_s=5.0) as client:
        assert (await client.reserve([A], [0, 1, 2, 3], [0])).success
        assert (await client.snapshot())["config"] == {
            "rollout_n": 4,
            "entries_per_buffer": 1,
            "max_pending_buffers": 2,
            "max_staleness": 1,
        }
    proc.send_signal(signal.SIGTERM)
    assert await asyncio.to_thread(proc.wait, 15) == 0
    assert "shutting down" in psm.log_text()


def test_cli_rejects_bad_config(tmp_path: Path) -> None:
    res = subprocess.run(
        [sys.executable, "-m", "psrl.psmanager", "--port", "0", "--max-pending-buffers", "0"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 2 and "max_pending_buffers" in res.stderr


async def test_client_survives_a_crash_and_a_restart_on_the_same_port(
    tmp_path: Path, procs: list[subprocess.Popen]
) -> None:
    psm = start_psmanager(tmp_path)
    proc, address = psm.proc, psm.url
    procs.append(proc)
    client = PSManagerClient(address, timeout_s=2.0)
    try:
        assert (await client.reserve([A], [0], [0])).success

        proc.send_signal(signal.SIGKILL)
        await asyncio.to_thread(proc.wait, 10)
        with pytest.raises(PSManagerUnavailable):
            await client.can_reserve([1], [0])
        with pytest.raises(PSManagerUnavailable):
            await client.snapshot()

        port = address.rsplit(":", 1)[1]
        psm2 = start_psmanager(tmp_path, port=int(port))
        proc2, address2 = psm2.proc, psm2.url
        procs.append(proc2)
        assert address2 == address

        # Same client object: the channel reconnects by itself within its (short) backoff.
        deadline = time.monotonic() + 20.0
        while True:
            try:
                snap = await client.snapshot()
                break
            except PSManagerUnavailable:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.1)
        assert snap["inventories"]["train"]["requests"] == 0  # a fresh manager: state is not persisted
        assert await client.can_reserve([0], [0]) == [[True]]
        assert (await client.reserve([A], [0], [0])).success
    finally:
        await client.close()
