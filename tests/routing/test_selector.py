"""The five selection steps, each on its own; the Selector resolving the admission data, then running the steps
synchronously; and place() committing a choice and releasing it when recording fails (no server)."""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from collections.abc import Sequence

import pytest
from _wait import until

from psrl.router.config import BreakerConfig, SelectorConfig
from psrl.router.metadata import RoutingMeta
from psrl.router.policies.base import SelectionRequest
from psrl.router.policies.least_load import LeastLoadPolicy
from psrl.router.policies.round_robin import RoundRobinPolicy
from psrl.router.registry import InstanceId, InstanceState, WorkerRegistry
from psrl.router.selector import (
    GroupPins,
    Resolved,
    Selection,
    Selector,
    admission_gate,
    sort_into_groups,
    step_available,
    step_group,
    step_hint,
)

from ._fakes import CountingAdmission

REQ = SelectionRequest("r")


def _fleet(versions: Sequence[int] = (1, 2, 3)) -> tuple[WorkerRegistry, list[InstanceState]]:
    reg = WorkerRegistry(breaker_config=BreakerConfig(failure_threshold=2, open_duration_s=30))
    for i, v in enumerate(versions):
        w = reg.create_worker(f"w{i}", f"grpc://h:{i + 1}", models=["m"], labels={}, dp_size=1)
        w.instances[0].synced_version = v
    return reg, reg.instances()


def _meta(**kw) -> RoutingMeta:
    return RoutingMeta(request_id=kw.pop("request_id", 1), prompt_id=kw.pop("prompt_id", 1), **kw)


def test_step_available_drops_unhealthy_paused_open_breaker_and_stale() -> None:
    _, insts = _fleet()
    assert step_available(insts, _meta(version_tag=2), 0.0) == insts[1:]
    insts[1].paused = True
    insts[2].worker.health.mark_down()
    assert step_available(insts, _meta(), 0.0) == [insts[0]]
    insts[0].breaker.record(False, 0.0)
    insts[0].breaker.record(False, 0.0)
    assert step_available(insts, _meta(), 1.0) == []
    assert step_available(insts, _meta(), 31.0) == [insts[0]]  # half-open after the open duration


def test_step_1_is_kept_until_something_that_decides_it_changes() -> None:
    """A request costs no pass over the fleet: step 1's result is kept, and every write that could change it (a
    pause, a synced version, health, a breaker) makes the next selection work it out again."""
    reg, _ = _fleet()
    reg.breaker_config.open_duration_s = 0.05
    sel = Selector(SelectorConfig(), RoundRobinPolicy())
    insts = reg.view("m").instances
    plain, floor = RoutingMeta(), RoutingMeta(version_tag=2)

    def survivors(meta: RoutingMeta = plain) -> Sequence[InstanceState]:
        return sel.available(insts, meta).candidates

    assert survivors() is survivors() and list(survivors()) == list(insts)
    assert list(survivors(floor)) == list(insts[1:])  # each version floor has its own
    insts[1].paused = True
    assert list(survivors()) == [insts[0], insts[2]]
    insts[1].paused = False
    insts[0].synced_version = 5
    assert list(survivors(floor)) == list(insts)
    insts[2].worker.health.mark_down()
    assert list(survivors()) == list(insts[:2])
    for _ in range(reg.health_config.success_threshold):
        insts[2].worker.health.record(True)
    assert list(survivors()) == list(insts)
    insts[0].breaker.record(False, time.monotonic())
    insts[0].breaker.record(False, time.monotonic())
    assert list(survivors()) == list(insts[1:])
    time.sleep(0.06)  # nothing is written: an open breaker turns half-open with time alone
    assert list(survivors()) == list(insts)
    insts[0].breaker.record(True, time.monotonic())  # the trial passed: closed again
    insts[1].breaker.record(False, time.monotonic())
    insts[1].breaker.record(False, time.monotonic())
    insts[1].worker.health.mark_down()  # a replica that stays down: its open breaker is not asked
    assert survivors() is survivors() and list(survivors()) == [insts[0], insts[2]]
    for _ in range(reg.health_config.success_threshold):
        insts[1].worker.health.record(True)  # back up, its breaker still open: not kept until it half-opens
    assert list(survivors()) == [insts[0], insts[2]]
    time.sleep(0.06)
    assert list(survivors()) == list(insts)
    other = reg.view(None).instances  # another list of the same instances: its own result
    assert other is not insts and list(sel.available(other, plain).candidates) == list(insts)


def test_step_hint_pins_only_sticky_or_force_pin_and_only_survivors() -> None:
    _, insts = _fleet()
    hint = InstanceId("w2", 0)
    assert step_hint(insts, _meta(hint=hint)) is None  # a plain hint is only a KV-transfer source
    assert step_hint(insts, _meta(hint=hint, is_sticky=True)) == [insts[2]]
    assert step_hint(insts, _meta(hint=hint, force_pin_once=True)) == [insts[2]]
    assert step_hint(insts[:2], _meta(hint=hint, is_sticky=True)) is None  # hinted instance filtered out


def test_group_pins_are_write_once_and_released_with_the_last_request() -> None:
    _, insts = _fleet()
    pins = GroupPins()
    pins.acquire(7, insts[1].id)
    pins.acquire(7, insts[2].id)  # write-once: the first placement stays
    assert step_group(insts, _meta(prompt_id=7), pins) == [insts[1]]
    pins.release(7)
    assert pins.get(7) == insts[1].id
    pins.release(7)
    assert pins.get(7) is None and len(pins) == 0


def test_sorting_by_version_and_indicator() -> None:
    _, insts = _fleet((1, 3, 3, 2))
    newest_first = sort_into_groups(insts, _meta(version_tag=-1), None)
    assert [[i.weight_version for i in g] for g in newest_first] == [[3, 3], [2], [1]]
    assert [i.id.base_worker_id for i in newest_first[0]] == ["w1", "w2"]  # a group keeps the candidates' order
    lowest_first = sort_into_groups(insts, _meta(version_tag=2), None)
    assert [[i.weight_version for i in g] for g in lowest_first] == [[1], [2], [3, 3]]
    by_indicator = sort_into_groups(insts, _meta(), [0.0, float("-inf"), 5.0, float("-inf")])
    assert [[i.id.base_worker_id for i in g] for g in by_indicator] == [["w1"], ["w3"], ["w0"], ["w2"]]


@pytest.mark.parametrize("seed", range(20))
def test_groups_are_a_stable_sort_by_indicator_then_version_cut_at_each_new_key(seed: int) -> None:
    rng = random.Random(seed)
    _, insts = _fleet([rng.randrange(4) for _ in range(rng.randrange(1, 12))])
    indicators = rng.choice([None, [float(rng.randrange(3)) for _ in insts]])
    meta = _meta(version_tag=rng.choice([-1, 0, 2]))
    sign = -1 if meta.version_tag < 0 else 1
    keyed = sorted(
        zip(insts, indicators or [0.0] * len(insts), strict=True), key=lambda ci: (ci[1], sign * ci[0].weight_version)
    )
    expected = [[c for c, _ in g] for _, g in itertools.groupby(keyed, key=lambda ci: (ci[1], ci[0].weight_version))]
    assert sort_into_groups(insts, meta, indicators) == expected


def test_admission_gate() -> None:
    _, insts = _fleet()
    insts[0].inflight = 2
    insts[1].stats.num_waiting_reqs = 3
    cfg = SelectorConfig(max_concurrent_seqs_per_instance=2, admission_reject_on_waiting=True)
    assert admission_gate(insts, cfg) == [insts[2]]


def _select(sel: Selector, insts: Sequence[InstanceState], meta: RoutingMeta) -> Selection:
    return sel.select(asyncio.run(sel.resolve(insts, meta)), REQ)


def test_selector_runs_steps_in_order() -> None:
    _, insts = _fleet((3, 3, 2))
    sel = Selector(SelectorConfig(enable_group_sticky=True), LeastLoadPolicy())
    # policy within the newest-version group
    s = _select(sel, insts, _meta())
    assert s.step == "policy" and s.instance in insts[:2]
    # sticky hint wins even over the version sort
    s = _select(sel, insts, _meta(hint=InstanceId("w2", 0), is_sticky=True))
    assert (s.step, s.instance) == ("hint", insts[2])
    # group pin after a commit
    ticket = sel.commit(insts[1], _meta(prompt_id=42), REQ)
    assert ticket.pinned_version == 3 and insts[1].inflight == 1
    s = _select(sel, insts, _meta(prompt_id=42, request_id=2))
    assert (s.step, s.instance) == ("group", insts[1])
    sel.release(ticket, success=True)
    assert insts[1].inflight == 0 and sel.group_pins.get(42) is None
    # version floor nobody meets
    s = _select(sel, insts, _meta(version_tag=9))
    assert s.instance is None and s.step == "available" and "version >= 9" in s.reason
    # a versioned request's echoed version is its own tag
    assert sel.commit(insts[2], _meta(version_tag=1), REQ).pinned_version == 1


def test_without_psrl_metadata_or_strategy_the_policy_runs_alone() -> None:
    _, insts = _fleet((1, 2, 3))
    sel = Selector(SelectorConfig(), RoundRobinPolicy())
    picks = [_select(sel, insts, RoutingMeta()).instance for _ in range(3)]
    assert picks == insts  # every instance in turn, no newest-version preference
    sel = Selector(SelectorConfig(worker_selection_strategy="policy"), RoundRobinPolicy())
    picks = [_select(sel, insts, _meta()).instance for _ in range(3)]
    assert picks == insts


def test_gate_falls_through_to_the_next_group() -> None:
    _, insts = _fleet((3, 2))
    insts[0].inflight = 1
    sel = Selector(SelectorConfig(max_concurrent_seqs_per_instance=1), LeastLoadPolicy())
    assert _select(sel, insts, _meta()).instance is insts[1]
    insts[1].inflight = 1
    s = _select(sel, insts, _meta())
    assert s.instance is None and s.step == "gate"


def test_select_is_synchronous_over_the_resolved_data() -> None:
    """The admission step reads what resolve() fetched: admitted candidates, sorted by their indicators."""
    _, insts = _fleet((3, 3, 2))
    sel = Selector(SelectorConfig(candidate_sort_indicator="reserve_capability"), LeastLoadPolicy())
    meta = _meta()
    s = sel.select(Resolved(meta, insts, admitted=insts, indicators=[1.0, 1.0, 0.0]), REQ)
    assert (s.step, s.instance) == ("policy", insts[2])  # the lowest indicator first, over the newest version
    s = sel.select(Resolved(meta, insts, admitted=insts[:2]), REQ)
    assert s.step == "policy" and s.instance in insts[:2]
    s = sel.select(Resolved(meta, insts, admitted=[]), REQ)
    assert s.instance is None and s.step == "admission"


def test_admission_hook_filters() -> None:
    _, insts = _fleet((1, 3))
    sel = Selector(SelectorConfig(), RoundRobinPolicy(), admission=CountingAdmission(min_version=3))
    assert _select(sel, insts, _meta()).instance is insts[1]
    s = _select(sel, insts[:1], _meta())
    assert s.instance is None and s.step == "admission"


def test_resolve_asks_the_admission_hook_only_when_its_step_runs() -> None:
    _, insts = _fleet((3, 3))
    hook = CountingAdmission()
    sel = Selector(SelectorConfig(enable_group_sticky=True), LeastLoadPolicy(), admission=hook)
    # no candidate, no PSRL metadata, a hint or a group pin: decided without the hook
    assert _select(sel, insts, _meta(version_tag=9)).step == "available"
    assert _select(sel, insts, RoutingMeta()).step == "policy"
    assert _select(sel, insts, _meta(hint=InstanceId("w1", 0), force_pin_once=True)).step == "hint"
    ticket = sel.commit(insts[0], _meta(prompt_id=7), REQ)
    assert _select(sel, insts, _meta(prompt_id=7, request_id=2)).step == "group"
    sel.release(ticket, success=True)
    assert hook.calls == []
    # the version sort needs no indicators; reserve_capability asks for them, unless nothing was admitted
    assert _select(sel, insts, _meta()).step == "policy"
    assert hook.calls == ["admit"]
    hook.calls.clear()
    sel.config.candidate_sort_indicator = "reserve_capability"
    assert _select(sel, insts, _meta()).step == "policy"
    hook.min_version = 4
    assert _select(sel, insts, _meta()).step == "admission"
    assert hook.calls == ["admit", "indicators", "admit"]


def test_a_group_pin_written_while_resolve_waits_is_followed() -> None:
    """select() runs steps 2 to 5 on the state after the admission data came back."""
    _, insts = _fleet((3, 3))
    sel = Selector(SelectorConfig(enable_group_sticky=True), LeastLoadPolicy())
    resolved = asyncio.run(sel.resolve(insts, _meta(prompt_id=7, request_id=2)))
    assert resolved.admitted == insts
    ticket = sel.commit(insts[1], _meta(prompt_id=7), REQ)  # a sibling of the group placed meanwhile
    s = sel.select(resolved, REQ)
    assert (s.step, s.instance) == ("group", insts[1])
    sel.release(ticket, success=True)


async def test_place_commits_and_records_a_psrl_request() -> None:
    _, insts = _fleet((3,))
    hook = CountingAdmission()
    sel = Selector(SelectorConfig(enable_group_sticky=True), LeastLoadPolicy(), admission=hook)
    ticket = await sel.place(insts[0], _meta(prompt_id=7), REQ)
    assert hook.calls == ["on_commit"] and insts[0].inflight == 1 and sel.group_pins.get(7) == insts[0].id
    sel.release(ticket, success=True)
    await sel.place(insts[0], RoutingMeta(), REQ)  # no PSRL metadata: nothing to record
    assert hook.calls == ["on_commit"]


@pytest.mark.parametrize("error", [RuntimeError("refused"), asyncio.CancelledError()])
async def test_place_releases_the_ticket_when_recording_fails_or_is_cancelled(error: BaseException) -> None:
    _, insts = _fleet((3,))
    hook = CountingAdmission()
    hook.commit_errors = [error, error]
    sel = Selector(SelectorConfig(enable_group_sticky=True), LeastLoadPolicy(), admission=hook)
    for _ in range(2):  # the breaker opens after two failures: these count as none
        with pytest.raises(type(error)):
            await sel.place(insts[0], _meta(prompt_id=7), REQ)
    assert insts[0].inflight == 0 and sel.group_pins.get(7) is None and insts[0].breaker.allows(0.0)


async def test_place_releases_the_ticket_when_its_caller_is_cancelled() -> None:
    _, insts = _fleet((3,))
    hook = CountingAdmission()
    hook.commit_gate = asyncio.Event()
    sel = Selector(SelectorConfig(), LeastLoadPolicy(), admission=hook)
    placing = asyncio.ensure_future(sel.place(insts[0], _meta(), REQ))
    await until(lambda: hook.calls == ["on_commit"], "place() records the placement")
    assert insts[0].inflight == 1
    placing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await placing
    assert insts[0].inflight == 0
