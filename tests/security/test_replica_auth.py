"""The replicas' shared gRPC token over real processes: a tokened reference replica refuses every call that does
not carry it (health and reflection excepted), a router with it serves chat and /generate, one without it is
told why at registration, KV migration between tokened replicas still moves the KV, and the gateway passes
the token on. Also /metrics, open by default and behind the admin key with --metrics-require-key."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from _procs import REPO, Proc, start_replica, start_router, wait_for
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2, vllm_engine_pb2_grpc

from psrl._proto import kv_migration_pb2, kv_migration_pb2_grpc, replica_control_pb2, replica_control_pb2_grpc
from psrl.coordinator import RolloutCoordinator, SyncReport
from psrl.credentials import TOKEN_ENV, load_replica_token
from psrl.gateway.launcher import GatewayConfig, RolloutGateway
from psrl.gateway.processes import stop_processes
from psrl.replica_auth import token_metadata
from psrl.router.config import RouterConfig

TOKEN = "tok-0123456789abcdef"
PROMPT = [21, 22, 23, 24, 25, 26, 27, 28, 29]


def _token_file(folder: Path, token: str, name: str = "token") -> str:
    path = folder / name
    path.write_text(token + "\n")
    path.chmod(0o600)
    return str(path)


@pytest.fixture(scope="module")
def token_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    return _token_file(tmp_path_factory.mktemp("secrets"), TOKEN)


def _target(p: Proc) -> str:
    return p.url.removeprefix("grpc://")


def _md(token: str | None = TOKEN) -> tuple[tuple[str, str], ...]:
    return token_metadata(token)


@pytest.fixture(scope="module")
def fleet(model_dir: Path, log_dir: Path, token_file: str) -> Iterator[tuple[Proc, Proc, Proc]]:
    """Two tokened replicas and a router with the token, the routing loop and KV transfer on."""
    procs: list[Proc] = []
    try:
        a = start_replica(model_dir, log_dir, args=["--replica-token-file", token_file])
        procs.append(a)
        b = start_replica(model_dir, log_dir, args=["--replica-token-file", token_file])
        procs.append(b)
        args = ["--replica-token-file", token_file, "--enable-routing-loop", "--policy", "least_load"]
        args += ["--kv-transfer-enable", "--kv-transfer-transfer-mode=sync"]
        router = start_router(log_dir, [a.url, b.url], args=args)
        procs.append(router)
        yield router, a, b
    finally:
        stop_processes([p.proc for p in procs])


# ---- the replica refuses what does not carry the token ---------------------------------------------------


def _calls(channel: grpc.Channel) -> dict:
    """One call of each service a replica guards (each a function of the metadata it sends)."""
    engine = vllm_engine_pb2_grpc.VllmEngineStub(channel)
    control = replica_control_pb2_grpc.ReplicaControlStub(channel)
    kv = kv_migration_pb2_grpc.KvMigrationStub(channel)
    generate = vllm_engine_pb2.GenerateRequest(
        request_id="auth-gen",
        tokenized=vllm_engine_pb2.TokenizedInput(input_ids=PROMPT),
        sampling_params=vllm_engine_pb2.SamplingParams(temperature=0.0, max_tokens=2),
    )
    return {
        "VllmEngine.HealthCheck": lambda md: engine.HealthCheck(vllm_engine_pb2.HealthCheckRequest(), metadata=md),
        "VllmEngine.Generate": lambda md: list(engine.Generate(generate, metadata=md, timeout=30)),
        "VllmEngine.GetTokenizer": lambda md: list(engine.GetTokenizer(common_pb2.GetTokenizerRequest(), metadata=md)),
        "ReplicaControl.GetSyncState": lambda md: control.GetSyncState(
            replica_control_pb2.GetSyncStateRequest(), metadata=md
        ),
        "KvMigration.TransferKv": lambda md: kv.TransferKv(
            kv_migration_pb2.TransferKvRequest(request_id="x", token_ids=PROMPT, allow_prefix_cache=True), metadata=md
        ),
        "KvMigration.ReleaseKv": lambda md: kv.ReleaseKv(
            kv_migration_pb2.ReleaseKvRequest(transfer_id="x"), metadata=md
        ),
        "KvMigration.PinKv": lambda md: kv.PinKv(kv_migration_pb2.PinKvRequest(request_id="x"), metadata=md),
    }


def test_a_tokened_replica_refuses_calls_without_the_token_or_with_a_wrong_one(fleet) -> None:
    _, replica, _ = fleet
    with grpc.insecure_channel(_target(replica)) as channel:
        for name, call in _calls(channel).items():
            for md, says in ((_md(None), "no 'authorization' metadata sent"), (_md("wrong"), "wrong token")):
                with pytest.raises(grpc.RpcError) as refused:
                    call(md)
                assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED, name
                assert says in refused.value.details() and TOKEN_ENV in refused.value.details(), name
            if name != "KvMigration.PinKv":  # with the token it gets as far as the engine (which pins no id "x")
                call(_md())
        # Health and reflection stay open (Kubernetes probes send no metadata; reflection shows public schemas).
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        listed = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5
        )
        names = {s.name for s in next(iter(listed)).list_services_response.service}
        assert "psrl.kv.KvMigration" in names


def test_the_prefix_cache_cannot_be_probed_without_the_token(fleet) -> None:
    """TransferKv with allow_prefix_cache tells whether a prompt is cached; with a token only holders can ask."""
    router, a, b = fleet
    prompt = [31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50]  # > one 16-token block
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 1, "temperature": 0, "detokenize": False}}
    assert httpx.post(f"{router.url}/generate", json=body, timeout=60).status_code == 200
    probe = kv_migration_pb2.TransferKvRequest(request_id="probe", token_ids=prompt, allow_prefix_cache=True)
    held = []
    for replica in (a, b):
        with grpc.insecure_channel(_target(replica)) as channel:
            stub = kv_migration_pb2_grpc.KvMigrationStub(channel)
            with pytest.raises(grpc.RpcError) as refused:
                stub.TransferKv(probe, timeout=10)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            reply = stub.TransferKv(probe, metadata=_md(), timeout=10)
            held.append(reply.num_tokens)
            if reply.transfer_id:
                stub.ReleaseKv(kv_migration_pb2.ReleaseKvRequest(transfer_id=reply.transfer_id), metadata=_md())
    assert max(held) == 16  # the one whole block of it, on the replica that served it


# ---- a router with the token serves through it -----------------------------------------------------------


def test_a_router_with_the_token_serves_chat_and_generate(fleet, model_dir: Path) -> None:
    router, _, _ = fleet
    chat = {"model": model_dir.name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    r = httpx.post(f"{router.url}/v1/chat/completions", json=chat, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1
    with httpx.stream("POST", f"{router.url}/v1/chat/completions", json={**chat, "stream": True}, timeout=60) as s:
        assert s.status_code == 200
        events = [line for line in s.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and len(events) >= 3
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 3, "temperature": 0, "detokenize": False}}
    r = httpx.post(f"{router.url}/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert len(r.json()["output_ids"]) == 3


def test_the_coordinator_syncs_tokened_replicas(fleet) -> None:
    router, _, _ = fleet

    async def sync(token: str | None) -> SyncReport:
        async with RolloutCoordinator(router.url, replica_token=token, rpc_timeout_s=30) as coordinator:
            return await coordinator.sync_weights(1, seed=0)

    report = asyncio.run(sync(TOKEN))  # without the token its control calls would be refused (and it would fail)
    assert report.version == 1 and len(report.replicas) == 2
    resumed = httpx.post(f"{router.url}/generate", json={"input_ids": PROMPT}, timeout=60)
    assert resumed.status_code == 200, resumed.text


# ---- a router without it is told why ---------------------------------------------------------------------


@pytest.mark.parametrize("router_token", [None, "wrong-token"])
def test_a_router_without_the_token_cannot_register_the_replica_and_says_why(
    fleet, log_dir: Path, tmp_path: Path, router_token: str | None
) -> None:
    _, replica, _ = fleet
    args = ["--replica-token-file", _token_file(tmp_path, router_token)] if router_token else []
    router = start_router(log_dir, [], args=args)
    try:
        r = httpx.post(f"{router.url}/workers", json={"url": replica.url}, timeout=30)
        assert r.status_code == 503, r.text
        assert r.headers["x-smg-error-code"] == "worker_unauthenticated"
        message = r.json()["error"]["message"]
        assert "refused the router's call as unauthenticated" in message and TOKEN_ENV in message
        assert ("wrong token" if router_token else "no 'authorization' metadata sent") in message
        assert httpx.get(f"{router.url}/workers").json()["workers"] == []
    finally:
        stop_processes([router.proc])


def test_a_tokened_replica_registering_with_a_router_without_the_token_exits_saying_why(
    model_dir: Path, log_dir: Path, token_file: str
) -> None:
    router = start_router(log_dir, [])
    try:
        cmd = [sys.executable, "-m", "psrl.worker", "--model", str(model_dir), "--torch-threads", "1"]
        cmd += ["--replica-token-file", token_file, "--router", router.url]
        # At once, not after the registration's 300 s of retries.
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=REPO)
        assert done.returncode == 1
        assert "refused for want of the replicas' token" in done.stderr
    finally:
        stop_processes([router.proc])


def test_tokens_and_the_registration_key_from_the_environment(
    model_dir: Path, log_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """$PSRL_REPLICA_TOKEN on both sides, and a replica registering itself with the router's admin key from
    $PSRL_ROUTER_API_KEY (nothing secret on a command line)."""
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    monkeypatch.setenv("PSRL_ROUTER_API_KEY", "admin-key")
    router = start_router(log_dir, [], args=["--admin-api-key", "admin-key"])
    replica = start_replica(model_dir, log_dir, args=["--router", router.url])
    try:
        headers = {"Authorization": "Bearer admin-key"}
        wait_for(
            lambda: len(httpx.get(f"{router.url}/workers", headers=headers).json()["workers"]) == 1,
            "the replica registered itself with the router",
        )
        body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2, "temperature": 0, "detokenize": False}}
        assert httpx.post(f"{router.url}/generate", json=body, timeout=60).status_code == 200
        with grpc.insecure_channel(_target(replica)) as channel, pytest.raises(grpc.RpcError) as refused:
            vllm_engine_pb2_grpc.VllmEngineStub(channel).GetLoads(vllm_engine_pb2.GetLoadsRequest(), timeout=5)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        stop_processes([replica.proc, router.proc])


# ---- KV migration between tokened replicas ---------------------------------------------------------------


def _stats(p: Proc) -> kv_migration_pb2.KvMigrationStats:
    with grpc.insecure_channel(_target(p)) as ch:
        stub = kv_migration_pb2_grpc.KvMigrationStub(ch)
        return stub.GetKvMigrationStats(kv_migration_pb2.GetKvMigrationStatsRequest(), metadata=_md(), timeout=5)


def _loads(p: Proc) -> list[vllm_engine_pb2.SchedulerLoad]:
    with grpc.insecure_channel(_target(p)) as ch:
        stub = vllm_engine_pb2_grpc.VllmEngineStub(ch)
        return list(stub.GetLoads(vllm_engine_pb2.GetLoadsRequest(), metadata=_md(), timeout=5).loads)


def _busy(p: Proc) -> int:
    return sum(e.num_running_reqs + e.num_waiting_reqs for e in _loads(p))


def _kv_tokens(p: Proc) -> int:
    return sum(e.num_used_tokens for e in _loads(p))


def _generate(router: Proc, rid: str, n: int, psrl_id: int) -> httpx.Response:
    body = {
        "request_id": rid,
        "input_ids": PROMPT,
        "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True, "detokenize": False},
    }
    headers = {"x-request-id": str(psrl_id), "x-prompt-id": str(psrl_id)}
    return httpx.post(f"{router.url}/generate", json=body, headers=headers, timeout=300)


def test_kv_migration_between_tokened_replicas_moves_the_kv(fleet) -> None:
    router, a, b = fleet
    reference = _generate(router, "ref", 2000, 1)
    assert reference.status_code == 200, reference.text
    for p in (a, b):  # so everything moves (a prefix the destination holds already would not)
        with grpc.insecure_channel(_target(p)) as ch:
            vllm_engine_pb2_grpc.VllmEngineStub(ch).FlushCache(common_pb2.FlushCacheRequest(), metadata=_md())
    before = {p.url: _stats(p) for p in (a, b)}
    result: dict = {}
    t = threading.Thread(target=lambda: result.update(r=_generate(router, "mig", 2000, 2)), daemon=True)
    t.start()
    wait_for(lambda: _busy(a) + _busy(b) > 0, "the request running on a replica")
    source, dest = (a, b) if _busy(a) else (b, a)
    [source_id] = [w["id"] for w in httpx.get(f"{router.url}/workers").json()["workers"] if w["url"] == source.url]
    started = _kv_tokens(source)
    wait_for(lambda: _kv_tokens(source) > started, "the request decoded into a new KV block")
    httpx.post(f"{router.url}/workers/pause", json=[{"base_worker_id": source_id}])
    with grpc.insecure_channel(_target(source)) as ch:
        control = replica_control_pb2_grpc.ReplicaControlStub(ch)
        paused = control.PauseGeneration(replica_control_pb2.PauseGenerationRequest(), metadata=_md(), timeout=30)
        assert list(paused.aborted_request_ids) == ["mig"]
        t.join(300)
        control.ResumeGeneration(replica_control_pb2.ResumeGenerationRequest(), metadata=_md(), timeout=30)
    httpx.post(f"{router.url}/workers/resume", json=[{"base_worker_id": source_id}])
    assert result["r"].status_code == 200, result["r"].text
    assert result["r"].json()["output_ids"] == reference.json()["output_ids"]
    after = _stats(dest)
    # The destination's pull from its source carried the token: the KV moved, nothing was recomputed.
    assert after.transfers_in - before[dest.url].transfers_in == 1
    assert after.fallbacks == before[dest.url].fallbacks
    assert after.prompt_tokens_computed - before[dest.url].prompt_tokens_computed == 1


# ---- the gateway passes the token on ---------------------------------------------------------------------


def test_the_gateway_gives_its_router_and_replicas_the_token(model_dir: Path, token_file: str, tmp_path: Path) -> None:
    config = GatewayConfig(
        router_port_start=18100,
        enable_session_router=False,
        admin_api_key="gw-admin",
        replica_token_file=token_file,
        embedded_model=str(model_dir),
        embedded_dp_sizes=[1],
        log_dir=str(tmp_path),
        startup_timeout_s=120,
    )
    with RolloutGateway(config) as gateway:
        headers = {"Authorization": "Bearer gw-admin"}
        (worker,) = httpx.get(f"{gateway.router_url}/workers", headers=headers).json()["workers"]
        body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2, "temperature": 0, "detokenize": False}}
        assert httpx.post(f"{gateway.router_url}/generate", json=body, timeout=60).status_code == 200
        with grpc.insecure_channel(worker["url"].removeprefix("grpc://")) as channel, pytest.raises(grpc.RpcError) as e:
            vllm_engine_pb2_grpc.VllmEngineStub(channel).GetLoads(vllm_engine_pb2.GetLoadsRequest(), timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # The admin key is in every child's environment (the router's, the key the replica registered with),
        # never on a command line.
        for pid in gateway.child_pids():
            assert b"gw-admin" not in Path(f"/proc/{pid}/cmdline").read_bytes()
            assert b"PSRL_ROUTER_API_KEY=gw-admin" in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")


# ---- /metrics --------------------------------------------------------------------------------------------


def test_metrics_are_open_by_default_and_take_the_admin_key_when_required(log_dir: Path) -> None:
    keys = ["--api-key", "data-key", "--admin-api-key", "admin-key"]
    routers = [start_router(log_dir, [], args=keys), start_router(log_dir, [], args=[*keys, "--metrics-require-key"])]
    try:
        open_router, keyed = routers
        assert httpx.get(f"{open_router.url}/metrics").status_code == 200
        assert httpx.get(f"{keyed.url}/metrics").status_code == 401
        data = httpx.get(f"{keyed.url}/metrics", headers={"Authorization": "Bearer data-key"})
        assert data.status_code == 401 and data.json()["error"]["code"] == "unauthorized"
        admin = httpx.get(f"{keyed.url}/metrics", headers={"Authorization": "Bearer admin-key"})
        assert admin.status_code == 200 and "psrl_router" in admin.text
        assert httpx.get(f"{keyed.url}/health").status_code == 200  # liveness stays open
    finally:
        stop_processes([r.proc for r in routers])


def test_metrics_require_key_needs_an_admin_key() -> None:
    with pytest.raises(ValueError, match="admin_api_key"):
        RouterConfig(metrics_require_key=True).validate()
    RouterConfig(metrics_require_key=True, admin_api_key="k").validate()


# ---- where the token comes from --------------------------------------------------------------------------


def test_the_token_comes_from_the_file_else_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    assert load_replica_token(None) is None
    monkeypatch.setenv(TOKEN_ENV, "")
    assert load_replica_token(None) is None  # empty: no token
    monkeypatch.setenv(TOKEN_ENV, "from-env")
    assert load_replica_token(None) == "from-env"
    assert load_replica_token(_token_file(tmp_path, "  from-file ")) == "from-file"  # the file wins
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="is empty"):
        load_replica_token(str(empty))
    with pytest.raises(ValueError, match="cannot read"):
        load_replica_token(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="printable ASCII"):
        load_replica_token(_token_file(tmp_path, "two words", "spaced"))
