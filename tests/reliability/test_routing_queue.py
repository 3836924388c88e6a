"""The routing loop's queue over real processes: a request no instance can take holds back no other, keeps its
turn for when it can be placed, and leaves the queue when its client goes; nothing stays counted afterwards."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import httpx
import pytest
from _procs import Proc, start_router, wait_for

from psrl.gateway.processes import stop_processes

BODY = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}


def _psrl(i: int, version: int | None = None) -> dict[str, str]:
    headers = {"x-request-id": str(i), "x-prompt-id": str(i)}
    if version is not None:
        headers["x-version-tag"] = str(version)
    return headers


@pytest.fixture(scope="module")
def router(replica: Proc, log_dir) -> Iterator[Proc]:
    proc = start_router(log_dir, [replica.url], args=["--enable-routing-loop"])
    yield proc
    stop_processes([proc.proc])


def _status(router: Proc) -> dict:
    return httpx.get(f"{router.url}/routing_loop/status", timeout=10).json()


def _idle(router: Proc) -> bool:
    s = _status(router)
    busy = s["queue_len"] + s["pending_request_num"] + s["running_tasks"] + s["active_dispatch_handoffs"]
    instances = [i for w in httpx.get(f"{router.url}/workers").json()["workers"] for i in w["instances"]]
    return busy == 0 and all(i["inflight_requests"] == 0 for i in instances)


def test_a_request_for_an_unsynced_version_holds_back_no_other(router: Proc) -> None:
    gone: dict = {}

    def blocker() -> None:
        try:
            httpx.post(f"{router.url}/generate", json=BODY, headers=_psrl(1, version=7), timeout=3)
        except httpx.TimeoutException as e:  # the client gives up and disconnects
            gone["error"] = e

    t = threading.Thread(target=blocker)
    t.start()
    wait_for(lambda: _status(router)["queue_len"] == 1, "one request queued in the routing loop")
    # Later in the queue's order (request id 2 > 1, unversioned after versioned), servable by any instance.
    for rid in (2, 3):
        r = httpx.post(f"{router.url}/generate", json=BODY, headers=_psrl(rid), timeout=30)
        assert r.status_code == 200, r.text
    assert _status(router)["queue_len"] == 1
    t.join(30)
    assert "error" in gone
    wait_for(lambda: _idle(router), "the routing loop idle")  # the departed client's request left the queue
    r = httpx.post(f"{router.url}/routing_loop/pause?wait=true", timeout=10)
    assert r.status_code == 200 and r.json()["paused"]
    assert httpx.post(f"{router.url}/routing_loop/resume", timeout=10).status_code == 200


def test_a_waiting_request_is_served_once_its_version_is_synced(router: Proc) -> None:
    result: dict = {}
    t = threading.Thread(
        target=lambda: result.update(
            r=httpx.post(f"{router.url}/generate", json=BODY, headers=_psrl(5, version=3), timeout=60)
        )
    )
    t.start()
    wait_for(lambda: _status(router)["queue_len"] == 1, "one request queued in the routing loop")
    r = httpx.post(f"{router.url}/generate", json=BODY, headers=_psrl(6), timeout=30)
    assert r.status_code == 200
    workers = httpx.get(f"{router.url}/workers").json()["workers"]
    updates = [
        {"worker_id": w["worker_id"], "dp_rank": i["dp_rank"], "weight_version": 3}
        for w in workers
        for i in w["instances"]
    ]
    assert httpx.post(f"{router.url}/workers/update_weight_version", json=updates).json()["updated"] == len(updates)
    t.join(60)
    assert result["r"].status_code == 200 and result["r"].headers["x-version-tag"] == "3"
    wait_for(lambda: _idle(router), "the routing loop idle")
