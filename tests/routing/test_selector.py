"""The five selection stages, each on its own, and the Selector running them in order (no server)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from psrl.router.health import BreakerConfig
from psrl.router.metadata import RoutingMeta
from psrl.router.policies import LeastLoadPolicy, RoundRobinPolicy, SelectionRequest
from psrl.router.registry import InstanceId, InstanceState, WorkerRegistry
from psrl.router.selector import (
    GroupPins,
    Selector,
    SelectorConfig,
    admission_gate,
    sort_into_groups,
    stage_available,
    stage_group,
    stage_hint,
)

REQ = SelectionRequest("r")


def _fleet(versions: Sequence[int] = (1, 2, 3)) -> tuple[WorkerRegistry, list[InstanceState]]:
    reg = WorkerRegistry(breaker_config=BreakerConfig(failure_threshold=2, open_duration_s=30))
    for i, v in enumerate(versions):
        w = reg.create_worker(f"w{i}", f"grpc://h:{i + 1}", models=["m"], labels={}, dp_size=1)
        w.instances[0].synced_version = v
    return reg, reg.instances()


def _meta(**kw) -> RoutingMeta:
    return RoutingMeta(request_id=kw.pop("request_id", 1), prompt_id=kw.pop("prompt_id", 1), **kw)


def test_stage_available_drops_unhealthy_paused_open_breaker_and_stale() -> None:
    _, insts = _fleet()
    assert stage_available(insts, _meta(version_tag=2), 0.0) == insts[1:]
    insts[1].paused = True
    insts[2].worker.health.mark_down()
    assert stage_available(insts, _meta(), 0.0) == [insts[0]]
    insts[0].breaker.record(False, 0.0)
    insts[0].breaker.record(False, 0.0)
    assert stage_available(insts, _meta(), 1.0) == []
    assert stage_available(insts, _meta(), 31.0) == [insts[0]]  # half-open after the open duration


def test_stage_hint_pins_only_sticky_or_force_pin_and_only_survivors() -> None:
    _, insts = _fleet()
    hint = InstanceId("w2", 0)
    assert stage_hint(insts, _meta(hint=hint)) is None  # a plain hint is only a KV-transfer source
    assert stage_hint(insts, _meta(hint=hint, is_sticky=True)) == [insts[2]]
    assert stage_hint(insts, _meta(hint=hint, force_pin_once=True)) == [insts[2]]
    assert stage_hint(insts[:2], _meta(hint=hint, is_sticky=True)) is None  # hinted instance filtered out


def test_group_pins_are_write_once_and_released_with_the_last_request() -> None:
    _, insts = _fleet()
    pins = GroupPins()
    pins.acquire(7, insts[1].id)
    pins.acquire(7, insts[2].id)  # write-once: the first placement stays
    assert stage_group(insts, _meta(prompt_id=7), pins) == [insts[1]]
    pins.release(7)
    assert pins.get(7) == insts[1].id
    pins.release(7)
    assert pins.get(7) is None and len(pins) == 0


def test_sorting_by_version_and_indicator() -> None:
    _, insts = _fleet((1, 3, 3, 2))
    newest_first = sort_into_groups(insts, _meta(version_tag=-1), None)
    assert [[i.weight_version for i in g] for g in newest_first] == [[3, 3], [2], [1]]
    lowest_first = sort_into_groups(insts, _meta(version_tag=2), None)
    assert [[i.weight_version for i in g] for g in lowest_first] == [[1], [2], [3, 3]]
    by_indicator = sort_into_groups(insts, _meta(), [0.0, float("-inf"), 5.0, float("-inf")])
    assert [[i.id.base_worker_id for i in g] for g in by_indicator] == [["w1"], ["w3"], ["w0"], ["w2"]]


def test_admission_gate() -> None:
    _, insts = _fleet()
    insts[0].inflight = 2
    insts[1].stats.num_waiting_reqs = 3
    cfg = SelectorConfig(max_concurrent_seqs_per_instance=2, admission_reject_on_waiting=True)
    assert admission_gate(insts, cfg) == [insts[2]]


def test_selector_runs_stages_in_order() -> None:
    _, insts = _fleet((3, 3, 2))
    sel = Selector(SelectorConfig(enable_group_sticky=True), LeastLoadPolicy())
    run = lambda meta: asyncio.run(sel.select(insts, meta, REQ))  # noqa: E731
    # policy within the newest-version group
    s = run(_meta())
    assert s.stage == "policy" and s.instance in insts[:2]
    # sticky hint wins even over the version sort
    s = run(_meta(hint=InstanceId("w2", 0), is_sticky=True))
    assert (s.stage, s.instance) == ("hint", insts[2])
    # group pin after a commit
    ticket = sel.commit(insts[1], _meta(prompt_id=42), REQ)
    assert ticket.pinned_version == 3 and insts[1].inflight == 1
    s = run(_meta(prompt_id=42, request_id=2))
    assert (s.stage, s.instance) == ("group", insts[1])
    sel.release(ticket, success=True)
    assert insts[1].inflight == 0 and sel.group_pins.get(42) is None
    # version floor nobody meets
    s = run(_meta(version_tag=9))
    assert s.instance is None and "version >= 9" in s.reason
    # a versioned request's echoed version is its own tag
    assert sel.commit(insts[2], _meta(version_tag=1), REQ).pinned_version == 1


def test_without_psrl_metadata_or_strategy_the_policy_runs_alone() -> None:
    _, insts = _fleet((1, 2, 3))
    sel = Selector(SelectorConfig(), RoundRobinPolicy())
    picks = [asyncio.run(sel.select(insts, RoutingMeta(), REQ)).instance for _ in range(3)]
    assert picks == insts  # every instance in turn, no newest-version preference
    sel = Selector(SelectorConfig(worker_selection_strategy="policy"), RoundRobinPolicy())
    picks = [asyncio.run(sel.select(insts, _meta(), REQ)).instance for _ in range(3)]
    assert picks == insts


def test_gate_falls_through_to_the_next_group() -> None:
    _, insts = _fleet((3, 2))
    insts[0].inflight = 1
    sel = Selector(SelectorConfig(max_concurrent_seqs_per_instance=1), LeastLoadPolicy())
    assert asyncio.run(sel.select(insts, _meta(), REQ)).instance is insts[1]
    insts[1].inflight = 1
    s = asyncio.run(sel.select(insts, _meta(), REQ))
    assert s.instance is None and s.stage == "gate"


class _RejectOld:
    async def admit(self, candidates, meta):
        return [c for c in candidates if c.weight_version >= 3]

    async def indicators(self, candidates, meta):
        return None


def test_admission_hook_filters() -> None:
    _, insts = _fleet((1, 3))
    sel = Selector(SelectorConfig(), RoundRobinPolicy(), admission=_RejectOld())
    assert asyncio.run(sel.select(insts, _meta(), REQ)).instance is insts[1]
    s = asyncio.run(sel.select(insts[:1], _meta(), REQ))
    assert s.instance is None and s.stage == "admission"
