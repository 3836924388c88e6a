"""cache_aware and cache_aware_v1 end to end: requests sharing a long prefix land where it is cached, and the
replica serves the prefix from its cache (cached_tokens > 0)."""

from __future__ import annotations

import time

import httpx
import pytest
from _procs import start_replica, start_router

from psrl.gateway.processes import stop_processes

PREFIX = [(7 * i + 3) % 600 + 10 for i in range(320)]  # 20 full blocks of 16


def _gen(router, suffix: list[int]) -> httpx.Response:
    body = {
        "input_ids": PREFIX + suffix,
        "sampling_params": {"max_new_tokens": 2, "temperature": 0, "detokenize": False},
    }
    r = httpx.post(f"{router.url}/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r


@pytest.mark.parametrize("policy", ["cache_aware", "cache_aware_v1"])
def test_shared_prefix_lands_where_it_is_cached(model_dir, log_dir, policy) -> None:
    a = start_replica(model_dir, log_dir)
    b = start_replica(model_dir, log_dir)
    router = start_router(log_dir, [a.url, b.url], args=["--policy", policy])
    try:
        first = _gen(router, [1, 2, 3])
        home = first.headers["x-base-worker-id"]
        assert first.json()["meta_info"]["cached_tokens"] == 0
        if policy == "cache_aware_v1":
            time.sleep(0.5)  # let the replica's KV events reach the router's index
        for i in range(5):
            r = _gen(router, [40 + i, 41 + i])
            assert r.headers["x-base-worker-id"] == home, i
            assert r.json()["meta_info"]["cached_tokens"] >= len(PREFIX) - 16
        if policy == "cache_aware_v1":
            return
        # cache_aware sends a prompt no tree matches to the instance with the smallest tree
        other = httpx.post(
            f"{router.url}/generate",
            timeout=60,
            json={"input_ids": [600, 601, 602, 603], "sampling_params": {"max_new_tokens": 1, "detokenize": False}},
        )
        assert other.status_code == 200 and other.headers["x-base-worker-id"] != home
    finally:
        stop_processes([a.proc, b.proc, router.proc])
