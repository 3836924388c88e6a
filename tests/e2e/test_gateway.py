"""`python -m psrl.gateway` on its embedded default: chat (streaming and not) with the openai client, /generate
equal to the replica's own answer, and no orphans after SIGTERM or even SIGKILL."""

from __future__ import annotations

import os
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import httpx
import openai
import pytest
from _procs import REPO, cmdline, descendants, free_port, process_alive, start_replica
from smg_grpc_proto.generated import vllm_engine_pb2, vllm_engine_pb2_grpc

from psrl.gateway import GatewayConfig, RolloutGateway
from psrl.gateway.processes import AnnouncedProcess, stop_processes


def _start_gateway(tmp_path: Path) -> tuple[subprocess.Popen, str, str]:
    env = {**os.environ, "PSRL_CACHE_DIR": str(tmp_path / "cache"), "PYTHONUNBUFFERED": "1"}
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "psrl.gateway", "--router-port-start", str(port), "--log-dir", str(tmp_path / "logs")],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
        cwd=REPO,
    )
    assert proc.stdout is not None
    out = ""
    deadline = time.monotonic() + 180
    try:
        while "Ctrl-C stops" not in out:
            assert proc.poll() is None, out
            assert time.monotonic() < deadline, out
            if select.select([proc.stdout], [], [], 0.5)[0]:
                out += os.read(proc.stdout.fileno(), 65536).decode(errors="replace")
        match = re.search(r"router\s+(http://127\.0\.0\.1:\d+)", out)
        sessions = re.search(r"sessions\s+(http://127\.0\.0\.1:\d+)", out)
        assert match and sessions, out
    except BaseException:
        proc.send_signal(signal.SIGTERM)  # never leave a gateway (and its children) behind
        proc.wait(30)
        raise
    return proc, match.group(1), sessions.group(1)


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    proc, url, session_url = _start_gateway(tmp_path_factory.mktemp("gateway"))
    yield proc, url, session_url
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


def test_embedded_default_has_two_replicas_three_instances(gateway) -> None:
    _, url, _ = gateway
    workers = httpx.get(f"{url}/workers").json()["workers"]
    assert sorted(w["dp_size"] for w in workers) == [1, 2]
    assert {w["worker_id"] for w in workers} == {"replica-0", "replica-1"}


def test_chat_with_the_openai_client(gateway) -> None:
    _, url, _ = gateway
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    model = client.models.list().data[0].id
    reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hello!"}], max_tokens=8)
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert 0 < reply.usage.completion_tokens <= 8
    chunks = list(
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=8, stream=True
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_generate_equals_the_replica_answer(gateway) -> None:
    _, url, _ = gateway
    prompt = [11, 22, 33, 44, 55]
    body = {
        "input_ids": prompt,
        "return_logprob": True,
        "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True, "detokenize": False},
    }
    for _ in range(3):  # lands on several instances (round robin); each must match its replica
        r = httpx.post(f"{url}/generate", json=body, timeout=60)
        assert r.status_code == 200, r.text
        out = r.json()
        worker = next(
            w for w in httpx.get(f"{url}/workers").json()["workers"] if w["worker_id"] == r.headers["x-base-worker-id"]
        )
        with grpc.insecure_channel(worker["url"].removeprefix("grpc://")) as channel:
            sp = vllm_engine_pb2.SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0)
            req = vllm_engine_pb2.GenerateRequest(
                request_id=f"direct-{time.monotonic_ns()}",
                tokenized=vllm_engine_pb2.TokenizedInput(input_ids=prompt),
                sampling_params=sp,
                data_parallel_rank=int(r.headers["x-target-dp-rank"]),
            )
            direct = list(vllm_engine_pb2_grpc.VllmEngineStub(channel).Generate(req))[-1].complete
        assert out["output_ids"] == list(direct.output_ids)
        lps = [lp for lp, _ in out["meta_info"]["output_token_logprobs"]]
        assert lps == list(direct.output_logprobs.token_logprobs)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_stopping_the_gateway_leaves_no_orphans(tmp_path, sig) -> None:
    proc, _, _ = _start_gateway(tmp_path)
    children = descendants(proc.pid)
    assert len(children) >= 4  # router, two replicas, SessionRouter
    proc.send_signal(sig)
    proc.wait(30)
    deadline = time.monotonic() + 30
    while any(process_alive(p) for p in children):
        assert time.monotonic() < deadline, [p for p in children if process_alive(p)]
        time.sleep(0.2)


def test_session_router_serves_a_black_box_agent(gateway) -> None:
    _, url, session_url = gateway
    model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
    assert httpx.get(f"{session_url}/control/sessions").json()["sessions"] == []
    sid = httpx.post(f"{session_url}/sessions").json()["session_id"]
    client = openai.OpenAI(base_url=f"{session_url}/sessions/{sid}/v1", api_key="none", max_retries=0)
    reply = client.chat.completions.create(model=model, max_tokens=6, messages=[{"role": "user", "content": "Hi"}])
    assert 0 < reply.usage.completion_tokens <= 6
    snap = httpx.get(f"{session_url}/sessions/{sid}").json()
    assert len(snap["trajectories"][0]["records"]) == 1
    assert httpx.delete(f"{session_url}/sessions/{sid}").status_code == 204


def test_a_gateway_on_every_address_and_one_that_waits_for_registrations(model_dir, tmp_path) -> None:
    """--host 0.0.0.0 (a container): the processes listen on every address and call each other on 127.0.0.1, its
    replica registered there. --replicas 0: no replicas of its own; one that registers itself is routed to."""
    wide = GatewayConfig(
        host="0.0.0.0", embedded_model=str(model_dir), embedded_dp_sizes=[1], log_dir=str(tmp_path / "wide")
    )
    with RolloutGateway(wide) as gateway:
        assert gateway.router_url.startswith("http://127.0.0.1:")
        (worker,) = httpx.get(f"{gateway.router_url}/workers").json()["workers"]
        assert worker["url"].startswith("grpc://127.0.0.1:")
        assert gateway.running() and "--host 0.0.0.0" in cmdline(gateway.child_pids()[0])
        body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
        assert httpx.post(f"{gateway.router_url}/generate", json=body, timeout=60).status_code == 200
    empty = GatewayConfig(embedded_dp_sizes=[], enable_session_router=False, log_dir=str(tmp_path / "empty"))
    with RolloutGateway(empty) as gateway:
        assert httpx.get(f"{gateway.router_url}/workers").json()["workers"] == []
        replica = start_replica(model_dir, tmp_path, args=["--router", gateway.router_url])
        try:
            gateway.wait_for_registered([replica.url])
            r = httpx.post(f"{gateway.router_url}/generate", json=body, timeout=60)
            assert r.status_code == 200, r.text
        finally:
            replica.kill()
    assert not gateway.running()


def test_an_announced_process_gives_its_address_or_says_why_not() -> None:
    """AnnouncedProcess (what the Ray actors start replicas with): the word after the marker, or a clear error."""
    zen = AnnouncedProcess("this", [], "Beautiful")  # `python -m this` prints "Beautiful is better than ugly."
    assert zen.wait_ready(30) == "is"
    gone = AnnouncedProcess("json.tool", ["/no/such/file"], "READY")  # exits 2 at once, never ready
    with pytest.raises(RuntimeError, match=r"json\.tool exited with code 2 before it was ready"):
        gone.wait_ready(30)
    silent = AnnouncedProcess("http.server", ["0", "--bind", "127.0.0.1"], "READY")  # serves, never says READY
    try:
        with pytest.raises(TimeoutError, match=r"http\.server printed no READY line within 1\.0s"):
            silent.wait_ready(1.0)
    finally:
        stop_processes([silent.proc])
    for p in (zen.proc, gone.proc):
        p.wait(10)
