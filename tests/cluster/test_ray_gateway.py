"""psrl.gateway.ray on a local Ray cluster the tests start (conftest.py): the RolloutGateway actor
comes up on the node's address with a PSManager and a replica of its own as child actors, a replica started as a
ReplicaActor by the driver registers, chat and a TITO session work through its URLs, the keys never appear on a
command line, a weight sync runs through the coordinator, a replica actor killed mid-request is a replica failure
its requests survive, and killing the gateway actor leaves no process behind."""

from __future__ import annotations

import re
import threading
from pathlib import Path

import httpx
import openai
import pytest
from _procs import cmdline, process_alive, replica_busy
from _wait import wait_for

from psrl.coordinator import BlockingRolloutCoordinator

ray = pytest.importorskip("ray")
from psrl.gateway.ray import ReplicaActor, ReplicaSpec, RolloutGateway  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.procs]

ADMIN = "ray-admin-key-0123"
TOKEN = "ray-replica-token-4567"
PSRL = {"x-request-id": "1", "x-prompt-id": "1"}


def _spec(tmp: Path) -> ReplicaSpec:
    return ReplicaSpec(args=["--torch-threads", "1"], env={"PSRL_CACHE_DIR": str(tmp / "cache")})


@pytest.fixture(scope="module")
def gateway(cluster):
    tmp = cluster
    config = {"admin_api_key": ADMIN, "log_dir": str(tmp / "logs")}
    actor = RolloutGateway.remote(config, replicas=[_spec(tmp)], psmanager=[], replica_token=TOKEN)
    urls = ray.get(actor.urls.remote(), timeout=300)
    # A replica the driver starts itself, registered with the gateway's router by its URL.
    extra = ReplicaActor.remote(urls["router"], _spec(tmp), router_api_key=ADMIN, replica_token=TOKEN)
    ray.get(extra.address.remote(), timeout=300)
    ray.get(actor.wait_for_workers.remote(2), timeout=300)
    yield actor, urls, extra
    ray.kill(actor)
    ray.kill(extra)


def _admin() -> dict[str, str]:
    return {"Authorization": f"Bearer {ADMIN}"}


def _workers(url: str) -> list[dict]:
    return httpx.get(f"{url}/workers", headers=_admin()).json()["workers"]


def test_the_gateway_binds_the_nodes_address_and_reports_health(gateway) -> None:
    actor, urls, extra = gateway
    ip = ray.util.get_node_ip_address()
    assert urls["router"].startswith(f"http://{ip}:") and urls["session"].startswith(f"http://{ip}:")
    health = ray.get(actor.health.remote())
    assert health["healthy"] and health["router"] and health["session"] and health["processes_alive"]
    assert health["workers"] == health["healthy_workers"] == 2
    replica_urls = {ray.get(r.address.remote()) for r in ray.get(actor.replicas.remote())}
    replica_urls.add(ray.get(extra.address.remote()))
    assert {w["url"] for w in _workers(urls["router"])} == replica_urls
    assert all(u.startswith(f"grpc://{ip}:") for u in replica_urls)


def test_keys_reach_the_processes_in_their_environment_not_their_command_line(gateway) -> None:
    actor, _, extra = gateway
    pids = [*ray.get(actor.child_pids.remote()), ray.get(extra.pid.remote())]
    pids += [ray.get(r.pid.remote()) for r in ray.get(actor.replicas.remote())]
    assert len(pids) == 4  # router, SessionRouter, two replicas
    for pid in pids:
        assert ADMIN not in cmdline(pid) and TOKEN not in cmdline(pid)
    environ = Path(f"/proc/{pids[0]}/environ").read_bytes().split(b"\0")
    assert f"PSRL_ROUTER_API_KEY={ADMIN}".encode() in environ and f"PSRL_REPLICA_TOKEN={TOKEN}".encode() in environ
    assert "--psrl-ps-manager-addr" in cmdline(pids[0])  # the router routes with the PSManager child actor


def test_chat_and_a_tito_session_through_its_urls(gateway) -> None:
    _, urls, _ = gateway
    client = openai.OpenAI(base_url=f"{urls['router']}/v1", api_key="none", max_retries=0)
    model = client.models.list().data[0].id
    reply = client.chat.completions.create(model=model, max_tokens=6, messages=[{"role": "user", "content": "Hi"}])
    assert 0 < reply.usage.completion_tokens <= 6
    session = urls["session"]
    sid = httpx.post(f"{session}/sessions").json()["session_id"]
    agent = openai.OpenAI(base_url=f"{session}/sessions/{sid}/v1", api_key="none", max_retries=0)
    messages = [{"role": "user", "content": "Hello"}]
    first = agent.chat.completions.create(model=model, max_tokens=5, messages=messages)
    messages += [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "?"}]
    agent.chat.completions.create(model=model, max_tokens=5, messages=messages)
    snap = httpx.get(f"{session}/sessions/{sid}").json()
    [trajectory] = snap["trajectories"]
    assert len(trajectory["records"]) == 2  # the second turn continued the first: one trajectory
    assert httpx.delete(f"{session}/sessions/{sid}").status_code == 204


def test_a_weight_sync_runs_through_the_coordinator(gateway) -> None:
    _, urls, _ = gateway
    with BlockingRolloutCoordinator(urls["router"], admin_api_key=ADMIN, replica_token=TOKEN) as coordinator:
        assert len(coordinator.replicas()) == 2
        coordinator.sync_weights(7, seed=7)
    assert all(i["weight_version"] == 7 for w in _workers(urls["router"]) for i in w["instances"])
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
    r = httpx.post(f"{urls['router']}/generate", json=body, headers=PSRL, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["meta_info"]["output_token_versions"] == [7] * 4


def test_a_replica_actor_killed_mid_request_is_a_replica_failure(gateway, cluster) -> None:
    actor, urls, _ = gateway
    router = urls["router"]
    victim = ReplicaActor.remote(router, _spec(cluster), router_api_key=ADMIN, replica_token=TOKEN)
    victim_url, victim_pid = ray.get(victim.address.remote(), timeout=300), ray.get(victim.pid.remote())
    ray.get(actor.wait_for_workers.remote(3), timeout=120)
    [worker_id] = [w["worker_id"] for w in _workers(router) if w["url"] == victim_url]
    sp = {"max_new_tokens": 1500, "ignore_eos": True, "temperature": 0}
    body = {"input_ids": [5, 6, 7], "sampling_params": sp}
    on_victim = {"x-base-worker-id": worker_id, "x-target-dp-rank": "0", "x-is-sticky": "true"}
    result: dict[str, httpx.Response] = {}

    def run() -> None:
        headers = {**PSRL, "x-request-id": "2", **on_victim}
        result["r"] = httpx.post(f"{router}/generate", json=body, headers=headers, timeout=300)

    thread = threading.Thread(target=run)
    thread.start()
    wait_for(lambda: replica_busy(victim_url, token=TOKEN) == 1, "the request running on the victim replica")
    ray.kill(victim)
    thread.join(300)
    wait_for(lambda: not process_alive(victim_pid), "the killed actor's replica process gone")
    r = result["r"]
    assert r.status_code == 200, r.text  # it looped back to a live replica and ran to its end there
    out = r.json()
    assert len(out["output_ids"]) == 1500 and out["meta_info"]["finish_reason"]["type"] == "length"
    wait_for(
        lambda: all(w["url"] != victim_url or not w["healthy"] for w in _workers(router)),
        "the router no longer counting on the dead replica",
    )
    assert ray.get(actor.health.remote())["router"]


def test_killing_the_gateway_actor_leaves_no_process_behind(cluster) -> None:
    tmp = cluster
    actor = RolloutGateway.remote(
        {"log_dir": str(tmp / "logs-kill")}, replicas=[_spec(tmp)], psmanager=[], replica_token=TOKEN
    )
    ray.get(actor.urls.remote(), timeout=300)
    children = ray.get(actor.replicas.remote())
    pids = ray.get(actor.child_pids.remote()) + [ray.get(c.pid.remote()) for c in children]
    pids.append(ray.get(ray.get(actor.psmanager.remote()).pid.remote()))
    assert len(pids) == 4 and all(process_alive(p) for p in pids)  # router, SessionRouter, the replica, the PSManager
    ray.kill(actor)
    for pid in pids:
        wait_for(lambda pid=pid: not process_alive(pid), f"process {pid} gone")


@pytest.mark.parametrize(
    ("config", "psmanager", "says"),
    [
        ({"bogus_key": 1}, None, "unknown keys ['bogus_key']"),
        ({"embedded_dp_sizes": [0]}, None, "embedded_dp_sizes must all be >= 1"),
        ({"psrl_ps_manager_addr": "127.0.0.1:1"}, [], "psmanager and psrl_ps_manager_addr: give one"),
    ],
)
def test_a_bad_config_is_an_actor_error_that_names_it(cluster, config, psmanager, says) -> None:
    actor = RolloutGateway.remote(config, psmanager=psmanager)
    with pytest.raises(ray.exceptions.ActorDiedError, match=re.escape(says)):
        ray.get(actor.urls.remote(), timeout=60)
