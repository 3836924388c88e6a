"""`python -m psrl.gateway --replica-engine vllm --model DIR --replicas N`: the gateway starts vLLM replicas of
ours, they register with their vLLM facts, and an openai client is served through the router and the
SessionRouter."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
from _procs import REPO, free_port
from _vllm import STARTUP_TIMEOUT_S, engine_args_of, vllm_env

from psrl.gateway.processes import stop_processes


def test_gateway_starts_vllm_replicas(vllm_model_dir: Path, tmp_path: Path) -> None:
    port = free_port()
    cmd = [sys.executable, "-m", "psrl.gateway", "--router-port-start", str(port), "--session-port-start"]
    cmd += [str(free_port()), "--log-dir", str(tmp_path), "--replica-engine", "vllm", "--model", str(vllm_model_dir)]
    cmd += ["--replicas", "1", "--replica-engine-args", *engine_args_of(vllm_model_dir)[2:]]
    with open(tmp_path / "gateway.log", "wb") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=vllm_env(), cwd=REPO, start_new_session=True
        )
    try:
        banner = ""
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while "psrl-gateway is up" not in banner:
            assert proc.poll() is None, (tmp_path / "gateway.log").read_text()
            assert time.monotonic() < deadline, "the gateway did not come up"
            time.sleep(0.5)
            banner = (tmp_path / "gateway.log").read_text()
        assert "vLLM replicas started by the gateway" in banner
        router = f"http://127.0.0.1:{port}"
        (worker,) = httpx.get(f"{router}/workers").json()["workers"]
        labels = worker["labels"]
        assert labels["kv_block_size"] == "128"  # vLLM's CPU block size, not the reference engine's 16
        assert int(labels["max_model_len"]) > 100_000  # the KV cache's token capacity, not the context length
        assert worker["models"][0]["id"] == vllm_model_dir.name
        client = openai.OpenAI(base_url=f"{router}/v1", api_key="none", max_retries=0, timeout=120)
        reply = client.chat.completions.create(
            model=vllm_model_dir.name, messages=[{"role": "user", "content": "hi"}], max_tokens=8, logprobs=True
        )
        assert reply.usage is not None and 1 <= reply.usage.completion_tokens <= 8
        content = reply.choices[0].logprobs.content if reply.choices[0].logprobs else None
        assert content and len(content) == reply.usage.completion_tokens
        session_url = banner.split("sessions  ", 1)[1].split()[0]
        sid = httpx.post(f"{session_url}/sessions").json()["session_id"]
        agent = openai.OpenAI(base_url=f"{session_url}/sessions/{sid}/v1", api_key="none", max_retries=0, timeout=120)
        agent.chat.completions.create(
            model=vllm_model_dir.name, messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
        (trajectory,) = httpx.get(f"{session_url}/sessions/{sid}").json()["trajectories"]
        assert len(trajectory["records"]) == 1 and trajectory["records"][0]["output_logprobs"]
    finally:
        stop_processes([proc])
    assert proc.returncode is not None
