"""The simple policies' decisions, and the registry's view of instances (no server)."""

from __future__ import annotations

import collections

import pytest

from psrl.router.policies import make_policy
from psrl.router.policies.base import SelectionRequest
from psrl.router.policies.consistent_hash import ConsistentHashPolicy
from psrl.router.policies.least_load import LeastLoadPolicy
from psrl.router.policies.power_of_two import PowerOfTwoPolicy
from psrl.router.policies.random_choice import RandomPolicy
from psrl.router.policies.round_robin import RoundRobinPolicy
from psrl.router.registry import InstanceId, WorkerRegistry


def _registry() -> WorkerRegistry:
    reg = WorkerRegistry()
    reg.create_worker("a", "grpc://127.0.0.1:1", models=["m"], labels={}, dp_size=1)
    reg.create_worker("b", "grpc://127.0.0.1:2", models=["m"], labels={}, dp_size=2)
    reg.create_worker("c", "grpc://127.0.0.1:3", models=["other"], labels={}, dp_size=1)
    return reg


def test_registry_instances() -> None:
    reg = _registry()
    assert [i.id for i in reg.instances_of("m")] == [InstanceId("a", 0), InstanceId("b", 0), InstanceId("b", 1)]
    assert [i.id for i in reg.instances_of("other")] == [InstanceId("c", 0)]
    assert reg.instances_of("nope") == ()
    assert reg.models() == ("m", "other")
    assert reg.instance(InstanceId("b", 1)) is reg.get("b").instances[1]
    assert reg.instance(InstanceId("b", 2)) is None
    assert reg.new_id() == "0"
    assert reg.by_url("grpc://127.0.0.1:2").worker_id == "b"
    assert reg.remove("b") is not None and reg.remove("b") is None


def test_a_models_workers_follow_every_addition_and_removal() -> None:
    """What requests read per model is kept between changes, and redone after each."""
    reg = _registry()
    assert [w.worker_id for w in reg.serving("m")] == ["a", "b"]
    assert [w.worker_id for w in reg.serving(None)] == ["a", "b", "c"]
    reg.create_worker("d", "http://127.0.0.1:4", models=["m", "new"], labels={}, connection_mode="http")
    view = reg.view("m")
    assert [w.worker_id for w in view.workers] == ["a", "b", "d"]
    assert [i.id.base_worker_id for i in view.instances] == ["a", "b", "b", "d"]
    assert [i.id.base_worker_id for i in view.grpc_instances] == ["a", "b", "b"]  # d is an HTTP worker
    assert reg.models() == ("m", "other", "new")
    assert reg.view("new").grpc_instances == ()
    reg.remove("a")
    assert [w.worker_id for w in reg.serving("m")] == ["b", "d"]
    assert [i.id.base_worker_id for i in reg.instances_of(None)] == ["b", "b", "c", "d"]
    reg.create_worker("b", "grpc://127.0.0.1:5", models=["other"], labels={})  # b replaced, now serving another
    assert [w.worker_id for w in reg.serving("m")] == ["d"]
    assert [w.url for w in reg.serving("other")] == ["grpc://127.0.0.1:5", "grpc://127.0.0.1:3"]
    assert reg.models() == ("other", "m", "new")
    reg.view("not served")
    assert set(reg._views) == {"m", "other"}  # a model nobody serves is not kept


def test_round_robin_cycles() -> None:
    cands = _registry().instances_of("m")
    policy = RoundRobinPolicy()
    assert [policy.select(cands, SelectionRequest(str(i))) for i in range(6)] == [*cands, *cands]


def test_random_covers_every_candidate() -> None:
    cands = _registry().instances_of("m")
    policy = RandomPolicy(seed=1)
    picks = collections.Counter(policy.select(cands, SelectionRequest("r")).id for _ in range(300))
    assert set(picks) == {c.id for c in cands} and min(picks.values()) > 60


def test_least_load_and_power_of_two_prefer_idle_instances() -> None:
    cands = _registry().instances_of("m")
    cands[0].inflight = 5
    cands[1].stats.num_running_reqs = 3
    assert LeastLoadPolicy().select(cands, SelectionRequest("r")) is cands[2]
    p2 = PowerOfTwoPolicy(seed=3)
    picks = collections.Counter(p2.select(cands, SelectionRequest("r")).id for _ in range(300))
    assert cands[0].id not in picks  # the most loaded one always loses its pair
    assert picks[cands[2].id] > picks[cands[1].id]


def test_consistent_hash_is_stable_and_moves_only_the_lost_keys() -> None:
    cands = _registry().instances_of("m")
    policy = ConsistentHashPolicy()
    keys = [f"session-{i}" for i in range(200)]
    before = {k: policy.select(cands, SelectionRequest("r", routing_key=k)).id for k in keys}
    assert before == {k: policy.select(cands, SelectionRequest("r", routing_key=k)).id for k in keys}
    assert len(set(before.values())) == 3
    after = {k: policy.select(cands[:2], SelectionRequest("r", routing_key=k)).id for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert moved and all(before[k] == cands[2].id for k in moved)
    listed = list(cands)  # a list the caller changes between requests is read afresh each time
    assert {k: policy.select(listed, SelectionRequest("r", routing_key=k)).id for k in keys} == before
    del listed[2]
    assert {k: policy.select(listed, SelectionRequest("r", routing_key=k)).id for k in keys} == after
    cands[0].inflight = 9
    assert policy.select(cands, SelectionRequest("r")) is not cands[0]  # no key: least loaded


def test_make_policy() -> None:
    for name in (
        "round_robin",
        "random",
        "power_of_two",
        "least_load",
        "consistent_hash",
        "cache_aware",
        "cache_aware_v1",
    ):
        assert make_policy(name).name == name
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("telepathy")


def test_policies_declare_their_capabilities() -> None:
    """What the router asks every policy: the prefix ones match on text and trim their trees; cache_aware_v1
    scores on a KV-event index; the others keep nothing."""
    for name in ("round_robin", "random", "power_of_two", "least_load", "consistent_hash"):
        policy = make_policy(name)
        assert (policy.needs_text, policy.kv_index, policy.maybe_evict(10**9)) == (False, None, False)
    cache_aware = make_policy("cache_aware")
    assert cache_aware.needs_text and cache_aware.kv_index is None and cache_aware.maybe_evict(10**9)
    v1 = make_policy("cache_aware_v1")
    assert v1.needs_text and v1.kv_index is not None and v1.maybe_evict(10**9)
