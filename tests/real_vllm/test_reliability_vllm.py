"""Issue 12's failure behaviour in front of real vLLM: a client that leaves aborts its generation on a stock and
on our vLLM replica, and PSRL requests on a vLLM replica killed mid-decode continue on another one exactly."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from _http_raw import connect
from _procs import Proc, descendants, process_alive, replica_busy, start_router, wait_for
from _vllm import start_vllm_replica

from psrl.gateway.processes import stop_processes
from psrl.router.pipeline.context import GenerationInput, SamplingSpec
from psrl.router.pipeline.execute import TRAILERS_GRACE_S, WorkerCall
from psrl.router.registry import InstanceState, WorkerRegistry
from psrl.router.worker_client import WorkerClients

LONG = 1500  # tokens: seconds of decoding on vLLM's CPU build, far longer than the client stays


@pytest.fixture(scope="module", params=["stock", "ours"])
def replica(request: pytest.FixtureRequest) -> Proc:
    if request.param == "stock":
        return request.getfixturevalue("stock_vllm")
    return request.getfixturevalue("vllm_pair")[0]


@pytest.fixture(scope="module")
def router(replica: Proc, log_dir: Path) -> Iterator[Proc]:
    proc = start_router(log_dir, [replica.url])
    yield proc
    stop_processes([proc.proc])


def _answered(router: Proc, route: str) -> float:
    """Requests on `route` the router answered 200 (its own metric)."""
    sample = f'psrl_router_requests_total{{route="{route}",status="200"}} '
    text = httpx.get(f"{router.url}/metrics", timeout=10).text
    return sum(float(line[len(sample) :]) for line in text.splitlines() if line.startswith(sample))


def _inflight(router: Proc) -> int:
    return sum(
        i["inflight_requests"] for w in httpx.get(f"{router.url}/workers").json()["workers"] for i in w["instances"]
    )


@pytest.mark.parametrize(
    ("route", "body"),
    [
        ("/generate", {"input_ids": [11, 12, 13], "sampling_params": {"max_new_tokens": LONG, "ignore_eos": True}}),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "max_tokens": LONG, "ignore_eos": True, "stream": True},
        ),
    ],
    ids=["generate", "chat-streamed"],
)
def test_a_client_that_leaves_aborts_its_generation_on_vllm(
    router: Proc, replica: Proc, route: str, body: dict
) -> None:
    wait_for(
        lambda: replica_busy(replica.url) == 0 and _inflight(router) == 0,
        "the replica and the router idle",
        timeout_s=60,
    )
    before = _answered(router, route)
    data = json.dumps(body).encode()
    head = f"POST {route} HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    sock = connect(router.url)
    try:
        sock.sendall(head.encode() + data)
        wait_for(lambda: replica_busy(replica.url) > 0, "the request generating on the replica", timeout_s=60)
        if body.get("stream"):  # the stream has begun (its 200 counted) before the client leaves
            received = b""
            while b"\r\n\r\n" not in received:
                received += sock.recv(4096)
    finally:
        sock.close()
    wait_for(
        lambda: replica_busy(replica.url) == 0 and _inflight(router) == 0,
        "the replica and the router idle",
        timeout_s=60,
    )
    # A non-streamed handler that ran on to its answer would have counted a 200: it was cancelled instead.
    assert _answered(router, route) == before + (1 if body.get("stream") else 0)


def _psrl(i: int, worker_id: str) -> dict[str, str]:
    return {
        "x-request-id": str(i),
        "x-prompt-id": str(i),
        "x-base-worker-id": worker_id,
        "x-target-dp-rank": "0",
        "x-is-sticky": "true",  # every request starts on the replica the test kills
    }


def test_psrl_requests_on_a_vllm_replica_killed_mid_decode_continue_exactly(
    vllm_model_dir: Path, vllm_pair: list[Proc], log_dir: Path
) -> None:
    victim = start_vllm_replica(vllm_model_dir, log_dir)
    router = start_router(log_dir, [victim.url, vllm_pair[1].url])
    n = 400
    body = {
        "input_ids": [21, 22, 23, 24],
        "sampling_params": {"max_new_tokens": n, "ignore_eos": True, "temperature": 0},
        "return_logprob": True,
    }
    try:
        expected = httpx.post(f"{router.url}/generate", json=body, timeout=300).json()["output_ids"]
        workers = httpx.get(f"{router.url}/workers").json()["workers"]
        [wid] = [w["worker_id"] for w in workers if w["url"] == victim.url]
        [vllm_pair_id] = [w["worker_id"] for w in workers if w["url"] == vllm_pair[1].url]
        results: dict[int, httpx.Response] = {}
        streamed: list[str] = []
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": n, "ignore_eos": True}
        chat |= {"temperature": 0, "stream": True, "stream_options": {"include_usage": True}}

        def one(i: int) -> None:
            results[i] = httpx.post(f"{router.url}/generate", json=body, headers=_psrl(i, wid), timeout=300)

        def chat_once() -> None:  # non-streamed: its headers name the instance that finished it
            plain = {k: v for k, v in chat.items() if k not in ("stream", "stream_options")}
            url = f"{router.url}/v1/chat/completions"
            results[98] = httpx.post(url, json=plain, headers=_psrl(98, wid), timeout=300)

        def stream() -> None:
            url = f"{router.url}/v1/chat/completions"
            with httpx.stream("POST", url, json=chat, headers=_psrl(99, wid), timeout=300) as r:
                streamed.extend(line[6:] for line in r.iter_lines() if line.startswith("data: "))

        threads = [threading.Thread(target=one, args=(i,)) for i in range(2)]
        threads += [threading.Thread(target=stream), threading.Thread(target=chat_once)]
        for t in threads:
            t.start()
        wait_for(lambda: replica_busy(victim.url) == 4, "four requests running on the victim replica", timeout_s=60)
        engine_core = descendants(victim.proc.pid)  # the EngineCore process vLLM forked
        assert engine_core
        os.kill(victim.proc.pid, signal.SIGKILL)
        for t in threads:
            t.join(300)
        for i in range(2):
            assert results[i].status_code == 200, results[i].text
            out = results[i].json()
            assert out["output_ids"] == expected and len(out["meta_info"]["output_token_logprobs"]) == n
        for r in (results[0], results[1], results[98]):
            assert r.status_code == 200, r.text
            assert r.headers["x-base-worker-id"] == vllm_pair_id  # the instance that finished it, not the victim
        assert results[98].json()["usage"]["completion_tokens"] == n
        assert streamed[-1] == "[DONE]" and not any('"error"' in e for e in streamed)
        assert json.loads(streamed[-2])["usage"]["completion_tokens"] == n
        log = router.log_text()
        assert "continues elsewhere" in log and "starts again" in log
        wait_for(lambda: _inflight(router) == 0, "no request in flight in the router", timeout_s=30)
        # its engine process goes with it, not left holding the KV cache (a GPU, on one)
        wait_for(lambda: not any(map(process_alive, engine_core)), "the killed replica's EngineCore gone", timeout_s=60)
    finally:
        stop_processes([router.proc, victim.proc])


@pytest.mark.parametrize(
    ("method", "kind"),
    [("/vllm.grpc.engine.VllmEngine/Generate", "stream"), ("/vllm.grpc.engine.VllmEngine/GetLoads", "unary")],
)
def test_bytes_that_are_not_the_request_are_invalid_argument_on_a_vllm_replica(
    vllm_pair: list[Proc], method: str, kind: str
) -> None:
    """The stock servicer's methods too: the replica's server parses each request inside its handler."""
    with grpc.insecure_channel(vllm_pair[0].url.removeprefix("grpc://")) as channel:
        bad = b"\x0a\xff\xff\xff\xff\x07"  # a length-delimited field claiming far more bytes than follow
        call = channel.unary_stream(method) if kind == "stream" else channel.unary_unary(method)
        with pytest.raises(grpc.RpcError) as e:
            result = call(bad, timeout=30)
            if kind == "stream":
                list(result)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()


async def _whole_answer(clients: WorkerClients, instance: InstanceState, rid: str, stream: bool) -> WorkerCall:
    gen = GenerationInput(rid, [11, 12, 13], SamplingSpec(max_tokens=4, ignore_eos=True), stream)
    call = WorkerCall(clients, instance, gen, timeout_s=60)
    await call.start()
    assert [i async for d in call.deltas() for i in d.token_ids] and call.result.finish_reason == "length"
    return call


async def test_a_released_generate_ends_on_its_own(replica: Proc) -> None:
    """The router answers on the last complete frame and releases the Generate, without the reset a cancel
    sends: the replica must then end the RPC itself, OK, well within the grace after which a released call is
    reset (a servicer that never sent its trailers would be reset, and abort a finished request)."""
    [instance] = WorkerRegistry().create_worker("v", replica.url, models=["m"], labels={}).instances
    clients = WorkerClients()
    try:
        for stream in (False, True):
            call = await _whole_answer(clients, instance, f"released-{stream}-{os.getpid()}", stream)
            call.cancel()  # released
            deadline = time.monotonic() + TRAILERS_GRACE_S / 2
            while not call._call.done():
                assert time.monotonic() < deadline, "the replica did not end a whole answer's RPC"
                await asyncio.sleep(0.01)
            assert call._call._error is None  # its own OK status: neither reset nor failed
    finally:
        await clients.close()


class _Relay:
    """A TCP relay to a replica that can drop its connections while they are idle, as a load balancer that
    reaps idle connections, or a killed replica's kernel, closes them: without an HTTP/2 GOAWAY."""

    def __init__(self, target: str) -> None:
        self.host, port = target.rsplit(":", 1)
        self.port = int(port)
        self.accepted = 0
        self._writers: list[asyncio.StreamWriter] = []

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        return f"grpc://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        up_reader, up_writer = await asyncio.open_connection(self.host, self.port)
        self._writers += [writer, up_writer]

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(OSError):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            dst.close()

        await asyncio.gather(pump(reader, up_writer), pump(up_reader, writer))

    def drop(self) -> None:
        for writer in self._writers:
            writer.close()
        self._writers.clear()

    def close(self) -> None:
        self.drop()
        self._server.close()


async def test_a_connection_closed_while_idle_is_not_the_next_generate_s_error(replica: Proc) -> None:
    """The router's connection to a vLLM replica closes while idle, with no GOAWAY (here a relay drops it): the
    next Generate goes out on a new connection and is answered, not failed on the dead one."""
    relay = _Relay(replica.url.removeprefix("grpc://"))
    url = await relay.start()
    [instance] = WorkerRegistry().create_worker("v", url, models=["m"], labels={}).instances
    clients = WorkerClients()
    try:
        for i in range(3):
            call = await _whole_answer(clients, instance, f"dropped-{i}-{os.getpid()}", stream=False)
            while not call._call.done():  # the trailers too: the connection is idle
                await asyncio.sleep(0.01)
            relay.drop()
            await asyncio.sleep(0.1)  # the close reaches the router's socket
        assert relay.accepted == 3  # each call after a drop on a new connection
    finally:
        await clients.close()
        relay.close()
