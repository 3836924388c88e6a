"""The router over real processes: PSRL headers and selection, coordinator endpoints, admin auth, metrics,
health and circuit breaking with a replica killed and restarted, and HTTP-mode proxying."""

from __future__ import annotations

import subprocess
import sys

import httpx
import openai
import pytest
from _procs import free_port, start_replica, start_router, wait_for

from psrl.gateway.processes import stop_processes

GEN = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2, "temperature": 0, "detokenize": False}}
ADMIN = {"Authorization": "Bearer adm"}


@pytest.fixture(scope="module")
def fleet(model_dir, log_dir):
    """Two replicas (dp 1 and dp 2) behind a router with an admin key and group stickiness."""
    a = start_replica(model_dir, log_dir)
    b = start_replica(model_dir, log_dir, dp_size=2)
    router = start_router(
        log_dir, [], args=["--admin-api-key", "adm", "--enable-group-sticky", "--policy", "least_load"]
    )
    ids = []
    for url, wid in ((a.url, "a"), (b.url, "b")):
        r = httpx.post(
            f"{router.url}/workers",
            json={"url": url, "id": wid, "labels": {"max_model_len": "16384"}},
            headers=ADMIN,
            timeout=30,
        )
        assert r.status_code == 200, r.text
        ids.append(r.json()["worker_id"])
    assert ids == ["a", "b"]
    yield router, a, b
    stop_processes([router.proc, a.proc, b.proc])


def _gen(router, headers=None, body=GEN) -> httpx.Response:
    return httpx.post(f"{router.url}/generate", json=body, headers=headers or {}, timeout=60)


def test_admin_key_guards_worker_endpoints_only(fleet) -> None:
    router, _, _ = fleet
    for method, path in (
        ("GET", "/workers"),
        ("GET", "/workers/stats"),
        ("POST", "/workers/pause"),
        ("POST", "/workers/update_weight_version"),
        ("DELETE", "/workers/a"),
    ):
        r = httpx.request(method, f"{router.url}{path}", json=[], timeout=10)
        assert r.status_code == 401, (path, r.text)
        assert r.json()["error"]["code"] == "unauthorized"
    assert httpx.get(f"{router.url}/workers", headers=ADMIN).status_code == 200
    assert _gen(router).status_code == 200  # the data plane has its own (unset) key


def test_bad_routing_headers_are_400(fleet) -> None:
    router, _, _ = fleet
    for name, value in (
        ("x-request-id", "abc"),
        ("x-version-tag", "-5"),
        ("x-is-sticky", "maybe"),
        ("x-target-dp-rank", "-1"),
        ("x-prompt-id", "1.5"),
    ):
        r = _gen(router, {name: value})
        assert r.status_code == 400, (name, r.text)
        assert name in r.json()["error"]["message"]


def test_weight_versions_floor_and_echo(fleet) -> None:
    router, _, _ = fleet
    body = [
        {"worker_id": "a", "dp_rank": 0, "weight_version": 3},
        {"worker_id": "b", "dp_rank": 0, "weight_version": 2},
        {"worker_id": "b", "dp_rank": 1, "weight_version": 2},
    ]
    r = httpx.post(f"{router.url}/workers/update_weight_version", json=body, headers=ADMIN)
    assert r.json()["updated"] == 3 and r.json()["rejected"] == 0
    r = httpx.post(
        f"{router.url}/workers/update_weight_version",
        headers=ADMIN,
        json=[{"worker_id": "b", "dp_rank": 0, "weight_version": 9}],
    )
    assert r.json()["rejected"] == 1 and "partial replica" in r.json()["results"][0]["reason"]

    psrl = {"x-request-id": "11", "x-prompt-id": "11"}
    # unversioned PSRL requests go to the newest version and are pinned to it
    r = _gen(router, psrl)
    assert (r.headers["x-base-worker-id"], r.headers["x-version-tag"]) == ("a", "3")
    assert r.json()["meta_info"]["weight_version"] == 3
    # a versioned request takes the lowest acceptable version and echoes its own floor
    r = _gen(router, {**psrl, "x-version-tag": "2"})
    assert r.headers["x-base-worker-id"] == "b" and r.headers["x-version-tag"] == "2"
    r = _gen(router, {**psrl, "x-version-tag": "4"})
    assert r.status_code == 503 and "version >= 4" in r.json()["error"]["message"]
    # sticky hint pins even against the version preference
    r = _gen(router, {**psrl, "x-is-sticky": "1", "x-base-worker-id": "b", "x-target-dp-rank": "1"})
    assert (r.headers["x-base-worker-id"], r.headers["x-target-dp-rank"]) == ("b", "1")
    httpx.post(
        f"{router.url}/workers/update_weight_version", headers=ADMIN, json=[{**e, "weight_version": 0} for e in body]
    )


def test_pause_resume_and_stats(fleet) -> None:
    router, _, _ = fleet
    r = httpx.post(
        f"{router.url}/workers/pause",
        headers=ADMIN,
        json=[{"base_worker_id": "a"}, {"base_worker_id": "b", "dp_rank": 0}],
    )
    assert r.json()["action"] == "paused" and r.json()["updated"] == 2
    for _ in range(4):
        r = _gen(router)
        assert (r.headers["x-base-worker-id"], r.headers["x-target-dp-rank"]) == ("b", "1")
    workers = {
        (w["worker_id"], i["dp_rank"]): i
        for w in httpx.get(f"{router.url}/workers", headers=ADMIN).json()["workers"]
        for i in w["instances"]
    }
    assert workers[("a", 0)]["paused"] and workers[("a", 0)]["healthy"]
    r = httpx.post(
        f"{router.url}/workers/resume",
        headers=ADMIN,
        json=[{"base_worker_id": "a"}, {"base_worker_id": "b", "dp_rank": 0}],
    )
    assert r.json()["action"] == "resumed"
    ts = "2030-01-01T00:00:00Z"
    r = httpx.post(
        f"{router.url}/workers/update_stats",
        headers=ADMIN,
        json=[
            {"worker_id": "a", "dp_rank": 0, "timestamp": ts, "scheduler_stats": {"num_running_reqs": 50}},
            {"worker_id": "b", "timestamp": ts, "scheduler_stats": {}},
        ],
    )
    assert (r.json()["updated"], r.json()["rejected"]) == (1, 1)
    stats = httpx.get(f"{router.url}/workers/stats", headers=ADMIN).json()
    assert stats["total_running_requests"] >= 50
    # least_load now avoids the loaded instance
    assert all(_gen(router).headers["x-base-worker-id"] == "b" for _ in range(3))


def test_group_sticky_keeps_a_prompt_group_together(fleet) -> None:
    router, _, _ = fleet
    import threading

    seen = []
    long = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 60, "ignore_eos": True}}

    def one(rid: int) -> None:
        r = _gen(router, {"x-request-id": str(rid), "x-prompt-id": "500"}, body=long)
        seen.append((r.headers["x-base-worker-id"], r.headers["x-target-dp-rank"]))

    threads = [threading.Thread(target=one, args=(1000 + i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(seen)) == 1, seen


def test_metrics(fleet) -> None:
    router, _, _ = fleet
    _gen(router)
    text = httpx.get(f"{router.url}/metrics").text
    assert 'psrl_router_requests_total{route="/generate",status="200"}' in text
    assert "psrl_router_request_duration_seconds_bucket" in text
    assert 'psrl_router_instance_load{dp_rank="1",worker_id="b"}' in text
    assert 'psrl_router_selections_total{outcome="chosen",stage="policy"}' in text


def test_streaming_records_time_to_first_token(fleet) -> None:
    router, _, _ = fleet
    client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="x", max_retries=0)
    model = client.models.list().data[0].id
    list(
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=3, stream=True
        )
    )
    assert (
        'psrl_router_time_to_first_token_seconds_count{route="/v1/chat/completions"}'
        in httpx.get(f"{router.url}/metrics").text
    )


def test_health_and_recovery_with_a_replica_killed_and_restarted(model_dir, log_dir) -> None:
    port = free_port()
    a = start_replica(model_dir, log_dir, args=["--port", str(port)])
    b = start_replica(model_dir, log_dir)
    router = start_router(log_dir, [a.url, b.url], args=["--health-success-threshold", "2"])
    try:
        assert len({_gen(router).headers["x-base-worker-id"] for _ in range(4)}) == 2  # both have a connection
        a.proc.kill()  # SIGKILL, as the OOM killer ends it: its connections close without a GOAWAY
        a.proc.wait()
        wait_for(
            lambda: sorted(w["healthy"] for w in httpx.get(f"{router.url}/workers").json()["workers"]) == [False, True],
            "the router marks the stopped worker unhealthy",
        )
        assert all(_gen(router).status_code == 200 for _ in range(4))  # all served by b
        a = start_replica(model_dir, log_dir, args=["--port", str(port)])
        wait_for(
            lambda: all(w["healthy"] for w in httpx.get(f"{router.url}/workers").json()["workers"]),
            "both workers are healthy again",
        )
        answers = [_gen(router) for _ in range(4)]
        assert [r.status_code for r in answers] == [200] * 4  # none failed on the connection the killed one left
        assert len({r.headers["x-base-worker-id"] for r in answers}) == 2  # back in rotation
    finally:
        stop_processes([a.proc, b.proc, router.proc])


def test_circuit_breaker_opens_on_failing_requests(model_dir, log_dir) -> None:
    a = start_replica(model_dir, log_dir)
    # Health checks far apart, so only the breaker can take the dead instance out.
    router = start_router(
        log_dir,
        [a.url],
        args=["--health-interval-s", "60", "--breaker-failure-threshold", "1", "--breaker-open-duration-s", "60"],
    )
    try:
        stop_processes([a.proc])
        r = _gen(router)
        assert r.status_code == 503
        inst = httpx.get(f"{router.url}/workers").json()["workers"][0]["instances"][0]
        assert inst["circuit_breaker"] == "open"
    finally:
        stop_processes([a.proc, router.proc])


def test_http_mode_proxies_plain_openai_servers(model_dir, log_dir) -> None:
    """Another router stands in for a stock `vllm serve`: OpenAI HTTP only, no gRPC."""
    a = start_replica(model_dir, log_dir)
    backend_1 = start_router(log_dir, [a.url])
    backend_2 = start_router(log_dir, [a.url])
    front = start_router(log_dir, [backend_1.url, backend_2.url], args=["--connection-mode", "http"])
    try:
        workers = httpx.get(f"{front.url}/workers").json()["workers"]
        assert [w["connection_mode"] for w in workers] == ["http", "http"]
        client = openai.OpenAI(base_url=f"{front.url}/v1", api_key="x", max_retries=0)
        model = client.models.list().data[0].id
        served = set()
        for _ in range(4):
            raw = client.chat.completions.with_raw_response.create(
                model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=3
            )
            served.add(raw.headers["x-base-worker-id"])
            assert raw.parse().usage.completion_tokens <= 3
        assert len(served) == 2
        chunks = list(
            client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=3, stream=True
            )
        )
        assert chunks[-1].choices[0].finish_reason in ("stop", "length")
        r = httpx.post(f"{front.url}/generate", json=GEN, timeout=30)
        assert r.status_code == 400 and "gRPC" in r.json()["error"]["message"]
        r = httpx.post(f"{front.url}/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["object"] == "text_completion"
        stop_processes([backend_1.proc])
        assert all(
            httpx.post(
                f"{front.url}/v1/chat/completions",
                json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 2},
                timeout=30,
            ).status_code
            in (200, 502, 503)
            for _ in range(3)
        )
        wait_for(
            lambda: sorted(w["healthy"] for w in httpx.get(f"{front.url}/workers").json()["workers"]) == [False, True],
            "the front router marks the dead worker unhealthy",
        )
        assert (
            httpx.post(
                f"{front.url}/v1/chat/completions",
                json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 2},
                timeout=30,
            ).status_code
            == 200
        )
    finally:
        stop_processes([a.proc, backend_1.proc, backend_2.proc, front.proc])


def test_a_replica_the_router_refuses_exits_with_status_1(model_dir, log_dir) -> None:
    """A replica its router cannot see is of no use: a refused registration (here a wrong admin key) ends it."""
    router = start_router(log_dir, [], args=["--admin-api-key", "adm"])
    log = log_dir / "refused-replica.log"
    try:
        with open(log, "wb") as out:
            args = ["--model", str(model_dir), "--port", "0", "--router", router.url, "--router-api-key", "wrong"]
            proc = subprocess.Popen(
                [sys.executable, "-m", "psrl.worker", *args],
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        assert proc.wait(timeout=120) == 1, log.read_text(errors="replace")
        assert "router refused registration: 401" in log.read_text(errors="replace")
    finally:
        stop_processes([router.proc])
