"""The router's server sets the cyclic GC for request-lived objects (psrl.serving.server.AnnouncingServer): the
start-up heap frozen, a higher young-generation threshold, and garbage in cycles still collected under it."""

from __future__ import annotations

import asyncio
import gc
import weakref
from collections.abc import Iterator

import pytest
import uvicorn

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


async def _started(tune_gc: bool) -> tuple[AnnouncingServer, asyncio.Task[None]]:
    config = uvicorn.Config(_app, host="127.0.0.1", port=0, lifespan="off", log_config=None, loop="asyncio")
    server = AnnouncingServer(config, "TEST_READY", tune_gc=tune_gc)
    task = asyncio.create_task(server.serve())
    for _ in range(500):
        if server.started or task.done():
            break
        await asyncio.sleep(0.01)
    assert server.started, "the server did not start"
    return server, task


async def _stop(server: AnnouncingServer, task: asyncio.Task[None]) -> None:
    server.should_exit = True
    await asyncio.wait_for(task, 10)


async def test_a_tuned_server_freezes_its_start_up_heap_and_raises_the_young_threshold(gc_state: None) -> None:
    gc.unfreeze()
    old = gc.get_threshold()
    server, task = await _started(tune_gc=True)
    try:
        assert gc.get_freeze_count() > 0
        assert gc.get_threshold() == (AnnouncingServer.YOUNG_THRESHOLD, *old[1:])
    finally:
        await _stop(server, task)


async def test_an_untuned_server_leaves_the_gc_alone(gc_state: None) -> None:
    gc.unfreeze()
    old = gc.get_threshold()
    server, task = await _started(tune_gc=False)
    try:
        assert gc.get_freeze_count() == 0
        assert gc.get_threshold() == old
    finally:
        await _stop(server, task)


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
