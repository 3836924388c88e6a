"""A streamed response whose client leaves before the first chunk is sent still runs its iterator's `finally`
(where a stream releases its instance and cancels its upstream call), whether the iterator was parked at a
yield or never started; a client that leaves just as its handler returns a stream ends the request quietly."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest

from psrl.router.asgi import App, Request, StreamingResponse


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


@pytest.mark.parametrize("first", ["client leaves", "handler returns"])
def test_a_client_leaving_as_the_handler_returns_a_stream_ends_quietly(first: str) -> None:
    """Both in one loop iteration: the handler's watch on the client has fired (its callback already
    scheduled) as the stream's own watch begins. One cancellation, absorbed: the server's task ends normally."""
    released: list[str] = []

    async def chunks() -> AsyncIterator[bytes]:
        try:
            await asyncio.sleep(0.05)
            yield b"data: x\n\n"
        finally:
            released.append("released")

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        gate, gone = loop.create_future(), loop.create_future()

        async def handler(request: Request) -> StreamingResponse:
            await gate
            return StreamingResponse(chunks())

        app = App(contextlib.asynccontextmanager(lambda: (yield)))  # type: ignore[arg-type, misc]
        app.route("POST", "/x", handler)
        messages = [{"type": "http.request", "body": b"{}", "more_body": False}]

        async def receive() -> dict:
            if messages:
                return messages.pop(0)
            await gone
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            pass

        task = loop.create_task(app({"type": "http", "method": "POST", "path": "/x", "headers": []}, receive, send))
        await asyncio.sleep(0.01)
        for fut in (gone, gate) if first == "client leaves" else (gate, gone):
            fut.set_result(None)
        await task  # no CancelledError escapes
        assert task.cancelling() == 0

    asyncio.run(serve())
    assert released == ["released"]
