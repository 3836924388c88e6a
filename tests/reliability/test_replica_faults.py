"""A replica that is down or dies mid-stream: 503/502 with an error code; the router serves on."""

from __future__ import annotations

import json
import os
import signal
import threading

import httpx
from _procs import replica_busy, start_replica, start_router, wait_for

from psrl.gateway.processes import stop_processes

MSG = [{"role": "user", "content": "hi"}]
SHORT = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}
LONG = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}}


def test_down_replica_is_503_and_the_other_keeps_serving(model_dir, log_dir) -> None:
    a = start_replica(model_dir, log_dir)
    b = start_replica(model_dir, log_dir)
    router = start_router(log_dir, [a.url, b.url])
    try:
        stop_processes([a.proc])
        codes = []
        for _ in range(4):
            r = httpx.post(
                f"{router.url}/generate",
                json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}},
                timeout=30,
            )
            codes.append(r.status_code)
            if r.status_code != 200:
                assert r.status_code == 503, r.text
                assert r.headers["x-smg-error-code"] == "worker_unavailable"
        assert 200 in codes
        # Once marked down, every request goes to the live replica.
        for _ in range(4):
            r = httpx.post(
                f"{router.url}/generate",
                json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}},
                timeout=30,
            )
            assert r.status_code == 200, r.text
        workers = httpx.get(f"{router.url}/workers").json()["workers"]
        assert sorted(w["healthy"] for w in workers) == [False, True]
        assert router.alive()
    finally:
        stop_processes([a.proc, b.proc, router.proc])


def test_replica_dying_mid_stream_is_502_then_503(model_dir, log_dir) -> None:
    a = start_replica(model_dir, log_dir)
    router = start_router(log_dir, [a.url])
    try:
        result: dict = {}

        def long_request() -> None:
            result["resp"] = httpx.post(f"{router.url}/generate", json=LONG, timeout=120)

        t = threading.Thread(target=long_request)
        t.start()
        wait_for(lambda: "num_running_reqs: 1" in _loads(a.url), "one request running on replica a")
        stop_processes([a.proc], timeout_s=0.1)
        t.join(60)
        r = result["resp"]
        assert r.status_code == 502, r.text
        assert r.headers["x-smg-error-code"] == "stream_drain_failed"

        r = httpx.post(f"{router.url}/v1/chat/completions", json={"messages": MSG}, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["code"] == "worker_unavailable"
        assert router.alive()
    finally:
        stop_processes([a.proc, router.proc])


def test_sse_stream_reports_a_mid_stream_death_as_an_error_event(model_dir, log_dir) -> None:
    a = start_replica(model_dir, log_dir)
    router = start_router(log_dir, [a.url])
    try:
        body = {"messages": MSG, "max_tokens": 3000, "stream": True, "ignore_eos": True}
        events = []
        with httpx.stream("POST", f"{router.url}/v1/chat/completions", json=body, timeout=120) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line[6:])
                if len(events) == 5:
                    stop_processes([a.proc], timeout_s=0.1)
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == "stream_drain_failed"
        assert router.alive()
    finally:
        stop_processes([a.proc, router.proc])


def _loads(url: str) -> str:
    import grpc
    from smg_grpc_proto.generated import vllm_engine_pb2, vllm_engine_pb2_grpc

    with grpc.insecure_channel(url.removeprefix("grpc://")) as ch:
        return str(vllm_engine_pb2_grpc.VllmEngineStub(ch).GetLoads(vllm_engine_pb2.GetLoadsRequest(), timeout=5))


def _psrl(i: int) -> dict[str, str]:
    return {"x-request-id": str(i), "x-prompt-id": str(i)}


def test_psrl_requests_on_a_replica_killed_mid_decode_continue_on_another(model_dir, log_dir) -> None:
    """kill -9 under running PSRL requests: each keeps what it streamed, loops back to the live replica (its KV
    recomputed there) and ends as an uninterrupted run would; nothing stays counted in flight."""
    a = start_replica(model_dir, log_dir)
    b = start_replica(model_dir, log_dir)
    router = start_router(log_dir, [a.url, b.url])
    sp = {"max_new_tokens": 1500, "ignore_eos": True, "temperature": 0}
    body = {"input_ids": [1, 2, 3], "sampling_params": sp, "return_logprob": True}
    chat = {"messages": MSG, "max_tokens": 1500, "ignore_eos": True, "temperature": 0, "stream": True}
    chat["stream_options"] = {"include_usage": True}
    try:
        expected = httpx.post(f"{router.url}/generate", json=body, timeout=120).json()["output_ids"]
        [victim] = [w["worker_id"] for w in httpx.get(f"{router.url}/workers").json()["workers"] if w["url"] == a.url]
        on_a = {"x-base-worker-id": victim, "x-target-dp-rank": "0", "x-is-sticky": "true"}  # all start on A
        results: dict[int, httpx.Response] = {}
        streamed: list[str] = []

        def one(i: int) -> None:
            results[i] = httpx.post(f"{router.url}/generate", json=body, headers={**_psrl(i), **on_a}, timeout=180)

        def stream() -> None:
            with httpx.stream(
                "POST", f"{router.url}/v1/chat/completions", json=chat, headers={**_psrl(99), **on_a}, timeout=180
            ) as r:
                streamed.extend(line[6:] for line in r.iter_lines() if line.startswith("data: "))

        threads = [threading.Thread(target=one, args=(i,)) for i in range(4)] + [threading.Thread(target=stream)]
        for t in threads:
            t.start()
        # the stream must have relayed tokens before the kill (its role chunk, then content), or it starts again
        # instead of continuing elsewhere
        wait_for(
            lambda: replica_busy(a.url) == 5 and len(streamed) >= 3,
            "five requests running on replica a, the stream past its first tokens",
        )
        os.kill(a.proc.pid, signal.SIGKILL)
        for t in threads:
            t.join(180)
        for i in range(4):
            r = results[i]
            assert r.status_code == 200, r.text
            out = r.json()
            assert out["output_ids"] == expected and out["meta_info"]["finish_reason"]["type"] == "length"
            assert len(out["meta_info"]["output_token_logprobs"]) == 1500
        assert streamed[-1] == "[DONE]" and not any('"error"' in e for e in streamed)
        assert json.loads(streamed[-2])["usage"]["completion_tokens"] == 1500
        log = router.log_text()
        assert "continues elsewhere" in log and "starts again" in log  # the streamed one, the non-streamed ones
        workers = lambda: httpx.get(f"{router.url}/workers").json()["workers"]  # noqa: E731
        wait_for(
            lambda: all(i["inflight_requests"] == 0 for w in workers() for i in w["instances"]),
            "no request in flight on any instance",
        )
    finally:
        stop_processes([a.proc, b.proc, router.proc])
