"""A replica registers the address others reach it at: `--advertise-host` on its bound port, with its node id as
a label; bound to every address (0.0.0.0) with nothing to advertise, it refuses to start."""

from __future__ import annotations

import subprocess
import sys

import httpx
from _procs import REPO, popen, start_replica, start_router, wait_for

from psrl.gateway.processes import stop_processes


def test_the_advertised_host_is_what_the_router_registers(model_dir, log_dir) -> None:
    router = start_router(log_dir, [])
    replica = None
    try:
        args = ["--host", "0.0.0.0", "--advertise-host", "localhost", "--router", router.url, "--node-id", "node-x"]
        replica = start_replica(model_dir, log_dir, args=args)
        assert replica.url.startswith("grpc://localhost:")  # the ready line names it too

        def workers() -> list[dict]:
            return httpx.get(f"{router.url}/workers", timeout=10).json()["workers"]

        wait_for(lambda: workers(), "the replica registered", timeout_s=60)
        [worker] = workers()
        assert worker["url"] == replica.url and worker["labels"]["node_id"] == "node-x"
    finally:
        stop_processes([p.proc for p in (router, replica) if p is not None])


def test_a_wildcard_bind_without_an_advertised_host_fails_at_start() -> None:
    args = ["--host", "0.0.0.0", "--port", "0", "--router", "http://127.0.0.1:9"]
    proc = popen([sys.executable, "-m", "psrl.worker", *args], stderr=subprocess.PIPE, cwd=REPO, text=True)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2, err  # refused before anything starts, the router never called
    assert "--host 0.0.0.0 listens on every address, which a router cannot dial: give --advertise-host" in err
