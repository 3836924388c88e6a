"""Routing loop and partial rollout over real processes: the pause barrier, requests waiting for their
version, and a greedy request interrupted mid-decode on one replica and finished on another with exactly the
tokens of an uninterrupted run (also each choice of an n > 1 request, streamed)."""

from __future__ import annotations

import json
import threading
import time

import grpc
import httpx
import pytest
from _procs import replica_busy, start_replica, start_router, wait_for
from smg_grpc_proto.generated import vllm_engine_pb2, vllm_engine_pb2_grpc

from psrl._proto import replica_control_pb2, replica_control_pb2_grpc
from psrl.gateway.processes import stop_processes

PROMPT = [11, 12, 13, 14, 15, 16, 17]


def _abort(url: str, rid: str) -> None:
    with grpc.insecure_channel(url.removeprefix("grpc://")) as ch:
        vllm_engine_pb2_grpc.VllmEngineStub(ch).Abort(vllm_engine_pb2.AbortRequest(request_ids=[rid]), timeout=5)


def _body(rid: str, n: int) -> dict:
    return {
        "request_id": rid,
        "input_ids": PROMPT,
        "return_logprob": True,
        "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True, "detokenize": False},
    }


def _psrl(rid: int, **extra: str) -> dict[str, str]:
    return {"x-request-id": str(rid), "x-prompt-id": str(rid), **extra}


@pytest.fixture(scope="module")
def fleet(model_dir, log_dir):
    a = start_replica(model_dir, log_dir)
    b = start_replica(model_dir, log_dir)
    router = start_router(log_dir, [a.url, b.url], args=["--enable-routing-loop", "--policy", "least_load"])
    yield router, a, b
    stop_processes([router.proc, a.proc, b.proc])


def test_interrupted_request_finishes_elsewhere_with_identical_tokens(fleet) -> None:
    router, a, b = fleet
    n = 1000
    reference = httpx.post(f"{router.url}/generate", json=_body("ref-1", n), headers=_psrl(1), timeout=120).json()
    result: dict = {}
    t = threading.Thread(
        target=lambda: result.update(
            r=httpx.post(f"{router.url}/generate", json=_body("pr-1", n), headers=_psrl(2), timeout=120)
        )
    )
    t.start()
    wait_for(lambda: replica_busy(a.url) + replica_busy(b.url) > 0, "a replica runs the request")
    source = a if replica_busy(a.url) else b
    # worker ids follow the order registrations complete, not --worker-urls: look the id up by URL
    [source_id] = [w["id"] for w in httpx.get(f"{router.url}/workers").json()["workers"] if w["url"] == source.url]
    time.sleep(0.3)  # let it decode a while
    # Take the source out of rotation, then interrupt the request there (what a weight sync does).
    httpx.post(f"{router.url}/workers/pause", json=[{"base_worker_id": source_id}])
    _abort(source.url, "pr-1")
    t.join(120)
    httpx.post(f"{router.url}/workers/resume", json=[{"base_worker_id": source_id}])
    r = result["r"]
    assert r.status_code == 200, r.text
    out = r.json()
    assert r.headers["x-base-worker-id"] != source_id  # it finished on the other replica
    assert out["output_ids"] == reference["output_ids"]
    assert len(out["output_ids"]) == n and out["meta_info"]["finish_reason"] == {"type": "length", "length": n}
    got = [lp for lp, _ in out["meta_info"]["output_token_logprobs"]]
    want = [lp for lp, _ in reference["meta_info"]["output_token_logprobs"]]
    assert got == pytest.approx(want, abs=1e-3)
    assert len(out["meta_info"]["output_token_versions"]) == n


def test_a_non_streamed_answer_names_the_instance_that_finished_it(fleet) -> None:
    """The response headers (what PSRL replays as the next turn's hint and version floor) name the last instance
    that served the request, not the one it started on."""
    router, a, b = fleet
    n = 600
    body = {"prompt": PROMPT, "max_tokens": n, "temperature": 0, "ignore_eos": True}
    result: dict = {}
    t = threading.Thread(
        target=lambda: result.update(
            r=httpx.post(f"{router.url}/v1/completions", json=body, headers=_psrl(5), timeout=120)
        )
    )
    t.start()
    wait_for(lambda: replica_busy(a.url) + replica_busy(b.url) > 0, "a replica runs the request")
    source = a if replica_busy(a.url) else b
    [source_id] = [w["id"] for w in httpx.get(f"{router.url}/workers").json()["workers"] if w["url"] == source.url]
    httpx.post(f"{router.url}/workers/pause", json=[{"base_worker_id": source_id}])
    with grpc.insecure_channel(source.url.removeprefix("grpc://")) as ch:  # what a weight sync does there
        control = replica_control_pb2_grpc.ReplicaControlStub(ch)
        assert (
            len(control.PauseGeneration(replica_control_pb2.PauseGenerationRequest(), timeout=10).aborted_request_ids)
            == 1
        )
        t.join(120)
        control.ResumeGeneration(replica_control_pb2.ResumeGenerationRequest(), timeout=10)
    httpx.post(f"{router.url}/workers/resume", json=[{"base_worker_id": source_id}])
    r = result["r"]
    assert r.status_code == 200, r.text
    assert r.headers["x-base-worker-id"] != source_id  # it finished on the other replica
    assert r.json()["usage"]["completion_tokens"] == n


def test_each_interrupted_choice_finishes_elsewhere_with_identical_tokens(fleet, tokenizer) -> None:
    """n = 2 with top_k 1 (sampled, so n > 1 is allowed, yet every choice is the greedy run): both choices are
    interrupted together and each continues on its own on the other replica, streamed as one response."""
    router, a, b = fleet
    n = 600
    reference = httpx.post(f"{router.url}/generate", json=_body("ref-2", n), headers=_psrl(3), timeout=120).json()
    want = tokenizer.decode(reference["output_ids"])
    body = {
        "prompt": PROMPT,
        "n": 2,
        "max_tokens": n,
        "temperature": 1.0,
        "top_k": 1,
        "seed": 1,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    result: dict = {"texts": ["", ""], "finishes": [None, None]}

    def read() -> None:
        with httpx.stream("POST", f"{router.url}/v1/completions", json=body, headers=_psrl(4), timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    event = json.loads(line[6:])
                    for c in event["choices"]:
                        result["texts"][c["index"]] += c["text"]
                        result["finishes"][c["index"]] = c["finish_reason"] or result["finishes"][c["index"]]
                    result["usage"] = event.get("usage") or result.get("usage")

    t = threading.Thread(target=read)
    t.start()
    wait_for(lambda: replica_busy(a.url) + replica_busy(b.url) > 0, "a replica runs the request")
    source = a if replica_busy(a.url) else b
    [source_id] = [w["id"] for w in httpx.get(f"{router.url}/workers").json()["workers"] if w["url"] == source.url]
    wait_for(lambda: all(result["texts"]), "both choices streamed text")
    httpx.post(f"{router.url}/workers/pause", json=[{"base_worker_id": source_id}])
    with grpc.insecure_channel(source.url.removeprefix("grpc://")) as ch:  # what a weight sync does there
        control = replica_control_pb2_grpc.ReplicaControlStub(ch)
        paused = control.PauseGeneration(replica_control_pb2.PauseGenerationRequest(), timeout=10)
        assert len(paused.aborted_request_ids) == 2  # both choices, mid-decode
        t.join(120)
        control.ResumeGeneration(replica_control_pb2.ResumeGenerationRequest(), timeout=10)
    httpx.post(f"{router.url}/workers/resume", json=[{"base_worker_id": source_id}])
    assert result["texts"] == [want, want] and result["finishes"] == ["length", "length"]
    assert result["usage"]["completion_tokens"] == 2 * n


def test_pause_barrier_holds_new_requests_until_resume(fleet) -> None:
    router, a, b = fleet
    status = httpx.post(f"{router.url}/routing_loop/pause?wait=true", json={}).json()
    assert status["paused"] and not status["selecting"] and status["active_dispatch_handoffs"] == 0
    result: dict = {}
    t = threading.Thread(
        target=lambda: result.update(
            r=httpx.post(f"{router.url}/generate", json=_body("held-1", 4), headers=_psrl(7), timeout=60)
        )
    )
    t.start()
    wait_for(lambda: httpx.get(f"{router.url}/routing_loop/status").json()["queue_len"] == 1, "the request is queued")
    assert replica_busy(a.url) + replica_busy(b.url) == 0  # held in the queue: nothing reached a replica
    assert httpx.get(f"{router.url}/routing_loop/filter?version_tag=-1").json() == [
        {"request_id": 7, "version_tag": -1, "prompt_id": 7, "is_validate": False}
    ]
    status = httpx.post(f"{router.url}/routing_loop/resume", json={}).json()
    assert not status["paused"]
    t.join(60)
    assert result["r"].status_code == 200


def test_a_request_waits_for_its_version(fleet) -> None:
    router, _, _ = fleet
    result: dict = {}
    t = threading.Thread(
        target=lambda: result.update(
            r=httpx.post(
                f"{router.url}/generate", json=_body("v5", 3), headers=_psrl(9, **{"x-version-tag": "5"}), timeout=60
            )
        )
    )
    t.start()
    wait_for(
        lambda: httpx.get(f"{router.url}/routing_loop/filter?version_tag=5").json() != [],
        "the loop lists a queued request of version <= 5",
    )
    assert httpx.get(f"{router.url}/routing_loop/filter?version_tag=4").json() == []
    updates = [{"worker_id": w, "dp_rank": 0, "weight_version": 5} for w in ("0", "1")]
    assert httpx.post(f"{router.url}/workers/update_weight_version", json=updates).json()["updated"] == 2
    t.join(60)
    r = result["r"]
    assert r.status_code == 200 and r.headers["x-version-tag"] == "5"
    assert set(r.json()["meta_info"]["output_token_versions"]) == {5}


def test_requests_without_psrl_headers_bypass_the_queue(fleet) -> None:
    router, _, _ = fleet
    httpx.post(f"{router.url}/routing_loop/pause?wait=true", json={})
    try:
        r = httpx.post(f"{router.url}/generate", json=_body("plain", 2), timeout=30)
        assert r.status_code == 200
    finally:
        httpx.post(f"{router.url}/routing_loop/resume", json={})
