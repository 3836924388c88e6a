"""`RolloutCoordinator.session_strategy`: the coordinator drives the thunder_agent strategy against a SessionRouter
started without it, over the SessionRouter's control API, with the same rounds as the in-process driver. Real
processes: a reference replica whose KV cache holds 512 tokens, a router and a SessionRouter, both with admin
keys."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from _procs import Proc
from _sessions import ROUTER_ADMIN, capacity_stack, scripted_agent
from _wait import until

from psrl.coordinator import BlockingRolloutCoordinator, RolloutCoordinator
from psrl.session.config import ThunderConfig

SESSION_ADMIN = {"x-admin-api-key": "session-admin"}


@pytest.fixture(scope="module")
def stack(model_dir: Path, log_dir: Path) -> Iterator[tuple[Proc, Proc, str]]:
    with capacity_stack(model_dir, log_dir, ["--admin-api-key", "session-admin"]) as procs:
        yield procs


async def test_the_coordinator_holds_hangs_and_continues_sessions_over_http(stack) -> None:
    router, session, model = stack
    config = ThunderConfig(check_interval_ms=50, max_hold_s=600)
    async with (
        RolloutCoordinator(router.url, admin_api_key=ROUTER_ADMIN) as coordinator,
        httpx.AsyncClient(base_url=session.url, timeout=120) as client,
    ):
        driver = coordinator.session_strategy(session.url, config, session_admin_api_key="session-admin")
        try:
            sids = [(await client.post("/sessions")).json()["session_id"] for _ in range(8)]
            # one round: five new sessions' buffers fit the 512 tokens, the last three are held, in order
            plan = await driver.step()
            assert plan.hang == sids[5:] and plan.resume == []
            assert list(plan.remaining.values()) == [512]
            listing = (await client.get("/control/sessions", headers=SESSION_ADMIN)).json()["sessions"]
            assert [s["session_id"] for s in listing if s["hang_state"] == "hung"] == sids[5:]

            driver.start()
            results = await asyncio.gather(*(scripted_agent(client, model, sid, 4) for sid in sids))

            assert results == [[200] * 4] * 8
            value = driver.metrics.registry.get_sample_value
            assert value("psrl_session_thunder_continued_total", {"reason": "admitted"}) >= 3
            assert value("psrl_session_thunder_continued_total", {"reason": "max_hold"}) == 0
            # the three held at creation; whether growing contexts also hang running sessions depends on how
            # the agents' turns interleave (the rounds that do are tested in tests/session/test_thunder.py)
            assert value("psrl_session_thunder_hung_total") >= 3
            assert value("psrl_session_thunder_skipped_rounds_total") == 0
            await until(lambda: value("psrl_session_thunder_sessions_hung") == 0, "nothing held once all closed")
        finally:
            await driver.aclose()


async def test_a_wrong_session_router_key_skips_the_round(stack) -> None:
    router, session, _ = stack
    async with RolloutCoordinator(router.url, admin_api_key=ROUTER_ADMIN) as coordinator:
        driver = coordinator.session_strategy(session.url, session_admin_api_key="wrong")
        try:
            driver.start()
            value = driver.metrics.registry.get_sample_value
            await until(lambda: value("psrl_session_thunder_skipped_rounds_total") >= 1, "a skipped round")
            assert value("psrl_session_thunder_rounds_total") == 0
        finally:
            await driver.aclose()


def test_the_blocking_client_drives_the_same_rounds(stack) -> None:
    router, session, _ = stack
    with (
        BlockingRolloutCoordinator(router.url, admin_api_key=ROUTER_ADMIN) as coordinator,
        httpx.Client(base_url=session.url, timeout=30) as client,
    ):
        strategy = coordinator.session_strategy(session.url, session_admin_api_key="session-admin")
        try:
            sids = [client.post("/sessions").json()["session_id"] for _ in range(6)]
            plan = strategy.step()  # five new sessions' buffers fit the 512 tokens: the sixth is held
            assert plan.hang == sids[5:] and list(plan.remaining.values()) == [512]
        finally:
            strategy.close()
            for sid in sids:
                client.delete(f"/sessions/{sid}")
