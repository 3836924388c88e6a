"""The router's HTTP/1.1 server (`psrl.serving.http1`) on a real socket, inside uvicorn's server as the router
runs it: keep-alive, pipelining, 100-continue, streams and their flow control, clients that leave (the handler
or the stream is cancelled and its `finally` runs, quietly), handlers that fail, and the framing it writes."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

import pytest
import uvicorn
from _http_raw import parse

from psrl.router.web import App
from psrl.serving.http1 import AnyResponse, Request, Response, StreamingResponse, http1_protocol
from psrl.serving.limits import HttpLimits

Handler = Callable[[Request], Awaitable[AnyResponse]]


def _render_error(code: str, message: str) -> bytes:
    return json.dumps({"error": {"code": code, "message": message}}).encode()


@contextlib.asynccontextmanager
async def _no_lifespan() -> AsyncIterator[None]:
    yield


@contextlib.asynccontextmanager
async def serving(routes: dict[str, Handler]) -> AsyncIterator[int]:
    """The routes (POST and GET) served on 127.0.0.1 in this loop; yields the port."""
    async with serving_with(routes) as (port, _):
        yield port


@contextlib.asynccontextmanager
async def serving_with(routes: dict[str, Handler]) -> AsyncIterator[tuple[int, uvicorn.Server]]:
    """`serving`, with uvicorn's server too."""
    app = App(_no_lifespan)
    for path, handler in routes.items():
        app.route("POST", path, handler)
        app.route("GET", path, handler)
    config = uvicorn.Config(
        app,
        host="127.0.0.1",
        port=0,
        http=http1_protocol(app.handle, HttpLimits(), _render_error),
        log_config=None,
        timeout_graceful_shutdown=2,  # a failed test's open connection does not hold the server up
    )
    server = uvicorn.Server(config)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    serve = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]))
    while not server.started:
        await asyncio.sleep(0.01)
    try:
        yield sock.getsockname()[1], server
    finally:
        server.should_exit = True
        await serve


class Client:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def response(self) -> tuple[int, dict[str, str], bytes]:
        """One whole response (content-length or chunked body)."""
        head = await self.reader.readuntil(b"\r\n\r\n")
        status, headers, _ = parse(head)
        if headers.get("transfer-encoding") == "chunked":
            body = b""
            while True:
                size = int((await self.reader.readuntil(b"\r\n"))[:-2], 16)
                chunk = await self.reader.readexactly(size + 2)
                if size == 0:
                    return status, headers, body
                body += chunk[:-2]
        return status, headers, await self.reader.readexactly(int(headers.get("content-length", "0")))

    def close(self) -> None:
        self.writer.transport.abort()  # a client that vanishes: no goodbye


@contextlib.asynccontextmanager
async def connect(port: int) -> AsyncIterator[Client]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    client = Client(reader, writer)
    try:
        yield client
    finally:
        writer.close()


def post(path: str, body: bytes = b"{}", extra: str = "") -> bytes:
    return f"POST {path} HTTP/1.1\r\nHost: t\r\nContent-Length: {len(body)}\r\n{extra}\r\n".encode() + body


async def echo(request: Request) -> AnyResponse:
    return Response(request.body, headers={"x-path": request.path, "x-query": request.query.decode()})


@pytest.fixture
def errors(caplog: pytest.LogCaptureFixture) -> Iterator[Callable[[], list[str]]]:
    caplog.set_level(logging.ERROR)
    yield lambda: [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


def test_keep_alive_serves_requests_in_turn_and_http10_closes() -> None:
    async def run() -> None:
        async with serving({"/echo": echo}) as port, connect(port) as client:
            for i in range(3):
                body = f'{{"i": {i}}}'.encode()
                await client.send(post(f"/echo?n={i}", body))
                status, headers, answer = await client.response()
                assert (status, answer, headers["x-query"]) == (200, body, f"n={i}")
                assert "connection" not in headers and headers["content-type"] == "application/json"
            await client.send(b"GET /ec%68o HTTP/1.0\r\n\r\n")  # percent-decoded path; 1.0: the answer closes
            status, headers, _ = await client.response()
            assert (status, headers["x-path"], headers["connection"]) == (200, "/echo", "close")
            assert await client.reader.read() == b""

    asyncio.run(run())


def test_pipelined_requests_run_one_at_a_time_in_order() -> None:
    running: list[str] = []
    order: list[str] = []

    async def slow(request: Request) -> AnyResponse:
        running.append(request.query.decode())
        assert len(running) == 1, "a pipelined request ran before the one ahead of it was answered"
        await asyncio.sleep(0.05)
        order.append(running.pop())
        return Response(request.query)

    async def run() -> None:
        async with serving({"/slow": slow}) as port, connect(port) as client:
            await client.send(b"".join(post(f"/slow?{i}") for i in range(4)))
            assert [(await client.response())[2] for _ in range(4)] == [b"0", b"1", b"2", b"3"]

    asyncio.run(run())
    assert order == ["0", "1", "2", "3"]


def test_expect_100_continue_is_answered_before_the_body() -> None:
    async def run() -> None:
        async with serving({"/echo": echo}) as port, connect(port) as client:
            await client.send(b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 2\r\nExpect: 100-continue\r\n\r\n")
            assert await asyncio.wait_for(client.reader.readuntil(b"\r\n\r\n"), 5) == b"HTTP/1.1 100 Continue\r\n\r\n"
            await client.send(b"{}")
            assert (await client.response())[::2] == (200, b"{}")

    asyncio.run(run())


def test_a_100_continue_behind_a_pipelined_request_waits_for_its_answer() -> None:
    """Sent while the request before is answered, a 100 Continue would land inside that answer."""
    gate = asyncio.Event()

    async def held(request: Request) -> AnyResponse:
        await gate.wait()
        return Response(b"first")

    async def run() -> None:
        async with serving({"/held": held, "/echo": echo}) as port, connect(port) as client:
            head = b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 2\r\nExpect: 100-continue\r\n\r\n"
            await client.send(post("/held") + head)
            await asyncio.sleep(0.1)
            gate.set()
            assert (await client.response())[::2] == (200, b"first")  # whole, nothing inside it
            assert await asyncio.wait_for(client.reader.readuntil(b"\r\n\r\n"), 5) == b"HTTP/1.1 100 Continue\r\n\r\n"
            await client.send(b"{}")
            assert (await client.response())[::2] == (200, b"{}")

    asyncio.run(run())


def test_a_graceful_shutdown_lets_a_busy_connection_finish_its_answer() -> None:
    gate, entered = asyncio.Event(), asyncio.Event()

    async def held(request: Request) -> AnyResponse:
        entered.set()
        await gate.wait()
        return Response(b"done")

    async def run() -> None:
        async with serving_with({"/held": held}) as (port, server), connect(port) as client:
            await client.send(post("/held"))
            await asyncio.wait_for(entered.wait(), 5)
            server.should_exit = True  # as SIGTERM does
            await asyncio.sleep(0.2)
            gate.set()
            status, headers, body = await client.response()
            assert (status, body, headers["connection"]) == (200, b"done", "close")
            assert await client.reader.read() == b""

    asyncio.run(run())


def test_a_stream_is_chunked_and_waits_for_a_slow_reader() -> None:
    """A client that does not read fills the transport's buffer: the stream stops pulling its iterator (the
    replica's output stays upstream) until the client reads again, then goes out whole."""
    pulled = [0]
    chunk = b"x" * (1 << 16)

    async def chunks() -> AsyncIterator[bytes]:
        for _ in range(400):  # 25 MiB
            pulled[0] += 1
            yield chunk

    async def stream(request: Request) -> AnyResponse:
        return StreamingResponse(chunks(), headers={"x-kind": "stream"})

    async def run() -> None:
        async with serving({"/stream": stream}) as port, connect(port) as client:
            client.writer.transport.set_write_buffer_limits(0)
            sock = client.writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)
            client.writer.transport.pause_reading()
            await client.send(post("/stream"))
            await asyncio.sleep(0.5)
            assert 0 < pulled[0] < 200, pulled[0]  # held back well before the whole stream
            client.writer.transport.resume_reading()
            status, headers, body = await client.response()
            assert (status, headers["transfer-encoding"], headers["x-kind"]) == (200, "chunked", "stream")
            assert body == chunk * 400

    asyncio.run(run())


def test_pipelined_answers_wait_for_a_client_that_does_not_read() -> None:
    """Answers queue in the client's socket, then the transport's buffer; past its high-water mark the next
    pipelined request waits (its handler does not run), so the unread answers stay bounded."""
    ran = [0]
    body = b"y" * (1 << 20)

    async def big(request: Request) -> AnyResponse:
        ran[0] += 1
        return Response(body)

    async def run() -> None:
        async with serving({"/big": big}) as port:
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)
            sock.connect(("127.0.0.1", port))
            reader, writer = await asyncio.open_connection(sock=sock)
            client = Client(reader, writer)
            try:
                writer.transport.pause_reading()
                await client.send(b"".join(post("/big") for _ in range(40)))  # 40 MiB of answers asked for
                await asyncio.sleep(0.5)
                assert 0 < ran[0] < 20, ran[0]
                writer.transport.resume_reading()
                for _ in range(40):
                    assert (await client.response())[2] == body
                assert ran[0] == 40
            finally:
                client.close()

    asyncio.run(run())


@pytest.mark.parametrize("where", ["in the handler", "mid-stream", "as the handler returns a stream"])
def test_a_client_that_leaves_cancels_its_request_quietly(where: str, errors: Callable[[], list[str]]) -> None:
    """Its handler (or its stream's iterator) is cancelled and its `finally` runs at once; nothing is logged
    as an error, and the server goes on serving. A stream never pulled (its handler absorbed the cancellation
    and returned it anyway) is still started and closed, so its `finally` runs too."""
    released: list[str] = []
    entered = asyncio.Event()

    async def chunks() -> AsyncIterator[bytes]:
        try:
            if where == "as the handler returns a stream":
                await asyncio.Event().wait()  # e.g. the upstream's first bytes, which never come
            yield b"data: x\n\n"
            entered.set()
            await asyncio.Event().wait()
            yield b"never"
        finally:
            released.append("stream")

    async def handler(request: Request) -> AnyResponse:
        try:
            if where != "mid-stream":
                entered.set()
                await asyncio.Event().wait()
            return StreamingResponse(chunks())
        except asyncio.CancelledError:
            if where == "in the handler":
                raise
            return StreamingResponse(chunks())
        finally:
            released.append("handler")

    async def run() -> None:
        async with serving({"/x": handler, "/echo": echo}) as port:
            async with connect(port) as client:
                await client.send(post("/x"))
                await asyncio.wait_for(entered.wait(), 5)
                client.close()
            for _ in range(100):
                if "stream" in released or (where == "in the handler" and released):
                    break
                await asyncio.sleep(0.01)
            async with connect(port) as client:
                await client.send(post("/echo"))
                assert (await client.response())[0] == 200

    asyncio.run(run())
    assert released == (["handler"] if where == "in the handler" else ["handler", "stream"])
    assert errors() == []


def test_a_handler_that_raises_costs_its_request_a_500_only(errors: Callable[[], list[str]]) -> None:
    async def broken(request: Request) -> AnyResponse:
        raise RuntimeError("boom")

    async def injected(request: Request) -> AnyResponse:
        return Response(b"{}", headers={"x-bad": "a\r\nset-cookie: x"})  # would split the response

    async def run() -> None:
        async with serving({"/broken": broken, "/injected": injected, "/echo": echo}) as port:
            for path in ("/broken", "/injected"):
                async with connect(port) as client:
                    await client.send(post(path))
                    status, headers, body = await client.response()
                    assert (status, headers["connection"]) == (500, "close")
                    assert json.loads(body)["error"]["code"] == "internal_error"
                    assert "set-cookie" not in headers
            async with connect(port) as client:
                await client.send(post("/echo"))
                assert (await client.response())[0] == 200

    asyncio.run(run())
    assert len(errors()) == 2


def test_a_stream_that_fails_midway_cuts_its_connection_only(errors: Callable[[], list[str]]) -> None:
    """Its head is out, so no 500 can follow: the client sees the chunked body end without its last chunk."""

    async def chunks() -> AsyncIterator[bytes]:
        yield b"data: x\n\n"
        raise RuntimeError("upstream broke")

    async def stream(request: Request) -> AnyResponse:
        return StreamingResponse(chunks())

    async def run() -> None:
        async with serving({"/stream": stream, "/echo": echo}) as port:
            async with connect(port) as client:
                await client.send(post("/stream"))
                raw = await client.reader.read()
                assert raw.startswith(b"HTTP/1.1 200 ") and b"data: x" in raw and not raw.endswith(b"0\r\n\r\n")
            async with connect(port) as client:
                await client.send(post("/echo"))
                assert (await client.response())[0] == 200

    asyncio.run(run())
    assert len(errors()) == 1


def test_a_request_target_the_parser_passes_but_no_url_parses_is_400() -> None:
    async def run() -> None:
        async with serving({"/echo": echo}) as port, connect(port) as client:
            await client.send(b"GET http://h:99999/echo HTTP/1.1\r\nHost: t\r\n\r\n")
            status, headers, body = await client.response()
            assert (status, headers["x-smg-error-code"]) == (400, "invalid_http_request")
            assert "request target" in json.loads(body)["error"]["message"]

    asyncio.run(run())


def test_framing_of_head_204_and_unrouted_answers() -> None:
    async def empty(request: Request) -> AnyResponse:
        return Response(b"", 204)

    async def run() -> None:
        async with serving({"/empty": empty, "/echo": echo}) as port, connect(port) as client:
            await client.send(post("/empty"))
            status, headers, body = await client.response()
            assert (status, body, "content-length" in headers) == (204, b"", False)
            await client.send(b"HEAD /echo HTTP/1.1\r\nHost: t\r\n\r\n")  # no HEAD route: a 405 without a body
            head = await client.reader.readuntil(b"\r\n\r\n")
            status, headers, _ = parse(head)
            assert status == 405 and int(headers["content-length"]) > 0
            await client.send(post("/nowhere"))  # the next answer follows at once: no body was left behind
            status, headers, body = await client.response()
            assert (status, json.loads(body)["error"]["code"]) == (404, "not_found")

    asyncio.run(run())


def test_an_upgrade_is_answered_over_http11_then_the_connection_closes() -> None:
    async def run() -> None:
        async with serving({"/echo": echo}) as port, connect(port) as client:
            head = b"GET /echo HTTP/1.1\r\nHost: t\r\nConnection: Upgrade\r\nUpgrade: h2c\r\n\r\n"
            await client.send(head + b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")  # the client's next protocol
            status, headers, _ = await client.response()
            assert (status, headers["connection"]) == (200, "close")
            assert await client.reader.read() == b""

    asyncio.run(run())
