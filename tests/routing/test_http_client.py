"""The router's lean HTTP client (`psrl.router.http_client`), where its own bookkeeping decides the answer:
- a body that ends with the connection (no length, not chunked) is read whole, as a chunked one is;
- a request that gives up just after its response ended (a health check's timeout firing then) leaves the
  connection, back in the pool and maybe carrying another request already, alone."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from psrl.router.http_client import HttpClient

ANSWERS = {
    b"/close": b"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n\r\nends with the connection",
    b"/chunked": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nchunk\r\n3\r\ned!\r\n0\r\n\r\n",
    b"/health": b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok",
    b"/slow": b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\ndone",
}


async def _serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            path = head.split(b" ", 2)[1]
            length = next(
                (
                    int(line.split(b":")[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length")
                ),
                0,
            )
            await reader.readexactly(length)
            if path == b"/slow":
                await asyncio.sleep(0.1)
            writer.write(ANSWERS[path])
            await writer.drain()
            if path == b"/close":
                break
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


@pytest.fixture
async def server() -> AsyncIterator[tuple[str, int]]:
    srv = await asyncio.start_server(_serve, "127.0.0.1", 0)
    yield "127.0.0.1", srv.sockets[0].getsockname()[1]
    srv.close()


async def test_bodies_without_a_length_are_read_whole(server: tuple[str, int]) -> None:
    client = HttpClient()
    try:
        async with asyncio.timeout(5):
            closed = await client.get(*server, "/close")
            chunked = await client.get(*server, "/chunked")
        assert (closed.status, closed.body) == (200, b"ends with the connection")
        assert (chunked.status, chunked.body) == (200, b"chunked!")
    finally:
        client.close()


async def test_a_request_cancelled_after_its_response_leaves_the_connection_alone(server: tuple[str, int]) -> None:
    """The race: a GET's response ends (its connection goes back to the pool), another request takes the
    connection, and only then does the GET's task see its cancellation. The other request must still get its
    answer on that connection."""
    client = HttpClient()
    pool = client._pool(*server)
    release = pool.release
    taken = []

    def release_then_reuse(conn):  # the moment the GET's response ended
        release(conn)
        get.cancel()  # its timeout fires now
        pool._idle.remove(conn)  # and a proxied request takes the connection first
        taken.append(conn.send(b"POST /slow HTTP/1.1\r\nHost: h\r\nContent-Length: 2\r\n\r\n", b"hi", False))
        pool.release = release

    pool.release = release_then_reuse  # type: ignore[method-assign]
    try:
        get = asyncio.create_task(client.get(*server, "/health"))
        with pytest.raises(asyncio.CancelledError):
            await get
        [post] = taken
        async with asyncio.timeout(5):
            assert await post.done == b"done"
    finally:
        client.close()
