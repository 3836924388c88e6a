"""KV migration over real processes: two reference replicas and a router with kv_transfer on. A greedy request
interrupted by a sync abort on one replica continues on the other with exactly the tokens of an uninterrupted
run, and the destination computes only the prompt's last token; with the source killed first, or on another
node (CPU KV does not cross hosts), it recomputes and the tokens are still exact."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import grpc
import httpx
import pytest
from _procs import Proc, replica_busy, start_replica, start_router, wait_for
from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2_grpc

from psrl._proto import kv_migration_pb2, kv_migration_pb2_grpc, replica_control_pb2, replica_control_pb2_grpc
from psrl.gateway.processes import stop_processes

PROMPT = [21, 22, 23, 24, 25, 26, 27, 28, 29]


def _target(p: Proc) -> str:
    return p.url.removeprefix("grpc://")


def _stats(p: Proc) -> kv_migration_pb2.KvMigrationStats:
    with grpc.insecure_channel(_target(p)) as ch:
        stub = kv_migration_pb2_grpc.KvMigrationStub(ch)
        return stub.GetKvMigrationStats(kv_migration_pb2.GetKvMigrationStatsRequest(), timeout=5)


def _kv_router(log_dir, replicas: list[Proc], mode: str) -> Proc:
    """A router with the routing loop and KV transfer in `mode`, least-load over `replicas`."""
    args = ["--enable-routing-loop", "--policy", "least_load", "--kv-transfer-enable"]
    args.append(f"--kv-transfer-transfer-mode={mode}")
    return start_router(log_dir, [r.url for r in replicas], args=args)


def _flush(*procs: Proc) -> None:
    """Empty the replicas' prefix caches (the reference run left the same tokens there)."""
    for p in procs:
        with grpc.insecure_channel(_target(p)) as ch:
            vllm_engine_pb2_grpc.VllmEngineStub(ch).FlushCache(common_pb2.FlushCacheRequest(), timeout=10)


def _control(p: Proc) -> replica_control_pb2_grpc.ReplicaControlStub:
    return replica_control_pb2_grpc.ReplicaControlStub(grpc.insecure_channel(_target(p)))


def _generate(router: Proc, rid: str, n: int, psrl_id: int) -> httpx.Response:
    body = {
        "request_id": rid,
        "input_ids": PROMPT,
        "return_logprob": True,
        "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True, "detokenize": False},
    }
    headers = {"x-request-id": str(psrl_id), "x-prompt-id": str(psrl_id)}
    return httpx.post(f"{router.url}/generate", json=body, headers=headers, timeout=300)


def _interrupted(
    router: Proc, a: Proc, b: Proc, rid: str, psrl_id: int, n: int, after_abort=None
) -> tuple[httpx.Response, Proc]:
    """Start `rid`, let it decode a while, then sync-abort it where it runs (pinning its KV) with that replica
    out of rotation, so it loops back to the other one. Returns the response and the destination."""
    result: dict = {}
    t = threading.Thread(target=lambda: result.update(r=_generate(router, rid, n, psrl_id)), daemon=True)
    t.start()
    wait_for(lambda: replica_busy(a.url) + replica_busy(b.url) > 0, "a replica runs the request")
    source, dest = (a, b) if replica_busy(a.url) else (b, a)
    [source_id] = [w["id"] for w in httpx.get(f"{router.url}/workers").json()["workers"] if w["url"] == source.url]
    time.sleep(1.0)  # let it decode a while
    if after_abort is not None:
        httpx.post(f"{router.url}/routing_loop/pause?wait=true", json={})
    httpx.post(f"{router.url}/workers/pause", json=[{"base_worker_id": source_id}])
    control = _control(source)
    reply = control.PauseGeneration(replica_control_pb2.PauseGenerationRequest(), timeout=30)
    assert list(reply.aborted_request_ids) == [rid]
    if after_abort is not None:
        after_abort(source)
        httpx.post(f"{router.url}/routing_loop/resume", json={})
    t.join(300)
    assert "r" in result, "the interrupted request did not finish"
    if after_abort is None:
        control.ResumeGeneration(replica_control_pb2.ResumeGenerationRequest(), timeout=30)
        httpx.post(f"{router.url}/workers/resume", json=[{"base_worker_id": source_id}])
    return result["r"], dest


@pytest.fixture(scope="module")
def fleet(model_dir, log_dir) -> Iterator[tuple[Proc, Proc, Proc]]:
    a = start_replica(model_dir, log_dir)
    b = start_replica(model_dir, log_dir)
    router = _kv_router(log_dir, [a, b], "sync")
    yield router, a, b
    stop_processes([router.proc, a.proc, b.proc])


@pytest.fixture(scope="module")
def reference(fleet) -> dict:
    router, _, _ = fleet
    r = _generate(router, "ref", 2000, 1)
    assert r.status_code == 200, r.text
    return r.json()


def test_migrated_mid_decode_continues_exactly_without_prefill(fleet, reference) -> None:
    router, a, b = fleet
    _flush(a, b)  # everything moves (a prefix the destination holds already would not)
    before = {p.url: _stats(p) for p in (a, b)}
    r, dest = _interrupted(router, a, b, "mig-1", 2, 2000)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["output_ids"] == reference["output_ids"]
    got = [lp for lp, _ in out["meta_info"]["output_token_logprobs"]]
    assert got == pytest.approx([lp for lp, _ in reference["meta_info"]["output_token_logprobs"]], abs=1e-3)
    after = _stats(dest)
    moved = after.tokens_in - before[dest.url].tokens_in
    produced = moved + 1 - len(PROMPT)  # the loop-back's prompt: PROMPT + what the source produced
    assert after.transfers_in - before[dest.url].transfers_in == 1 and after.fallbacks == before[dest.url].fallbacks
    assert 0 < produced < 2000 and after.bytes_in > before[dest.url].bytes_in
    # zero prefill for the moved tokens: the destination computed one prompt position (the last), then decoded
    assert after.prompt_tokens_computed - before[dest.url].prompt_tokens_computed == 1
    metrics = httpx.get(f"{router.url}/metrics").text
    assert 'psrl_router_kv_transfers_total{outcome="moved"} 1.0' in metrics
    source = a if dest is b else b
    assert _stats(source).transfers_out - before[source.url].transfers_out == 1
    assert _stats(source).pinned_requests == 0  # released once the destination had the blocks


@pytest.mark.parametrize("mode", ["async", "pin_sync"])
def test_async_and_pin_sync_modes_move_the_kv_too(fleet, mode: str, log_dir) -> None:
    _, a, b = fleet
    router = _kv_router(log_dir, [a, b], mode)
    try:
        reference = _generate(router, f"ref-{mode}", 2000, 10).json()
        _flush(a, b)
        before = {p.url: _stats(p) for p in (a, b)}
        r, dest = _interrupted(router, a, b, f"mig-{mode}", 11, 2000)
        assert r.status_code == 200, r.text
        assert r.json()["output_ids"] == reference["output_ids"]
        after = _stats(dest)
        assert after.transfers_in - before[dest.url].transfers_in == 1
        assert after.prompt_tokens_computed - before[dest.url].prompt_tokens_computed == 1
        assert 'psrl_router_kv_transfers_total{outcome="moved"} 1.0' in httpx.get(f"{router.url}/metrics").text
    finally:
        stop_processes([router.proc])


def test_back_on_its_own_replica_the_request_adopts_its_pinned_kv(model_dir, log_dir) -> None:
    replica = start_replica(model_dir, log_dir)
    router = _kv_router(log_dir, [replica], "sync")
    try:
        reference = _generate(router, "ref-own", 2000, 20).json()
        before = _stats(replica)
        result: dict = {}
        t = threading.Thread(target=lambda: result.update(r=_generate(router, "own", 2000, 21)), daemon=True)
        t.start()
        wait_for(lambda: replica_busy(replica.url) > 0, "the replica runs the request")
        time.sleep(0.5)
        control = _control(replica)
        assert list(
            control.PauseGeneration(replica_control_pb2.PauseGenerationRequest(), timeout=30).aborted_request_ids
        )
        assert _stats(replica).pinned_requests == 1
        time.sleep(0.3)  # the loop-back is refused while the replica is paused; the pin stays
        control.ResumeGeneration(replica_control_pb2.ResumeGenerationRequest(), timeout=30)
        t.join(300)
        assert result["r"].status_code == 200 and result["r"].json()["output_ids"] == reference["output_ids"]
        after = _stats(replica)
        assert after.pinned_requests == 0 and after.transfers_in == before.transfers_in  # adopted, no copy
        # its first prompt, then only the last token of the loop-back's prompt
        assert after.prompt_tokens_computed - before.prompt_tokens_computed == len(PROMPT) + 1
        assert 'psrl_router_kv_transfers_total{outcome="moved"} 1.0' in httpx.get(f"{router.url}/metrics").text
    finally:
        stop_processes([router.proc, replica.proc])


def test_between_two_nodes_the_cpu_kv_is_recomputed_not_moved(model_dir, log_dir) -> None:
    a = start_replica(model_dir, log_dir)  # this machine's node id
    b = start_replica(model_dir, log_dir, args=["--node-id", "another-node"])
    router = _kv_router(log_dir, [a, b], "sync")
    try:
        reference = _generate(router, "ref-nodes", 2000, 30).json()
        _flush(a, b)  # so the destination's own prefix cache cannot serve the loop-back
        before = {p.url: _stats(p) for p in (a, b)}
        r, dest = _interrupted(router, a, b, "mig-nodes", 31, 2000)
        assert r.status_code == 200, r.text
        assert r.json()["output_ids"] == reference["output_ids"]
        source = a if dest is b else b
        after = _stats(dest)
        assert after.fallbacks - before[dest.url].fallbacks == 1 and after.transfers_in == before[dest.url].transfers_in
        assert _stats(source).transfers_out == before[source.url].transfers_out  # refused before any gather
        assert after.prompt_tokens_computed - before[dest.url].prompt_tokens_computed > len(PROMPT)  # prefilled
        log = dest.log_text()
        assert "mig-nodes" in log and "CPU KV does not cross hosts" in log and "'another-node'" in log
        assert 'psrl_router_kv_transfers_total{outcome="recomputed"} 1.0' in httpx.get(f"{router.url}/metrics").text
    finally:
        stop_processes([router.proc, a.proc, b.proc])


# Last: it kills one of the module's replicas.
def test_source_killed_before_the_transfer_recomputes_exactly(fleet, reference, model_dir, log_dir) -> None:
    router, a, b = fleet
    _flush(a, b)  # so the recompute cannot hit earlier tests' identical tokens in the prefix cache
    before = {p.url: _stats(p) for p in (a, b)}

    def kill(source: Proc) -> None:
        source.proc.kill()
        source.proc.wait(10)

    r, dest = _interrupted(router, a, b, "mig-2", 3, 2000, after_abort=kill)
    assert r.status_code == 200, r.text
    assert r.json()["output_ids"] == reference["output_ids"]
    after = _stats(dest)
    assert after.fallbacks - before[dest.url].fallbacks == 1
    assert after.transfers_in == before[dest.url].transfers_in
    computed = after.prompt_tokens_computed - before[dest.url].prompt_tokens_computed
    assert computed > len(PROMPT)  # the whole loop-back prompt was prefilled again
    assert 'psrl_router_kv_transfers_total{outcome="recomputed"} 1.0' in httpx.get(f"{router.url}/metrics").text
