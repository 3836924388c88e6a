"""Registry candidates and the round_robin policy, without a server."""

from __future__ import annotations

import pytest

from psrl.router.policies import RoundRobinPolicy, SelectionRequest, make_policy
from psrl.router.registry import InstanceId, Worker, WorkerRegistry


def _registry() -> WorkerRegistry:
    reg = WorkerRegistry()
    reg.add(Worker("a", "grpc://127.0.0.1:1", ["m"], {}, dp_size=1))
    reg.add(Worker("b", "grpc://127.0.0.1:2", ["m"], {}, dp_size=2))
    reg.add(Worker("c", "grpc://127.0.0.1:3", ["other"], {}, dp_size=1))
    return reg


def test_candidates_are_healthy_instances_of_the_model() -> None:
    reg = _registry()
    assert [c.id for c in reg.candidates("m")] == [InstanceId("a", 0), InstanceId("b", 0), InstanceId("b", 1)]
    reg.get("b").healthy = False
    assert [c.id for c in reg.candidates("m")] == [InstanceId("a", 0)]
    assert [c.id for c in reg.candidates("other")] == [InstanceId("c", 0)]
    assert reg.candidates("nope") == []
    assert reg.models() == ["m", "other"]


def test_round_robin_cycles_through_every_candidate() -> None:
    candidates = _registry().candidates("m")
    policy = RoundRobinPolicy()
    picks = [policy.select(candidates, SelectionRequest(str(i))).id for i in range(6)]
    assert picks == [c.id for c in candidates] * 2


def test_new_ids_skip_taken_ones() -> None:
    reg = WorkerRegistry()
    reg.add(Worker("0", "grpc://h:1", ["m"], {}))
    assert reg.new_id() == "1"
    assert reg.by_url("grpc://h:1").worker_id == "0"
    assert reg.remove("0") is not None and reg.remove("0") is None


def test_unknown_policy() -> None:
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("telepathy")
