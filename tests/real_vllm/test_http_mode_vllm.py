"""The router in HTTP mode in front of a stock `vllm serve` (vLLM's OpenAI server, CPU build): what users run
when their replicas speak only OpenAI HTTP. Plain and streamed answers pass through with the instance headers,
vLLM's own verdict on a request it refuses comes back as it gave it, `--request-timeout-s` cuts a generation
that runs past it (a 504) while the router goes on serving, and the router's health check (GET /health on its
own HTTP client) reads vLLM's server as healthy and an address with nobody there as not."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from _procs import Proc, free_port, popen, start_router, stop_processes
from _vllm import REPO, STARTUP_TIMEOUT_S, engine_args_of, vllm_env
from _wait import wait_for

from psrl.router.http_backend import HttpWorkers
from psrl.router.registry import WorkerRegistry


@pytest.fixture(scope="module")
def vllm_serve(vllm_model_dir: Path, log_dir: Path) -> Iterator[Proc]:
    port = free_port()
    log = log_dir / f"vllm-serve-{port}.log"
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *engine_args_of(vllm_model_dir)]
    cmd += ["--host", "127.0.0.1", "--port", str(port)]
    with open(log, "wb") as out:
        proc = popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=vllm_env(), start_new_session=True, cwd=REPO)
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"vllm serve exited with {proc.returncode}:\n{log.read_text(errors='replace')}")
        try:
            return httpx.get(f"{url}/v1/models", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_for(up, "vllm serve answers /v1/models", timeout_s=STARTUP_TIMEOUT_S, poll_s=0.5)
        yield Proc(proc, url, log)
    finally:
        stop_processes([proc])


def test_plain_and_streamed_answers_pass_through(vllm_serve: Proc, log_dir: Path) -> None:
    router = start_router(log_dir, [vllm_serve.url], args=["--connection-mode", "http"])
    try:
        client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="x", max_retries=0)
        model = client.models.list().data[0].id
        raw = client.chat.completions.with_raw_response.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0
        )
        assert raw.headers["x-base-worker-id"] == "0"
        completion = raw.parse()
        assert completion.usage is not None and completion.usage.completion_tokens == 4
        assert completion.choices[0].finish_reason == "length"
        chunks = list(
            client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=3, stream=True
            )
        )
        assert chunks[-1].choices[0].finish_reason == "length"
        text = client.completions.create(model=model, prompt="hi", max_tokens=2)
        assert text.object == "text_completion" and text.usage is not None and text.usage.completion_tokens == 2
    finally:
        stop_processes([router.proc])


@pytest.mark.parametrize(
    "body",
    [
        {"messages": [], "max_tokens": 2},
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": -1},
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4000},  # past --max-model-len 2048
    ],
)
def test_a_request_vllm_refuses_gets_vllms_own_answer(vllm_serve: Proc, log_dir: Path, body: dict) -> None:
    """The router forwards the body unchecked: the client sees the status and error vLLM itself gives."""
    router = start_router(log_dir, [vllm_serve.url], args=["--connection-mode", "http"])
    try:
        direct = httpx.post(f"{vllm_serve.url}/v1/chat/completions", json=body, timeout=60)
        assert 400 <= direct.status_code < 500, direct.text
        routed = httpx.post(f"{router.url}/v1/chat/completions", json=body, timeout=60)
        assert (routed.status_code, routed.json()) == (direct.status_code, direct.json())
        assert routed.headers["x-base-worker-id"] == "0"
    finally:
        stop_processes([router.proc])


def test_a_generation_past_the_request_timeout_is_a_504(vllm_serve: Proc, log_dir: Path) -> None:
    router = start_router(log_dir, [vllm_serve.url], args=["--connection-mode", "http", "--request-timeout-s", "0.3"])
    try:
        long = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1500, "ignore_eos": True}
        r = httpx.post(f"{router.url}/v1/chat/completions", json=long, timeout=60)
        assert r.status_code == 504, r.text
        assert r.json()["error"]["code"] == "worker_timeout"
        short = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        assert httpx.post(f"{router.url}/v1/chat/completions", json=short, timeout=60).status_code == 200
    finally:
        stop_processes([router.proc])


async def test_the_health_check_reads_vllm_serve(vllm_serve: Proc) -> None:
    workers = HttpWorkers(connect_timeout_s=5.0, request_timeout_s=None)
    registry = WorkerRegistry()
    try:
        served = registry.create_worker("v", vllm_serve.url, models=["m"], labels={}, connection_mode="http")
        assert await workers.is_healthy(served, 30.0)
        gone = registry.create_worker("g", f"http://127.0.0.1:{free_port()}", models=["m"], labels={})
        assert not await workers.is_healthy(gone, 5.0)
    finally:
        await workers.close()
