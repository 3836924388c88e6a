"""cache_aware over the approximate tree: prefix hits, the imbalance override, smallest tree, eviction."""

from __future__ import annotations

import dataclasses

import pytest

from psrl.router.config import CacheAwareConfig
from psrl.router.policies.base import SelectionRequest
from psrl.router.policies.cache_aware import CacheAwarePolicy, is_imbalanced
from psrl.router.registry import InstanceState, WorkerRegistry


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _instances(n: int = 3) -> list[InstanceState]:
    reg = WorkerRegistry()
    reg.create_worker("w", "grpc://h:1", models=["m"], labels={}, dp_size=n)
    return reg.instances_of("m")


def _req(ids: list[int], model: str = "m") -> SelectionRequest:
    return SelectionRequest("r", model=model, prompt_ids=ids)


def test_config_defaults_follow_compat() -> None:
    cfg = CacheAwareConfig()
    assert dataclasses.asdict(cfg) == {
        "cache_threshold": 0.0, "balance_abs_threshold": 16, "balance_rel_threshold": 1.5,
        "balance_token_usage_threshold": 0.75, "overload_token_usage_threshold": 1.0, "eviction_interval_secs": 60,
        "max_tree_size": 2**26, "block_size": 16, "gpu_overlap_weight": 1.0, "lmcache_overlap_weight": 0.0,
        "kv_capacity_threshold": 2.0,
    }  # fmt: skip
    cfg.validate()
    for bad in ({"cache_threshold": 1.5}, {"max_tree_size": 0}, {"eviction_interval_secs": 0},
                {"kv_capacity_threshold": 0}, {"balance_abs_threshold": -1}, {"block_size": 0}):  # fmt: skip
        with pytest.raises(ValueError):
            dataclasses.replace(cfg, **bad).validate()


def test_prefix_hit_wins_and_dispatch_records_it() -> None:
    a, b, c = _instances()
    policy = CacheAwarePolicy(CacheAwareConfig(), Clock())
    policy.on_dispatched(b, _req([1, 2, 3, 4]))
    assert policy.select([a, b, c], _req([1, 2, 3, 4, 5, 6])) is b
    b.inflight = 5  # still balanced (spread 5 <= 16)
    assert policy.select([a, b, c], _req([1, 2, 3, 9])) is b
    # Candidates are a subset: the holder is not among them -> smallest tree, ties to lower load.
    a.inflight = 2
    assert policy.select([a, c], _req([1, 2, 3, 4])) is c


def test_best_match_tie_goes_to_lower_load() -> None:
    a, b, c = _instances()
    policy = CacheAwarePolicy(CacheAwareConfig(), Clock())
    policy.on_dispatched(a, _req([7, 7, 7]))
    policy.on_dispatched(b, _req([7, 7, 7]))
    a.inflight = 3
    assert policy.select([a, b, c], _req([7, 7, 7, 1])) is b


def test_miss_goes_to_the_smallest_tree() -> None:
    a, b, c = _instances()
    policy = CacheAwarePolicy(CacheAwareConfig(cache_threshold=0.5), Clock())
    policy.on_dispatched(a, _req(list(range(100))))
    policy.on_dispatched(b, _req(list(range(1000, 1010))))
    policy.on_dispatched(c, _req(list(range(2000, 2050))))
    # 2 of 10 matched on a: rate 0.2 is not above 0.5 -> b (smallest tree).
    assert policy.select([a, b, c], _req([0, 1, *range(5000, 5008)])) is b
    # 6 of 10 is above 0.5 -> a.
    assert policy.select([a, b, c], _req([0, 1, 2, 3, 4, 5, 9000, 9001, 9002, 9003])) is a
    # Nothing cached anywhere matching, threshold 0: rate 0 is not above 0 -> smallest tree.
    assert CacheAwarePolicy(CacheAwareConfig(), Clock()).select([a, b, c], _req([1])) is a


def test_imbalance_forces_shortest_queue() -> None:
    a, b, c = _instances()
    policy = CacheAwarePolicy(CacheAwareConfig(), Clock())
    policy.on_dispatched(a, _req([1, 2, 3]))
    a.inflight, b.inflight, c.inflight = 20, 3, 10  # spread 17 > 16 and 20 > 1.5 x 3
    assert policy.select([a, b, c], _req([1, 2, 3])) is b
    a.inflight = 19  # spread 16: not above the absolute threshold
    assert policy.select([a, b, c], _req([1, 2, 3])) is a
    a.inflight, b.inflight, c.inflight = 0, 0, 0
    b.stats.kv_cache_usage = 1.01  # overloaded somewhere
    c.stats.kv_cache_usage = 0.9
    a.stats.kv_cache_usage = 0.9
    c.inflight = 1
    assert policy.select([a, b, c], _req([1, 2, 3])) is a
    b.stats.kv_cache_usage = 0.1  # usage spread 0.8 > 0.75
    a.inflight = 2
    assert policy.select([a, b, c], _req([1, 2, 3])) is b


def test_is_imbalanced_needs_both_count_conditions() -> None:
    a, b, _ = _instances()
    cfg = CacheAwareConfig(balance_abs_threshold=5, balance_rel_threshold=3.0)
    a.inflight, b.inflight = 10, 4  # spread 6 > 5 but 10 < 3 x 4
    assert not is_imbalanced([a, b], cfg)
    b.inflight = 3  # 10 > 9
    assert is_imbalanced([a, b], cfg)
    b.stats.num_running_reqs = 4  # engine-reported load counts too
    assert not is_imbalanced([a, b], cfg)


def test_trees_are_per_model_and_key_kind() -> None:
    reg = WorkerRegistry()
    reg.create_worker("x", "grpc://h:1", models=["m", "n"], labels={}, dp_size=2)
    a, b = reg.instances_of("m")
    policy = CacheAwarePolicy(CacheAwareConfig(), Clock())
    policy.on_dispatched(b, _req([104, 105], model="m"))
    assert policy.select([a, b], _req([104, 105], model="n")) is a  # other model: nothing cached
    # Text requests match on UTF-8 bytes, in their own tree: b"hi" must not hit token ids [104, 105].
    assert policy.select([a, b], SelectionRequest("t", model="m", text="hi")) is a
    policy.on_dispatched(b, SelectionRequest("t", model="m", text="hello"))
    assert policy.select([a, b], SelectionRequest("t", model="m", text="help")) is b


def test_worker_removal_forgets_its_prefixes() -> None:
    reg = WorkerRegistry()
    reg.create_worker("w", "grpc://h:1", models=["m"], labels={}, dp_size=2)
    reg.create_worker("v", "grpc://h:2", models=["m"], labels={})
    a, b, c = reg.instances_of("m")
    policy = CacheAwarePolicy(CacheAwareConfig(), Clock())
    for inst in (a, b, c):
        policy.on_dispatched(inst, _req([1, 2, 3]))
    policy.on_worker_removed("w")  # both of its ranks
    assert policy.tree(_req([0])).match([1, 2, 3]) == {c.id: 3}


def test_eviction_runs_at_most_once_per_interval() -> None:
    a, b, _ = _instances()
    clock = Clock()
    policy = CacheAwarePolicy(CacheAwareConfig(max_tree_size=4, eviction_interval_secs=60), clock)
    tree = policy.tree(_req([0]))
    policy.on_dispatched(a, _req([1, 2, 3, 4, 5, 6]))
    assert tree.size_of(a.id) == 6  # not due yet
    assert not policy.maybe_evict(clock.t + 59)
    assert policy.maybe_evict(clock.t + 60)
    assert tree.size_of(a.id) == 0  # its one leaf was over the limit
    assert not policy.maybe_evict(clock.t + 61)
    clock.t += 130
    policy.on_dispatched(a, _req([9, 9, 9, 9, 9]))  # due: evicted on dispatch
    policy.on_dispatched(b, _req([1, 2, 3, 4, 5]))  # not due again
    assert tree.size_of(a.id) == 0 and tree.size_of(b.id) == 5
