"""A vLLM replica as a ReplicaActor (the CPU build here): it registers with a RolloutGateway that starts no
replicas of its own, serves chat and /generate through the gateway's router, and goes with the gateway, the
engine process vLLM forked included."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from _procs import descendants, process_alive
from _vllm import HAS_VLLM, STARTUP_TIMEOUT_S, engine_args_of, vllm_env
from _wait import wait_for

from psrl.worker.model_folder import build_weighted_model_folder

ray = pytest.importorskip("ray")
from psrl.gateway.ray import ReplicaSpec, RolloutGateway  # noqa: E402

pytestmark = [
    pytest.mark.ray,
    pytest.mark.procs,
    pytest.mark.skipif(not HAS_VLLM, reason="needs vllm and smg-grpc-servicer (make install-vllm)"),
]


@pytest.fixture(scope="module")
def gateway(cluster) -> Iterator[tuple[Any, dict[str, str], Any]]:
    model = build_weighted_model_folder(cluster / "vllm-model")
    env = {k: v for k, v in vllm_env().items() if os.environ.get(k) != v}  # vLLM's settings, not our environment
    spec = ReplicaSpec(engine="vllm", model=str(model), engine_args=engine_args_of(model)[2:], env=env)
    config = {"embedded_dp_sizes": [], "log_dir": str(cluster / "logs-vllm"), "startup_timeout_s": STARTUP_TIMEOUT_S}
    actor = RolloutGateway.remote(config, replicas=[spec])
    urls = ray.get(actor.urls.remote(), timeout=STARTUP_TIMEOUT_S + 60)
    [replica] = ray.get(actor.replicas.remote())
    yield actor, urls, replica
    ray.kill(actor)


def test_a_vllm_replica_actor_serves_through_the_gateway(gateway) -> None:
    _, urls, replica = gateway
    (worker,) = httpx.get(f"{urls['router']}/workers").json()["workers"]
    assert worker["url"] == ray.get(replica.address.remote())
    assert worker["labels"]["node_id"] == ray.get_runtime_context().get_node_id()  # Ray's node id, for KV
    client = openai.OpenAI(base_url=f"{urls['router']}/v1", api_key="none", max_retries=0)
    model = client.models.list().data[0].id
    reply = client.chat.completions.create(model=model, max_tokens=5, messages=[{"role": "user", "content": "Hi"}])
    assert reply.usage.completion_tokens == 5 or reply.choices[0].finish_reason == "stop"
    body = {"input_ids": [11, 12, 13], "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}}
    headers = {"x-request-id": "1", "x-prompt-id": "1"}
    out = httpx.post(f"{urls['router']}/generate", json=body, headers=headers, timeout=120).json()
    assert len(out["output_ids"]) == 6 and out["meta_info"]["finish_reason"]["type"] == "length"


def test_the_vllm_process_goes_with_the_gateway(gateway) -> None:
    actor, _, replica = gateway
    worker = ray.get(replica.pid.remote())
    engine_core = descendants(worker)  # the EngineCore process vLLM forked
    assert engine_core, "vLLM runs its engine in a process of its own"
    pids = [*ray.get(actor.child_pids.remote()), worker, *engine_core]
    ray.kill(actor)
    for pid in pids:
        wait_for(lambda pid=pid: not process_alive(pid), f"process {pid} gone", timeout_s=60)
