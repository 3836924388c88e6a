"""The router with the PSManager (the admission step, commit, dispatch check) over real processes, including the
PSManager dying and coming back under load with nothing lost."""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest
from _procs import free_port, start_psmanager, start_replica, start_router, wait_for

from psrl.gateway.processes import stop_processes
from psrl.psmanager.client import PSManagerClient

CAPACITY = ["--entries-per-buffer", "100000", "--max-pending-buffers", "4"]


def _body(n: int = 2) -> dict:
    return {"input_ids": [4, 5, 6], "sampling_params": {"max_new_tokens": n, "temperature": 0, "detokenize": False}}


def _psrl(rid: int) -> dict[str, str]:
    return {"x-request-id": str(rid), "x-prompt-id": str(rid)}


@pytest.fixture(scope="module")
def stack(model_dir, log_dir):
    port = free_port()
    psm = start_psmanager(log_dir, port=port, args=CAPACITY)
    replica = start_replica(model_dir, log_dir)
    router = start_router(
        log_dir,
        [replica.url],
        args=["--enable-routing-loop", "--psrl-ps-manager-addr", psm.url, "--psmanager-rpc-timeout-s", "1"],
    )
    state = {"psm": psm}
    yield router, replica, state, port
    stop_processes([router.proc, replica.proc, state["psm"].proc])


def _snapshot(address: str) -> dict:
    async def go() -> dict:
        async with PSManagerClient(address) as client:
            return await client.snapshot()

    return asyncio.run(go())


def _abort(address: str, rid: int) -> None:
    async def go() -> None:
        async with PSManagerClient(address) as client:
            await client.abort_requests([rid])

    asyncio.run(go())


def test_requests_are_reserved_in_the_psmanager(stack) -> None:
    router, _, state, _ = stack
    r = httpx.post(f"{router.url}/generate", json=_body(), headers=_psrl(101), timeout=60)
    assert r.status_code == 200, r.text
    assert "101" in str(_snapshot(state["psm"].url))


def test_an_aborted_request_is_answered_400_request_aborted(stack) -> None:
    router, _, state, _ = stack
    _abort(state["psm"].url, 202)
    r = httpx.post(f"{router.url}/generate", json=_body(), headers=_psrl(202), timeout=60)
    assert r.status_code == 400 and r.headers["x-smg-error-code"] == "request_aborted"


def test_psmanager_down_then_back_loses_nothing(stack, log_dir) -> None:
    router, _, state, port = stack
    stop_processes([state["psm"].proc], timeout_s=0.1)
    results: list[httpx.Response] = []

    def send(rid: int) -> None:
        results.append(httpx.post(f"{router.url}/generate", json=_body(3), headers=_psrl(rid), timeout=120))

    threads = [threading.Thread(target=send, args=(300 + i,)) for i in range(8)]
    for t in threads:
        t.start()
    wait_for(
        lambda: httpx.get(f"{router.url}/routing_loop/status").json()["queue_len"] == 8,
        "the 8 requests wait in the routing loop's queue",
    )
    tried = router.log_text().count("failed; it stays queued")
    wait_for(
        lambda: router.log_text().count("failed; it stays queued") >= tried + 16,
        "the loop tried to place each of them again, twice on average, while the PSManager was away",
    )
    assert not results  # nothing answered (wrongly) while the PSManager was away
    state["psm"] = start_psmanager(log_dir, port=port, args=CAPACITY)
    for t in threads:
        t.join(120)
    assert len(results) == 8 and all(r.status_code == 200 for r in results), [r.text for r in results]
    assert all(len(r.json()["output_ids"]) == 3 for r in results)
