"""The coordinator endpoints' semantics and response shapes (docs/compat.md section 6), on the registry directly."""

from __future__ import annotations

import pytest

from psrl.router import coordinator_api as api
from psrl.router.errors import BadRequest
from psrl.router.registry import WorkerRegistry


@pytest.fixture
def reg() -> WorkerRegistry:
    r = WorkerRegistry()
    r.create_worker("0", "grpc://h:1", models=["m"], labels={}, dp_size=1)
    r.create_worker("1", "grpc://h:2", models=["m"], labels={}, dp_size=2)
    return r


def _stats(wid, rank, ts, running=1):
    e = {
        "worker_id": wid,
        "timestamp": ts,
        "scheduler_stats": {
            "num_running_reqs": running,
            "num_waiting_reqs": 2,
            "kv_cache_usage": 0.5,
            "req_id_to_prompt_token_num": {"a": 3},
            "req_id_to_response_token_num": {},
        },
    }
    if rank is not None:
        e["dp_rank"] = rank
    return e


def test_update_stats(reg) -> None:
    out = api.update_stats(reg, [_stats("0", None, "2026-01-01T00:00:01Z"), _stats("1", 1, "2026-01-01T00:00:01Z")])
    assert {k: out[k] for k in ("total", "updated", "rejected", "stale_ignored")} == {
        "total": 2,
        "updated": 2,
        "rejected": 0,
        "stale_ignored": 0,
    }
    inst = reg.get("1").instances[1]
    assert (inst.stats.num_running_reqs, inst.stats.num_waiting_reqs, inst.load) == (1, 2, 3)
    assert inst.stats.req_id_to_prompt_token_num == {"a": 3}
    out = api.update_stats(
        reg,
        [
            _stats("1", 1, "2026-01-01T00:00:00Z", running=9),  # older: stale
            _stats("1", None, "2026-01-01T00:00:05Z"),  # DP worker without a rank: rejected
            _stats("nope", 0, "2026-01-01T00:00:05Z"),  # unknown worker
            _stats("0", 0, "not a time"),
        ],
    )
    assert (out["updated"], out["rejected"], out["stale_ignored"]) == (0, 3, 1)
    assert [r["status"] for r in out["results"]] == ["stale_ignored", "rejected", "rejected", "rejected"]
    assert "dp_rank is required" in out["results"][1]["reason"]
    assert reg.get("1").instances[1].stats.num_running_reqs == 1


def test_update_weight_version(reg) -> None:
    out = api.update_weight_version(
        reg,
        [
            {"worker_id": "0", "dp_rank": 0, "weight_version": 4},
            {"worker_id": "1", "dp_rank": 0, "weight_version": 4},
            {"worker_id": "1", "dp_rank": 1, "weight_version": 4},
        ],
    )
    assert (out["total"], out["updated"], out["rejected"]) == (3, 3, 0)
    assert out["results"][0] == {
        "worker_id": "0",
        "url": "grpc://h:1",
        "dp_rank": 0,
        "weight_version": 4,
        "status": "updated",
    }
    assert [i.weight_version for i in reg.instances()] == [4, 4, 4]
    # partial replica: only rank 0 of the dp_size 2 worker
    out = api.update_weight_version(
        reg,
        {"updates": [{"worker_id": "1", "dp_rank": 0, "weight_version": 5}, {"worker_id": "0", "weight_version": 5}]},
    )
    assert (out["updated"], out["rejected"]) == (1, 1)
    assert "partial replica" in out["results"][0]["reason"]
    assert [i.weight_version for i in reg.instances()] == [5, 4, 4]
    out = api.update_weight_version(reg, [{"worker_id": "0", "weight_version": "x"}])
    assert out["rejected"] == 1
    with pytest.raises(BadRequest):
        api.update_weight_version(reg, "nope")


def test_pause_and_resume(reg) -> None:
    out = api.set_paused(
        reg,
        [
            {"base_worker_id": "1", "dp_rank": 1},
            {"base_worker_id": "1", "dp_rank": 1},
            {"worker_id": "0"},
            {"base_worker_id": "zz"},
            {"base_worker_id": "1", "dp_rank": 7},
        ],
        True,
    )
    assert out["action"] == "paused" and (out["updated"], out["rejected"]) == (2, 2)
    assert out["results"][0] == {
        "base_worker_id": "1",
        "dp_rank": 1,
        "status": "updated",
        "paused": True,
        "reason": None,
    }
    assert out["results"][1] == {"worker_id": "0", "status": "updated", "paused": True, "reason": None}
    assert [i.paused for i in reg.instances()] == [True, False, True]
    assert all(i.healthy for i in reg.instances())  # paused is still healthy
    out = api.set_paused(reg, [{"base_worker_id": "1", "dp_rank": [0, 1]}, {"worker_id": "0"}], False)
    assert out["action"] == "resumed" and out["updated"] == 3
    assert not any(i.paused for i in reg.instances())


def test_worker_stats(reg) -> None:
    api.update_stats(reg, [_stats("0", 0, "2026-01-01T00:00:01Z", running=5)])
    out = api.worker_stats(reg)
    assert out["total_running_requests"] == 5
    assert {"worker_id", "dp_rank", "running_requests", "weight_version", "paused", "healthy"} <= set(out["workers"][0])
