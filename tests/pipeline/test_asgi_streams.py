"""A streamed response whose client leaves before the first chunk is sent still runs its iterator's `finally`
(where a stream releases its instance and cancels its upstream call), whether the iterator was parked at a
yield or never started."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from psrl.router.asgi import Request, StreamingResponse


async def _leaves_before_the_head(chunks: AsyncIterator[bytes], *, head_sent: bool) -> None:
    """Serve `chunks` to a client that disconnects: before taking the response head, or after it."""
    messages = [{"type": "http.request", "body": b"", "more_body": False}]
    gone = asyncio.Event()

    async def receive() -> dict:
        if messages:
            return messages.pop(0)
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        if message["type"] == "http.response.start" and head_sent:
            return
        gone.set()  # the client leaves while this message is being sent
        await asyncio.Event().wait()

    request = Request({"method": "POST", "path": "/", "headers": []}, receive, {})
    await request.body()
    await StreamingResponse(chunks)(request, send)


@pytest.mark.parametrize("first_step", ["waits", "yields"])
def test_an_iterator_never_pulled_still_releases(first_step: str) -> None:
    released: list[str] = []

    async def chunks() -> AsyncIterator[bytes]:
        try:
            if first_step == "waits":
                await asyncio.Event().wait()  # e.g. the upstream's first bytes
            yield b"data: x\n\n"
        finally:
            released.append("released")

    asyncio.run(_leaves_before_the_head(chunks(), head_sent=False))
    assert released == ["released"]


def test_an_iterator_parked_at_a_yield_releases() -> None:
    released: list[str] = []

    async def chunks() -> AsyncIterator[bytes]:
        try:
            yield b"data: x\n\n"  # its send never returns: the client left
            yield b"data: y\n\n"
        finally:
            released.append("released")

    asyncio.run(_leaves_before_the_head(chunks(), head_sent=True))
    assert released == ["released"]
