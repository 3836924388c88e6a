"""psrl.router.grpc_stream, the router's Generate client over libcurl, against a reference replica and grpc.aio
servers, on asyncio's loop and on the router's (uvloop): the same frames, statuses and details as grpc.aio's
client; cancel aborts the replica's request; a deadline, an unreachable replica and a peer that is not gRPC are
errors with gRPC's codes, never a hang."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import select
import socket
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import grpc
import h2.config
import h2.connection
import h2.errors
import h2.events
import pycurl
import pytest
import uvloop
from _procs import Proc, free_port, replica_busy
from google.protobuf.message import DecodeError
from smg_grpc_proto.generated import vllm_engine_pb2 as pb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as pb_grpc

from psrl.router import grpc_stream
from psrl.router.grpc_stream import CurlGrpc, StreamCall
from psrl.router.pipeline.context import GenerationInput, SamplingSpec
from psrl.router.pipeline.execute import WorkerCall
from psrl.router.registry import WorkerRegistry
from psrl.router.worker_client import GENERATE_METHOD, WorkerClients

PROMPT = list(range(11, 31))


def _req(rid: str, *, stream: bool = False, max_tokens: int = 8, prompt: list[int] | None = None) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=rid,
        tokenized=pb.TokenizedInput(input_ids=prompt or PROMPT),
        sampling_params=pb.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
        stream=stream,
    )


@pytest.fixture
async def client() -> AsyncIterator[CurlGrpc]:
    c = CurlGrpc()
    yield c
    c.close()
    assert not c._fds and not c._calls  # nothing left watched or running


def _call(client: CurlGrpc, target: str, req: pb.GenerateRequest, **kw: object) -> StreamCall[pb.GenerateResponse]:
    return client.unary_stream(target, GENERATE_METHOD, req.SerializeToString(), pb.GenerateResponse.FromString, **kw)  # type: ignore[arg-type]


async def _frames(call: StreamCall[pb.GenerateResponse]) -> list[pb.GenerateResponse]:
    frames = []
    while (frame := await call.read()) is not None:
        frames.append(frame)
    return frames


async def _grpc_aio(
    target: str, req: pb.GenerateRequest
) -> tuple[list[pb.GenerateResponse], grpc.aio.AioRpcError | None]:
    async with grpc.aio.insecure_channel(target) as channel:
        frames = []
        try:
            async for frame in pb_grpc.VllmEngineStub(channel).Generate(req):
                frames.append(frame)
        except grpc.aio.AioRpcError as e:
            return frames, e
    return frames, None


def _target(replica: Proc) -> str:
    return replica.url.removeprefix("grpc://")


async def test_frames_match_grpc_aio_streamed_and_not(client: CurlGrpc, replica: Proc) -> None:
    for stream in (False, True):
        req = _req(f"same-{stream}", stream=stream, max_tokens=24)
        call = _call(client, _target(replica), req, timeout_s=60)
        await call.wait_for_connection()
        ours = await _frames(call)
        theirs, error = await _grpc_aio(_target(replica), _req(f"same-{stream}-aio", stream=stream, max_tokens=24))
        assert error is None and call.done()
        assert [f.WhichOneof("response") for f in ours] == [f.WhichOneof("response") for f in theirs]
        assert [list(f.chunk.token_ids) or list(f.complete.output_ids) for f in ours] == [
            list(f.chunk.token_ids) or list(f.complete.output_ids) for f in theirs
        ]  # greedy: the same ids, frame by frame
        assert len(ours) == (25 if stream else 1)  # streamed: a chunk per token, then the complete frame
        assert await call.read() is None  # and again, once ended
        assert grpc_stream._OK_LINE in call._lines  # the status line as the fast path looks for it
        metadata = await call.initial_metadata()
        assert metadata.get("x-psrl-accepted") == "1"  # what the router reads to tell "started" from "refused"


async def test_many_calls_share_the_connection(client: CurlGrpc, replica: Proc) -> None:
    await _frames(_call(client, _target(replica), _req("first", max_tokens=1)))  # the connection is up
    calls = [_call(client, _target(replica), _req(f"many-{i}", max_tokens=2), timeout_s=60) for i in range(64)]
    results = await asyncio.gather(*(_frames(c) for c in calls))
    assert all(r[-1].complete.finish_reason == "length" for r in results)
    assert sum(c._curl.getinfo(pycurl.NUM_CONNECTS) for c in calls) == 0  # type: ignore[union-attr]  # all on the one


async def test_refusal_has_grpc_aio_code_and_details(client: CurlGrpc, replica: Proc) -> None:
    too_long = _req("overflow", prompt=[1] * 5000)
    call = _call(client, _target(replica), too_long, timeout_s=60)
    with pytest.raises(grpc.aio.AioRpcError) as ours:
        await call.read()
    _, theirs = await _grpc_aio(_target(replica), too_long)
    assert theirs is not None
    assert ours.value.code() == theirs.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert ours.value.details() == theirs.details() and "maximum model length" in ours.value.details()
    with pytest.raises(grpc.aio.AioRpcError):
        await call.read()  # an ended call keeps its error


async def test_cancel_aborts_the_replicas_request(client: CurlGrpc, replica: Proc) -> None:
    call = _call(client, _target(replica), _req("cancelled", stream=True, max_tokens=1500), timeout_s=60)
    assert (await call.read()).WhichOneof("response") == "chunk"  # type: ignore[union-attr]
    assert await asyncio.to_thread(replica_busy, replica.url) == 1
    assert call.cancel() and call.done() and not call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call.read()
    deadline = time.monotonic() + 10
    while await asyncio.to_thread(replica_busy, replica.url):
        assert time.monotonic() < deadline, "the replica still runs the cancelled request"
        await asyncio.sleep(0.05)
    # the connection is fine for the next call
    assert (await _frames(_call(client, _target(replica), _req("after", max_tokens=2))))[-1].complete.output_ids


async def test_deadline_is_deadline_exceeded(client: CurlGrpc, replica: Proc) -> None:
    call = _call(client, _target(replica), _req("slow", stream=True, max_tokens=1500), timeout_s=0.3)
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await _frames(call)
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


async def test_unreachable_replica_is_unavailable(client: CurlGrpc) -> None:
    call = _call(client, f"127.0.0.1:{free_port()}", _req("nobody"), timeout_s=5)
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await call.wait_for_connection()
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    with pytest.raises(grpc.aio.AioRpcError):
        await call.read()


class _Servicer(pb_grpc.VllmEngineServicer):
    """Error paths a replica of ours never takes."""

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> AsyncIterator:
        if request.request_id == "slow":
            await asyncio.sleep(0.5)
            yield pb.GenerateResponse(chunk=pb.GenerateStreamChunk(token_ids=[7]))
            return
        if request.request_id == "trailers-only":
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "kein Zugang: ü%ß")
        yield pb.GenerateResponse(chunk=pb.GenerateStreamChunk(token_ids=[1, 2]))
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "out of KV blocks")


@pytest.fixture
async def grpc_server() -> AsyncIterator[str]:
    server = grpc.aio.server()
    pb_grpc.add_VllmEngineServicer_to_server(_Servicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield f"127.0.0.1:{port}"
    await server.stop(None)


async def test_statuses_of_a_grpc_server_read_as_grpc_aio_reads_them(client: CurlGrpc, grpc_server: str) -> None:
    for rid in ("trailers-only", "mid-stream"):
        call = _call(client, grpc_server, _req(rid))
        frames, theirs = await _grpc_aio(grpc_server, _req(rid))
        ours: list[pb.GenerateResponse] = []
        with pytest.raises(grpc.aio.AioRpcError) as e:
            while True:
                ours.append(await call.read())  # type: ignore[arg-type]
        assert theirs is not None and (e.value.code(), e.value.details()) == (theirs.code(), theirs.details())
        assert ours == frames  # the frames before the error are read first


def _in_epoll(client: CurlGrpc) -> set[int]:
    """The fds the kernel holds in the client's epoll (its `tfd:` lines in /proc)."""
    assert client._poller is not None
    info = Path(f"/proc/self/fdinfo/{client._poller.fileno()}").read_text()
    return {int(line.split()[1]) for line in info.splitlines() if line.startswith("tfd:")}


async def test_curl_s_sockets_are_watched_in_its_epoll_and_the_loop_watches_that_alone(
    client: CurlGrpc, replica: Proc, grpc_server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """curl asks to watch a replica's connection (and an eventfd of its own) when a call starts on it idle, and
    to forget both when its last call ends: at one request at a time, every request. Those changes go to the
    client's epoll; the loop is asked once, for the epoll's fd. With one socket handled per wake, calls to two
    peers at once still all end: epoll reports again what was left."""
    loop = asyncio.get_running_loop()
    watched: list[int] = []
    add_reader = loop.add_reader
    monkeypatch.setattr(loop, "add_reader", lambda fd, *args: (watched.append(fd), add_reader(fd, *args))[1])
    for i in range(4):
        frames = await _frames(_call(client, _target(replica), _req(f"alone-{i}", max_tokens=1)))
        assert frames[-1].complete.finish_reason == "length"
        assert not client._fds and not _in_epoll(client)  # its call ended: curl forgot its sockets, so did the epoll
    assert client._poller is not None and watched == [client._poller.fileno()]
    monkeypatch.setattr(grpc_stream, "_READY_BATCH", 1)
    ours = [_call(client, _target(replica), _req(f"both-{i}", max_tokens=4), timeout_s=60) for i in range(6)]
    theirs = [_call(client, grpc_server, _req(f"both-{i}"), timeout_s=60) for i in range(6)]
    results = await asyncio.gather(*(_frames(c) for c in ours), *(_frames(c) for c in theirs), return_exceptions=True)
    assert all(r[-1].complete.finish_reason == "length" for r in results[:6])  # type: ignore[index]
    assert all(
        isinstance(r, grpc.aio.AioRpcError) and r.code() == grpc.StatusCode.RESOURCE_EXHAUSTED for r in results[6:]
    )
    assert watched == [client._poller.fileno()] and not client._fds


def _high_fd(sock: socket.socket) -> int:
    """`sock`'s socket under a number of its own, well above those the process's threads take (they get the lowest
    free), so a test can close it and give the number to another socket; `sock` itself is closed."""
    with sock:
        return fcntl.fcntl(sock.fileno(), fcntl.F_DUPFD, 900)


async def test_a_socket_closed_under_the_epoll_is_forgotten_and_its_number_watched_anew(client: CurlGrpc) -> None:
    """curl tells of a socket's end before it closes it. Should it not, the kernel drops the socket from the
    epoll when its last descriptor closes: a REMOVE after that is not an error, and a new socket given the same
    number is watched, not taken for the old one."""
    client._open()
    assert client._poller is not None
    a, b = socket.socketpair()
    fd = _high_fd(a)
    client._on_socket(pycurl.POLL_IN, fd, None, None)
    os.close(fd)  # no REMOVE first
    c, d = socket.socketpair()
    os.dup2(c.fileno(), fd)
    c.close()
    client._on_socket(pycurl.POLL_INOUT, fd, None, None)  # the kernel forgot the old one: added, not modified
    with b, d:
        assert client._poller.poll(0) == [(fd, select.EPOLLOUT)]
        os.close(fd)
        client._on_socket(pycurl.POLL_REMOVE, fd, None, None)  # a REMOVE after the close
        assert not client._fds and client._poller.poll(0) == []


async def test_ready_sockets_reach_curl_as_it_asked_and_strays_leave_the_epoll(
    client: CurlGrpc, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What `_on_ready` hands curl: every ready socket, over as many wakes as the batch takes (epoll reports
    again what was left); for each, only the directions curl asked for, a hang-up included; and a ready socket
    curl does not ask about is taken out of the epoll, where it would wake the loop forever."""
    client._open()
    assert client._poller is not None
    acted: list[tuple[int, int]] = []
    monkeypatch.setattr(client, "_act", lambda fd, events: acted.append((fd, events)))
    monkeypatch.setattr(grpc_stream, "_READY_BATCH", 1)
    (a1, b1), (a2, b2) = socket.socketpair(), socket.socketpair()
    fd1, fd2 = _high_fd(a1), _high_fd(a2)
    try:
        for fd, peer in ((fd1, b1), (fd2, b2)):
            client._on_socket(pycurl.POLL_IN, fd, None, None)
            peer.send(b"x")  # readable, and stays so: nothing reads it
        client._on_ready()
        client._on_ready()
        assert sorted(acted) == [(fd1, pycurl.CSELECT_IN), (fd2, pycurl.CSELECT_IN)]
        acted.clear()
        b1.close()  # a hang-up: readable (the byte, then the end) and writable, but curl asks to write only
        client._on_socket(pycurl.POLL_OUT, fd1, None, None)
        del client._fds[fd2]  # the epoll holds a socket curl no longer asks about
        for _ in range(3):
            client._on_ready()
        assert acted and set(acted) == {(fd1, pycurl.CSELECT_OUT)}
        assert [fd for fd, _ in client._poller.poll(0, 8)] == [fd1]  # fd2 is out
    finally:
        os.close(fd1)
        os.close(fd2)
        b2.close()


async def test_a_cancelled_reader_leaves_the_call_readable(client: CurlGrpc, grpc_server: str) -> None:
    """A reader that gives up (its task cancelled, as when a client leaves) does not poison the next read."""
    call = _call(client, grpc_server, _req("slow"), timeout_s=10)
    reader = asyncio.ensure_future(call.read())
    await asyncio.sleep(0.05)  # waiting: the first message comes after 0.5 s
    reader.cancel()
    with pytest.raises(asyncio.CancelledError):
        await reader
    assert [list(f.chunk.token_ids) for f in await _frames(call)] == [[7]]


@pytest.fixture
def http1_server() -> Iterator[str]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"not gRPC")

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


async def test_a_peer_that_is_not_grpc_is_an_error(client: CurlGrpc, http1_server: str) -> None:
    call = _call(client, http1_server, _req("http1"), timeout_s=5)
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await call.read()
    assert e.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN)
    assert "curl error" in e.value.details()


async def test_a_replica_that_dies_mid_stream_is_unavailable(client: CurlGrpc) -> None:
    """A listener that accepts and closes: the connection breaks under the call."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def accept_and_close() -> None:
        conn, _ = listener.accept()
        conn.recv(65536)
        conn.close()

    thread = threading.Thread(target=accept_and_close, daemon=True)
    thread.start()
    try:
        call = _call(client, f"127.0.0.1:{port}", _req("dies"), timeout_s=5)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await call.read()
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        thread.join(5)
        listener.close()


async def test_calls_start_on_the_next_turn_and_one_cancelled_before_it_never_does(
    client: CurlGrpc, replica: Proc
) -> None:
    """curl starts the calls of one loop turn together on the next (its 0 ms timer): nothing is sent before,
    and a call cancelled in the same turn is never sent, while the others of that turn are."""
    await _frames(_call(client, _target(replica), _req("warm", max_tokens=1)))  # the connection is up
    kept = _call(client, _target(replica), _req("kept", max_tokens=2), timeout_s=60)
    dropped = _call(client, _target(replica), _req("dropped", stream=True, max_tokens=1500), timeout_s=60)
    assert kept._offset == dropped._offset == 0  # not started in the turn that made them
    assert dropped.cancel() and dropped.done()
    assert (await _frames(kept))[-1].complete.finish_reason == "length"
    assert dropped._offset == 0  # never sent
    assert await asyncio.to_thread(replica_busy, replica.url) == 0
    with pytest.raises(asyncio.CancelledError):
        await dropped.read()


@pytest.mark.parametrize(
    "scenario",
    [
        test_frames_match_grpc_aio_streamed_and_not,
        test_many_calls_share_the_connection,
        test_refusal_has_grpc_aio_code_and_details,
        test_cancel_aborts_the_replicas_request,
        test_deadline_is_deadline_exceeded,
        test_calls_start_on_the_next_turn_and_one_cancelled_before_it_never_does,
    ],
)
def test_the_same_on_uvloop(scenario: Callable[[CurlGrpc, Proc], Awaitable[None]], replica: Proc) -> None:
    """The router runs on uvloop, whose timer handles are not asyncio's."""

    async def run() -> None:
        client = CurlGrpc()
        try:
            await scenario(client, replica)
        finally:
            client.close()
        assert not client._fds and not client._calls

    uvloop.run(run())


class _H2Replica(asyncio.Protocol):
    """An HTTP/2 peer (the h2 library) that answers every stream as its mode says: what a gRPC server of
    ours or vLLM's does only in races (a refused stream, a GOAWAY) or never (a status that is not a number)."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.heard: list[dict[bytes, bytes]] = []  # each stream's request headers
        self.closed = asyncio.Event()
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False, header_encoding=None))

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        if self.mode == "hang-up-at-once":  # a replica that dies as each connection comes
            transport.close()
            return
        self.conn.initiate_connection()
        transport.write(self.conn.data_to_send())  # type: ignore[attr-defined]

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed.set()

    def data_received(self, data: bytes) -> None:
        for event in self.conn.receive_data(data):
            if isinstance(event, h2.events.RequestReceived):
                sid = event.stream_id
                self.heard.append(dict(event.headers))
                if self.mode == "answer-once" and len(self.heard) > 1:  # then it takes calls and never answers
                    continue
                if self.mode == "answer-once":
                    answer = pb.GenerateResponse(complete=pb.GenerateComplete(output_ids=[5], finish_reason="length"))
                    payload = answer.SerializeToString()
                    self.conn.send_headers(sid, [(b":status", b"200"), (b"content-type", b"application/grpc")])
                    self.conn.send_data(sid, b"\0" + len(payload).to_bytes(4, "big") + payload)
                    self.conn.send_headers(sid, [(b"grpc-status", b"0")], end_stream=True)
                elif self.mode == "refuse":
                    self.conn.reset_stream(sid, h2.errors.ErrorCodes.REFUSED_STREAM)
                elif self.mode == "goaway":
                    self.conn.close_connection(last_stream_id=0)
                elif self.mode == "http-503":  # a proxy's answer: no gRPC status at all
                    self.conn.send_headers(sid, [(b":status", b"503")], end_stream=True)
                elif self.mode == "odd-status":
                    self.conn.send_headers(sid, [(b":status", b"200"), (b"content-type", b"application/grpc")])
                    self.conn.send_headers(sid, [(b"grpc-status", b"\xb2")], end_stream=True)  # isdigit(), not int()
                elif self.mode == "answer-then-hang-up":  # a replica that exits, without a GOAWAY, once it answered
                    answer = pb.GenerateResponse(complete=pb.GenerateComplete(output_ids=[5], finish_reason="length"))
                    payload = answer.SerializeToString()
                    self.conn.send_headers(sid, [(b":status", b"200"), (b"content-type", b"application/grpc")])
                    self.conn.send_data(sid, b"\0" + len(payload).to_bytes(4, "big") + payload)
                    self.conn.send_headers(sid, [(b"grpc-status", b"0")], end_stream=True)
                    self.transport.write(self.conn.data_to_send())  # type: ignore[attr-defined]
                    self.transport.close()
                    return
        self.transport.write(self.conn.data_to_send())  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("mode", "code"),
    [
        ("refuse", grpc.StatusCode.UNAVAILABLE),  # curl sends it again (rewinding the body), then gives up
        ("goaway", grpc.StatusCode.UNAVAILABLE),
        ("odd-status", grpc.StatusCode.UNKNOWN),
        ("http-503", grpc.StatusCode.UNAVAILABLE),  # gRPC's mapping of HTTP statuses
    ],
)
async def test_what_a_replica_does_only_in_races_still_ends_the_call(client: CurlGrpc, mode: str, code) -> None:
    server = await asyncio.get_running_loop().create_server(lambda: _H2Replica(mode), "127.0.0.1", 0)
    try:
        call = _call(client, f"127.0.0.1:{server.sockets[0].getsockname()[1]}", _req(mode), timeout_s=10)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await asyncio.wait_for(call.read(), 5)
        assert e.value.code() == code, e.value.details()
    finally:
        server.close()


async def test_a_connection_the_replica_closed_while_idle_is_not_the_next_call_s_error(client: CurlGrpc) -> None:
    """curl reuses a connection the replica closed while it was idle (it restarted, or went away without a
    GOAWAY), and the call fails on it before the replica could read it: it goes out again on a new connection,
    as a grpc.aio channel reconnects."""
    peers: list[_H2Replica] = []

    def peer() -> _H2Replica:
        peers.append(_H2Replica("answer-then-hang-up"))
        return peers[-1]

    server = await asyncio.get_running_loop().create_server(peer, "127.0.0.1", 0)
    try:
        target = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
        for i in range(4):
            frames = await asyncio.wait_for(_frames(_call(client, target, _req(f"hang-up-{i}"), timeout_s=10)), 5)
            assert [list(f.complete.output_ids) for f in frames] == [[5]]
            await asyncio.wait_for(peers[-1].closed.wait(), 5)  # it hung up before the next call
        assert len(peers) == 4  # one connection per call: none was sent twice on a live one
    finally:
        server.close()


async def test_a_call_sent_again_that_fails_again_is_unavailable(client: CurlGrpc) -> None:
    """The replica that closed the connection is gone for good: the call goes out once more, and fails."""
    peers: list[_H2Replica] = []

    def peer() -> _H2Replica:
        peers.append(_H2Replica("hang-up-at-once" if peers else "answer-then-hang-up"))
        return peers[-1]

    server = await asyncio.get_running_loop().create_server(peer, "127.0.0.1", 0)
    try:
        target = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
        await asyncio.wait_for(_frames(_call(client, target, _req("before"), timeout_s=10)), 5)
        await asyncio.wait_for(peers[0].closed.wait(), 5)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await asyncio.wait_for(_call(client, target, _req("after"), timeout_s=10).read(), 5)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value.details()
        assert len(peers) == 2  # sent again once, on one new connection
    finally:
        server.close()


async def test_a_call_sent_again_keeps_its_deadline(client: CurlGrpc) -> None:
    """A call that curl finds dead on its reused connection only after a while (TCP's own timeout on a peer
    that vanished: a failure no local peer can be made to give, so curl's report of it is made here) goes out
    again with what is left of its deadline, not a new one: its `grpc-timeout` is the rest, and when no answer
    comes it ends at the deadline it was given at the start (DEADLINE_EXCEEDED)."""
    timeout_s, waited_s = 3.0, 1.0
    peer = _H2Replica("answer-once")
    server = await asyncio.get_running_loop().create_server(lambda: peer, "127.0.0.1", 0)
    try:
        target = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
        await asyncio.wait_for(_frames(_call(client, target, _req("first"), timeout_s=10)), 5)
        call = _call(client, target, _req("second"), timeout_s=timeout_s)
        while len(peer.heard) < 2:
            await asyncio.sleep(0.01)
        await asyncio.sleep(waited_s)
        assert client._multi is not None and call._curl is not None
        client._complete(client._multi, call._curl, pycurl.E_RECV_ERROR, "Recv failure: Connection timed out")
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await asyncio.wait_for(call.read(), 10)
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, e.value.details()
        assert call._resent and len(peer.heard) == 3  # sent again once
        sent, again = (int(h[b"grpc-timeout"].rstrip(b"m")) for h in peer.heard[1:])
        assert sent == timeout_s * 1000
        assert again <= (timeout_s - waited_s) * 1000  # the rest of the deadline, not a new one
    finally:
        server.close()


async def test_a_call_found_dead_with_no_time_left_is_not_sent_again(client: CurlGrpc) -> None:
    """The same failure past the call's deadline: nothing is left to give a new attempt, so the call fails as the
    connection did (UNAVAILABLE) and the replica never hears it again."""
    peer = _H2Replica("answer-once")
    server = await asyncio.get_running_loop().create_server(lambda: peer, "127.0.0.1", 0)
    try:
        target = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
        await asyncio.wait_for(_frames(_call(client, target, _req("first"), timeout_s=10)), 5)
        call = _call(client, target, _req("second"), timeout_s=10)
        while len(peer.heard) < 2:
            await asyncio.sleep(0.01)
        assert client._multi is not None and call._curl is not None and call._deadline is not None
        call._deadline = asyncio.get_running_loop().time()  # spent (curl's own timer has not fired yet)
        client._complete(client._multi, call._curl, pycurl.E_RECV_ERROR, "Recv failure: Connection timed out")
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await asyncio.wait_for(call.read(), 5)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value.details()
        assert not call._resent and len(peer.heard) == 2
    finally:
        server.close()


async def test_a_connect_timeout_is_unavailable_not_the_deadline(
    client: CurlGrpc, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A replica whose SYNs go unanswered is unreachable (the router retries elsewhere and marks it down)."""
    monkeypatch.setattr(grpc_stream, "CONNECT_TIMEOUT_MS", 500)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    backlog = []
    for _ in range(3):  # fill the backlog: further SYNs are dropped
        s = socket.socket()
        s.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            s.connect(("127.0.0.1", port))
        backlog.append(s)
    try:
        call = _call(client, f"127.0.0.1:{port}", _req("black-hole"), timeout_s=30)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await asyncio.wait_for(call.read(), 10)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value.details()
    finally:
        for s in backlog:
            s.close()
        listener.close()


async def test_one_waiter_cancelled_leaves_the_others_waiting(client: CurlGrpc, grpc_server: str) -> None:
    call = _call(client, grpc_server, _req("slow"), timeout_s=10)
    reader = asyncio.ensure_future(call.read())
    metadata = asyncio.ensure_future(call.initial_metadata())
    await asyncio.sleep(0.05)
    reader.cancel()
    assert (await metadata).get("content-type") == "application/grpc"  # it waited on, not cancelled with it
    assert [list(f.chunk.token_ids) for f in await _frames(call)] == [[7]]


async def test_a_removed_worker_s_calls_end_cancelled(client: CurlGrpc, replica: Proc) -> None:
    """WorkerClients.drop: the registry let the worker go; its running calls end as a closed channel's did."""
    call = _call(client, _target(replica), _req("removed", stream=True, max_tokens=1500), timeout_s=60)
    assert await call.read() is not None
    client.fail_target(_target(replica), "the worker was removed")
    with pytest.raises(grpc.aio.AioRpcError) as e:
        while await call.read() is not None:
            pass
    assert e.value.code() == grpc.StatusCode.CANCELLED and not client._calls
    deadline = time.monotonic() + 10
    while await asyncio.to_thread(replica_busy, replica.url):  # its stream was reset: the replica aborted it
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)


async def test_connections_are_bounded_in_time_and_handles_in_number(
    client: CurlGrpc, replica: Proc, monkeypatch: pytest.MonkeyPatch
) -> None:
    call = _call(client, _target(replica), _req("keepalive", stream=True, max_tokens=200), timeout_s=60)
    assert await call.read() is not None
    sockets = []
    for fd in client._fds:
        with contextlib.suppress(OSError):
            sock = socket.socket(fileno=os.dup(fd))
            if sock.type == socket.SOCK_STREAM:
                sockets.append(sock)
            else:
                sock.close()
    assert len(sockets) == 1  # the replica's connection (curl also watches an eventfd of its own)
    with sockets[0] as sock:
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == grpc_stream.KEEPALIVE_IDLE_S
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == grpc_stream.TCP_USER_TIMEOUT_MS
    call.cancel()
    monkeypatch.setattr(grpc_stream, "MAX_IDLE_HANDLES", 4)
    calls = [_call(client, _target(replica), _req(f"burst-{i}", max_tokens=1)) for i in range(12)]
    await asyncio.gather(*(_frames(c) for c in calls))
    assert len(client._idle) == 4


async def test_an_answer_that_cannot_be_read_ends_its_call(
    client: CurlGrpc, replica: Proc, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whatever goes wrong reading an answer (here: the reader itself fails), the call ends, INTERNAL, and its
    handle goes back to the pool: a call that never ends would hold its request forever."""

    def broken(self: StreamCall, errno: int, message: str) -> None:
        raise RuntimeError("unreadable")

    monkeypatch.setattr(StreamCall, "_finished", broken)
    call = _call(client, _target(replica), _req("broken", max_tokens=1), timeout_s=10)
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await asyncio.wait_for(_frames(call), 10)  # the frame that came is read, then the error
    assert e.value.code() == grpc.StatusCode.INTERNAL and "unreadable" in e.value.details()
    assert not client._calls and client._idle


async def test_a_message_that_cannot_be_parsed_ends_its_call_as_internal(client: CurlGrpc, replica: Proc) -> None:
    """A frame the deserializer refuses is the call's INTERNAL error, for that read and every later one (as any
    other failure of the call), and the call leaves the client: the router maps it as it maps a replica's error."""

    def refuse(data: bytes) -> pb.GenerateResponse:
        raise DecodeError("not a GenerateResponse")

    call = client.unary_stream(_target(replica), GENERATE_METHOD, _req("undecodable").SerializeToString(), refuse)
    for _ in range(2):
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await asyncio.wait_for(call.read(), 10)
        assert e.value.code() == grpc.StatusCode.INTERNAL and "cannot be read" in (e.value.details() or "")
    assert call.done()
    await _until(lambda: not client._calls)


class _Lingering(pb_grpc.VllmEngineServicer):
    """Sends its whole answer, then holds its trailers until `end` is set; counts the RPCs cancelled."""

    def __init__(self) -> None:
        self.end = asyncio.Event()
        self.cancelled = 0

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> AsyncIterator:
        yield pb.GenerateResponse(complete=pb.GenerateComplete(output_ids=[5], finish_reason="length"))
        try:
            await self.end.wait()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise


@pytest.fixture
async def lingering() -> AsyncIterator[tuple[_Lingering, str]]:
    servicer = _Lingering()
    server = grpc.aio.server()
    pb_grpc.add_VllmEngineServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield servicer, f"127.0.0.1:{port}"
    servicer.end.set()
    await server.stop(None)


async def _until(condition: Callable[[], bool], timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)


async def test_a_released_call_ends_on_its_own_and_is_reset_only_past_its_grace(
    client: CurlGrpc, lingering: tuple[_Lingering, str]
) -> None:
    servicer, target = lingering
    call = _call(client, target, _req("answered"))
    assert (await call.read()).WhichOneof("response") == "complete"  # type: ignore[union-attr]
    call.release(30)
    await asyncio.sleep(0.3)
    assert not call.done()  # the trailers are held: it runs on
    servicer.end.set()
    await _until(call.done)
    assert await call.read() is None and servicer.cancelled == 0  # it ended OK, never reset

    servicer.end.clear()
    call = _call(client, target, _req("never-ends"))
    assert await call.read() is not None
    call.release(0.3)
    await _until(lambda: servicer.cancelled == 1)  # past its grace: reset, and the replica saw it cancelled
    assert call.done() and not client._calls


async def test_a_whole_answer_is_not_held_for_its_trailers(lingering: tuple[_Lingering, str]) -> None:
    """WorkerCall: once every choice's complete frame is in, its deltas end and `cancel` releases the call to
    end on its own (a reset would cost the replica an abort of a finished request)."""
    servicer, target = lingering
    [instance] = WorkerRegistry().create_worker("w", f"grpc://{target}", models=["m"], labels={}).instances
    clients = WorkerClients()
    call = WorkerCall(clients, instance, GenerationInput("whole", PROMPT, SamplingSpec(max_tokens=1)), timeout_s=60)
    try:
        await call.start()
        deltas = _token_ids(call)
        assert await asyncio.wait_for(deltas, 5) == [[5]]  # while the replica still holds its trailers
        call.cancel()
        assert not call._call.done() and call._call._reaper is not None  # released: bounded by its grace
        servicer.end.set()
        await _until(call._call.done)
        assert servicer.cancelled == 0 and call.error is None
    finally:
        await clients.close()


async def _token_ids(call: WorkerCall) -> list[list[int]]:
    return [d.token_ids async for d in call.deltas()]
