"""The thunder_agent strategy in the SessionRouter's process (`--session-strategy thunder_agent`) over real
processes: a reference replica whose KV cache holds 512 tokens, a router, and the SessionRouter. Eight agents
at once: the strategy holds the sessions that do not fit, hangs and continues the others as their contexts grow,
and every turn is answered."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from _procs import Proc, free_port
from _sessions import ROUTER_ADMIN, capacity_stack, scripted_agent
from _wait import until, wait_for
from prometheus_client.parser import text_string_to_metric_families

from psrl.session.app import SessionRouter
from psrl.session.config import SessionConfig
from psrl.session.thunder_driver import ReadError

STRATEGY = ["--session-strategy", "thunder_agent", "--thunder-check-interval-ms", "50", "--thunder-max-hold-s", "600"]


ADMIN = {"Authorization": f"Bearer {ROUTER_ADMIN}"}


@pytest.fixture(scope="module")
def stack(model_dir: Path, log_dir: Path) -> Iterator[tuple[Proc, Proc, str]]:
    """The router's admin endpoints take a key, which the SessionRouter's strategy reads them with."""
    strategy = [*STRATEGY, "--router-admin-api-key", ROUTER_ADMIN, "--log-level", "info"]
    with capacity_stack(model_dir, log_dir, strategy) as procs:
        yield procs


def metrics(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(f"{url}/metrics").text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def metric(url: str, name: str, **labels: str) -> float:
    return metrics(url).get((name, tuple(sorted(labels.items()))), 0.0)


def hung_sessions(url: str) -> list[str]:
    listing = httpx.get(f"{url}/control/sessions").json()["sessions"]
    return [s["session_id"] for s in listing if s["hang_state"] == "hung"]


def run_agents(url: str, model: str, sids: list[str], turns: int) -> list[list[int]]:
    async def main() -> list[list[int]]:
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            return list(await asyncio.gather(*(scripted_agent(client, model, sid, turns) for sid in sids)))

    return asyncio.run(main())


def test_sessions_beyond_the_capacity_are_held_then_every_turn_is_answered(stack) -> None:
    router, session, model = stack
    url = session.url
    wait_for(lambda: metric(url, "psrl_session_thunder_rounds_total") >= 1, "a first round of the strategy")
    [worker] = httpx.get(f"{router.url}/workers", headers=ADMIN).json()["workers"]
    assert metric(url, "psrl_session_thunder_remaining_tokens", base_worker_id=worker["worker_id"], dp_rank="0") == 512
    sids = [httpx.post(f"{url}/sessions").json()["session_id"] for _ in range(8)]
    # 512 tokens hold the 100-token buffers of five new sessions; the last three wait, in the order they came
    assert sorted(hung_sessions(url)) == sorted(sids[5:])
    assert metric(url, "psrl_session_thunder_sessions_hung") == 3

    results = run_agents(url, model, sids, turns=4)

    assert results == [[200] * 4] * 8
    # the three held at creation were admitted. Whether growing contexts also hang running sessions, and how many
    # are continued as they fit (one hung after its last turn is released by its DELETE), depends on how the
    # agents' turns interleave: those rounds are tested in tests/session/test_thunder.py. None waited out the
    # hold limit.
    assert metric(url, "psrl_session_thunder_continued_total", reason="admitted") >= 3
    assert metric(url, "psrl_session_thunder_hung_total") >= 3
    assert metric(url, "psrl_session_thunder_continued_total", reason="max_hold") == 0
    assert metric(url, "psrl_session_thunder_hold_seconds_count") >= 3
    wait_for(lambda: metric(url, "psrl_session_thunder_sessions_hung") == 0, "no session held once all closed")
    assert metric(url, "psrl_session_thunder_skipped_rounds_total") == 0


async def test_a_round_whose_router_read_fails_is_skipped_and_the_loop_goes_on(log_dir: Path) -> None:
    """A router nobody listens on: each round's read fails, is counted, and the next round runs anyway."""
    config = SessionConfig(router_url=f"http://127.0.0.1:{free_port()}", connect_timeout_s=1.0)
    config.session_strategy = "thunder_agent"
    config.thunder.check_interval_ms = 10
    sr = SessionRouter(config)
    await sr.open()
    try:
        assert sr.thunder is not None
        with pytest.raises(ReadError, match="router unreachable"):
            await sr.thunder.step()
        sr.thunder.start()
        registry = sr.metrics
        await until(
            lambda: (registry.get_sample_value("psrl_session_thunder_skipped_rounds_total") or 0) >= 3,
            "three rounds skipped, the loop still running",
            timeout_s=20,
        )
        assert registry.get_sample_value("psrl_session_thunder_rounds_total") == 0
    finally:
        await sr.close()
