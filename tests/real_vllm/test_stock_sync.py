"""A weight sync over a stock vLLM replica (no ReplicaControl): the coordinator says why it failed and takes
only that replica out of the router's rotation."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from _procs import Proc, start_router

from psrl.coordinator import BlockingRolloutCoordinator, SyncError
from psrl.gateway.processes import stop_processes
from psrl.worker.model_folder import WEIGHTS_FILE


def test_sync_over_a_stock_replica_names_the_missing_service(stock_vllm: Proc, vllm_model_dir: Path, log_dir) -> None:
    router = start_router(log_dir, [stock_vllm.url], args=["--enable-routing-loop"])
    try:
        (worker,) = httpx.get(f"{router.url}/workers").json()["workers"]
        with BlockingRolloutCoordinator(router.url, rpc_timeout_s=10.0) as coordinator, pytest.raises(SyncError) as err:
            coordinator.sync_weights(1, path=str(vllm_model_dir / WEIGHTS_FILE))
        assert err.value.failed == [worker["worker_id"]]
        assert "ReplicaControl" in err.value.reasons[worker["worker_id"]] and "--engine vllm" in str(err.value)
        (after,) = httpx.get(f"{router.url}/workers").json()["workers"]
        assert after["instances"][0]["paused"]
        assert not httpx.get(f"{router.url}/routing_loop/status").json()["paused"]
    finally:
        stop_processes([router.proc])
