"""Waiting for a condition, named so that a timeout says what never happened: `wait_for` polls from a thread
(tests that drive real processes), `until` yields to the event loop (tests whose subject runs on it)."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable


def wait_for(predicate: Callable[[], object], what: str, timeout_s: float = 30.0, poll_s: float = 0.02) -> None:
    """Poll until `predicate()` is true; after `timeout_s`, an assertion error naming `what` was awaited."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"not met in {timeout_s}s: {what}"
        time.sleep(poll_s)


async def until(condition: Callable[[], object], what: str, timeout_s: float = 10.0, poll_s: float = 0.005) -> None:
    """Yield to the event loop until `condition()` holds (awaited when it is a coroutine function, as one that asks
    a process over HTTP is); after `timeout_s`, an assertion error naming `what`."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s

    async def holds() -> object:
        result = condition()
        return await result if inspect.isawaitable(result) else result

    while not await holds():
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting until {what}")
        await asyncio.sleep(poll_s)
