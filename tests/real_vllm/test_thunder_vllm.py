"""The thunder_agent session strategy in front of a vLLM replica of ours: it reads the KV capacity vLLM reports
(the replica registers itself, its `max_model_len` label being vLLM's KV cache in tokens) and vLLM's KV usage
through the router, holds the sessions that do not fit, admits them as others close, and every turn is answered.
The buffer per session is a quarter of that capacity, so that four sessions fit whatever vLLM's CPU cache holds."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from _procs import Proc, start_router, start_session_router
from _sessions import scripted_agent
from _vllm import start_vllm_replica
from _wait import wait_for

from psrl.gateway.processes import stop_processes

ADMIN = {"Authorization": "Bearer router-admin"}


@pytest.fixture(scope="module")
def stack(vllm_model_dir: Path, log_dir: Path) -> Iterator[tuple[Proc, str, int]]:
    router = start_router(log_dir, [], args=["--load-poll-interval-s", "0.1", "--admin-api-key", "router-admin"])
    procs = [router.proc]
    try:
        replica = start_vllm_replica(
            vllm_model_dir, log_dir, args=["--router", router.url, "--router-api-key", "router-admin"]
        )
        procs.append(replica.proc)
        wait_for(lambda: httpx.get(f"{router.url}/health").json()["workers"] == 1, "the vLLM replica registered")
        [worker] = httpx.get(f"{router.url}/workers", headers=ADMIN).json()["workers"]
        capacity = int(worker["labels"]["max_model_len"])
        strategy = [
            "--session-strategy",
            "thunder_agent",
            "--thunder-check-interval-ms",
            "50",
            "--thunder-buffer-per-session",
            str(capacity // 4),
            "--router-admin-api-key",
            "router-admin",
        ]
        session = start_session_router(log_dir, router.url, strategy)
        procs.append(session.proc)
        model = httpx.get(f"{router.url}/v1/models").json()["data"][0]["id"]
        yield session, model, capacity
    finally:
        stop_processes(procs[::-1])


def test_sessions_beyond_vllms_capacity_are_held_then_admitted(stack) -> None:
    session, model, capacity = stack
    assert capacity > 0  # vLLM's KV cache in tokens, as the replica registered it
    sids = [httpx.post(f"{session.url}/sessions").json()["session_id"] for _ in range(6)]
    listing = httpx.get(f"{session.url}/control/sessions").json()["sessions"]
    assert [s["session_id"] for s in listing if s["hang_state"] == "hung"] == sids[4:]  # four buffers fit

    async def main() -> list[list[int]]:
        async with httpx.AsyncClient(base_url=session.url, timeout=300) as client:
            return list(await asyncio.gather(*(scripted_agent(client, model, sid, 3) for sid in sids)))

    assert asyncio.run(main()) == [[200] * 3] * 6
    metrics = httpx.get(f"{session.url}/metrics").text
    admitted = [line for line in metrics.splitlines() if line.startswith("psrl_session_thunder_continued_total{")]
    assert any('reason="admitted"' in line and float(line.split()[-1]) >= 2 for line in admitted), admitted
