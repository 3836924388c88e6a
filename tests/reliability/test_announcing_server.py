"""The router's server, psrl.serving.server.AnnouncingServer:
- it sets the cyclic GC for request-lived objects: the start-up heap frozen, a higher young-generation threshold,
  and garbage in cycles still collected under it;
- it sleeps until it is told to exit: no polling of `should_exit` ten times a second as uvicorn's main loop does,
  only a tick a second for the `date` header. Setting `should_exit` (from the loop, from another thread, or by
  the signal handler) ends it without waiting for a tick."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable, Iterator
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from _procs import REPO, popen, read_ready_line

from psrl.serving.server import AnnouncingServer


@pytest.fixture
def gc_state() -> Iterator[None]:
    """Put the process's GC settings back as they were: the tests change them for the whole interpreter."""
    threshold, enabled = gc.get_threshold(), gc.isenabled()
    try:
        yield
    finally:
        gc.unfreeze()
        gc.set_threshold(*threshold)
        if enabled:
            gc.enable()


async def _app(scope, receive, send) -> None:  # a plain ASGI app: the server is what is under test
    if scope["type"] == "http":
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})


class _CountingServer(AnnouncingServer):
    ticks = 0
    MAX_TICKS = 1000  # past it the server ends itself, so a loop that spins fails its test instead of hanging it

    async def on_tick(self, counter: int) -> bool:
        self.ticks += 1
        return self.ticks > self.MAX_TICKS or await super().on_tick(counter)


@contextlib.asynccontextmanager
async def _serving(
    *, tune_gc: bool = False, tick_s: float = 1.0, **options: Any
) -> AsyncIterator[tuple[_CountingServer, asyncio.Task[None]]]:
    config = uvicorn.Config(_app, host="127.0.0.1", port=0, lifespan="off", log_config=None, loop="asyncio", **options)
    server = _CountingServer(config, "TEST_READY", tune_gc=tune_gc)
    server.TICK_S = tick_s
    task = asyncio.create_task(server.serve())
    for _ in range(500):
        if server.started or task.done():
            break
        await asyncio.sleep(0.01)
    assert server.started, "the server did not start"
    try:
        yield server, task
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 30)


def _port(server: uvicorn.Server) -> int:
    return server.servers[0].sockets[0].getsockname()[1]


async def test_a_tuned_server_freezes_its_start_up_heap_and_raises_the_young_threshold(gc_state: None) -> None:
    gc.unfreeze()
    old = gc.get_threshold()
    async with _serving(tune_gc=True):
        assert gc.get_freeze_count() > 0
        assert gc.get_threshold() == (AnnouncingServer.YOUNG_THRESHOLD, *old[1:])


async def test_an_untuned_server_leaves_the_gc_alone(gc_state: None) -> None:
    gc.unfreeze()
    old = gc.get_threshold()
    async with _serving(tune_gc=False):
        assert gc.get_freeze_count() == 0
        assert gc.get_threshold() == old


class _Node:
    def __init__(self) -> None:
        self.me = self  # a cycle: refcounting alone never frees it


def test_garbage_in_cycles_is_still_collected_at_the_raised_threshold(gc_state: None) -> None:
    gc.collect()
    gc.set_threshold(AnnouncingServer.YOUNG_THRESHOLD, *gc.get_threshold()[1:])
    gc.enable()
    first = weakref.ref(_Node())
    assert first() is not None  # garbage, waiting for a collection
    for _ in range(3 * AnnouncingServer.YOUNG_THRESHOLD):  # a leak of cycles grows the young count: it is
        _Node()  # collected within YOUNG_THRESHOLD of them, with no explicit gc.collect()
    assert first() is None


async def test_an_idle_server_ticks_once_a_second_and_keeps_its_date_header_current() -> None:
    async with _serving(tick_s=1.0) as (server, _), httpx.AsyncClient() as client:
        before = server.ticks
        await asyncio.sleep(3.5)
        assert server.ticks - before <= 5  # uvicorn's own loop ticks 35 times in that time
        answer = await client.get(f"http://127.0.0.1:{_port(server)}/")
        served = parsedate_to_datetime(answer.headers["date"]).timestamp()
        assert abs(served - time.time()) < 2.5  # refreshed by the ticks, not the start-up one


@pytest.mark.parametrize(
    "how",
    [
        pytest.param(lambda server: setattr(server, "should_exit", True), id="from-the-loop"),
        pytest.param(
            lambda server: threading.Thread(target=setattr, args=(server, "should_exit", True)).start(),
            id="from-another-thread",
        ),
    ],
)
async def test_told_to_exit_the_server_ends_without_waiting_for_a_tick(how: Callable[[uvicorn.Server], None]) -> None:
    async with _serving(tick_s=3600.0) as (server, task):  # a tick would never come within the test
        ticks = server.ticks
        how(server)
        await asyncio.wait_for(task, 30)
        assert server.ticks == ticks + 1  # the exit check, on the wake the setting made


async def test_an_exit_called_off_before_the_server_saw_it_leaves_it_serving_without_spinning() -> None:
    async with _serving(tick_s=3600.0) as (server, task):
        ticks = server.ticks
        server.should_exit = True  # wakes the main loop ...
        server.should_exit = False  # ... which then finds nothing to do
        await asyncio.sleep(0.5)
        assert not task.done() and server.ticks == ticks + 1  # one look, then asleep again


_SERVE_FOR_AN_HOUR_A_TICK = """
import uvicorn
from psrl.serving.server import AnnouncingServer, run_server

async def app(scope, receive, send):
    pass

server = AnnouncingServer(uvicorn.Config(app, host="127.0.0.1", port=0, lifespan="off", log_config=None), "READY")
server.TICK_S = 3600.0
run_server(server)
"""


def test_a_sigterm_ends_the_server_without_waiting_for_a_tick(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    proc = popen(
        [sys.executable, "-c", _SERVE_FOR_AN_HOUR_A_TICK], stdout=subprocess.PIPE, stderr=log.open("wb"), cwd=REPO
    )
    try:
        read_ready_line(proc, log, "READY", timeout_s=60)
        proc.send_signal(signal.SIGTERM)
        # uvicorn raises the signal again once it has shut down, so the process ends by it
        assert proc.wait(timeout=30) == -signal.SIGTERM
    finally:
        proc.kill()
        proc.wait()


async def test_a_request_limit_is_still_checked_on_each_tick() -> None:
    """uvicorn's --limit-max-requests (our servers do not set it, but the tick keeps uvicorn's checks)."""
    async with _serving(tick_s=0.05, limit_max_requests=1) as (server, task), httpx.AsyncClient() as client:
        await client.get(f"http://127.0.0.1:{_port(server)}/", headers={"connection": "close"})  # none left open
        await asyncio.wait_for(task, 30)
        assert not server.should_exit  # it ended on the limit, not on an exit request
