"""The routing loop without a server: queue order, epochs and the pause barrier, hand-off accounting, and the
partial-rollout bookkeeping."""

from __future__ import annotations

import asyncio

import pytest
from _wait import until

from psrl.router.config import RoutingLoopConfig, SelectorConfig
from psrl.router.metadata import RoutingMeta
from psrl.router.pipeline.context import Generation, GenerationInput, SamplingSpec
from psrl.router.pipeline.partial_rollout import RolloutState, SegmentEnd, UnexpectedFinishReason, classify
from psrl.router.policies.base import SelectionRequest
from psrl.router.policies.least_load import LeastLoadPolicy
from psrl.router.registry import WorkerRegistry
from psrl.router.routing_loop import QueueEntry, RequestQueue, RoutingLoop
from psrl.router.selector import Selector

from ._fakes import CountingAdmission


def _entry(rid: int, *, version: int = -1, validate: bool = False, length: int = 1) -> QueueEntry:
    meta = RoutingMeta(request_id=rid, prompt_id=rid, version_tag=version, is_validate=validate)
    return QueueEntry(meta, SelectionRequest(str(rid), prompt_ids=[0] * length), list, asyncio.Future)  # type: ignore[arg-type]


def test_queue_order_validation_then_version_then_indicator_then_fifo() -> None:
    q = RequestQueue("small_id", partitioned=False)
    for e in (_entry(5), _entry(3, version=2), _entry(9, validate=True), _entry(1, version=2), _entry(2), _entry(2)):
        q.push(e)
    order = [(e.meta.request_id, e.meta.version_tag) for e in iter(q.pop, None)]
    assert order == [(9, -1), (1, 2), (3, 2), (2, -1), (2, -1), (5, -1)]


def test_queue_length_indicators_and_requeue_keeps_its_place() -> None:
    q = RequestQueue("long_length", partitioned=False)
    a, b, c = _entry(1, length=5), _entry(2, length=50), _entry(3, length=20)
    for e in (a, b, c):
        q.push(e)
    first = q.pop()
    assert first is b
    q.push(first, keep_seq=True)  # a re-enqueued request keeps its priority and FIFO position
    assert [e.meta.request_id for e in iter(q.pop, None)] == [2, 3, 1]
    q = RequestQueue("short_length", partitioned=False)
    for e in (a, b, c):
        q.push(e)
    assert [e.meta.request_id for e in iter(q.pop, None)] == [1, 3, 2]


def test_partitions_drain_the_lowest_version_first() -> None:
    q = RequestQueue("small_id", partitioned=True)
    for e in (_entry(1, version=-1, validate=True), _entry(2, version=7), _entry(3, version=3)):
        q.push(e)
    assert q.partition_lens() == {"3": 1, "7": 1, str(2**31 - 1): 1}
    assert [e.meta.request_id for e in iter(q.pop, None)] == [3, 2, 1]


def _setup(admission: CountingAdmission | None = None, **loop_kw):
    reg = WorkerRegistry()
    reg.create_worker("w", "grpc://h:1", models=["m"], labels={}, dp_size=2)
    selector = Selector(SelectorConfig(), LeastLoadPolicy(), admission)
    loop = RoutingLoop(RoutingLoopConfig(**loop_kw), selector)
    return reg, loop


def _meta(rid: int) -> RoutingMeta:
    return RoutingMeta(request_id=rid, prompt_id=rid)


async def test_loop_hands_off_and_counts_running() -> None:
    reg, loop = _setup(dispatch_batch_size=4)
    loop.start()
    try:
        ticket = await asyncio.wait_for(loop.acquire(_meta(1), SelectionRequest("1"), reg.instances), 5)
        status = loop.status()
        assert status["running_request_num"] == 1 and status["active_dispatch_handoffs"] == 1
        assert ticket.routed and ticket.instance.inflight == 1
        ticket.release_handoff()
        assert loop.status()["active_dispatch_handoffs"] == 0
        loop.finished(ticket, success=True)
        assert loop.status()["running_request_num"] == 0 and ticket.instance.inflight == 0
    finally:
        await loop.stop()


async def test_pause_barrier_waits_for_handoffs_and_holds_new_requests() -> None:
    reg, loop = _setup()
    loop.start()
    try:
        ticket = await loop.acquire(_meta(1), SelectionRequest("1"), reg.instances)
        pause = asyncio.ensure_future(loop.pause(wait=True))
        await until(lambda: loop.status()["paused"], "the loop is paused")
        assert not pause.done()  # a hand-off of the old epoch is still active
        assert loop.status()["routing_epoch"] == 1
        ticket.release_handoff()
        await asyncio.wait_for(pause, 2)
        queued = asyncio.ensure_future(loop.acquire(_meta(2), SelectionRequest("2"), reg.instances))
        await until(lambda: loop.status()["queue_len"] == 1, "the request is queued")
        assert not queued.done()  # paused: nothing is placed
        assert loop.queued(-1) == [{"request_id": 2, "version_tag": -1, "prompt_id": 2, "is_validate": False}]
        loop.resume()
        second = await asyncio.wait_for(queued, 2)
        assert second.instance is not None and loop.status()["queue_len"] == 0
        loop.finished(ticket, success=True)
        loop.finished(second, success=True)
    finally:
        await loop.stop()


async def test_a_selection_finished_in_an_old_epoch_is_requeued_never_dispatched() -> None:
    reg, loop = _setup()
    gate = asyncio.Event()
    real_resolve = loop._selector.resolve

    async def slow_resolve(*args, **kwargs):
        await gate.wait()
        return await real_resolve(*args, **kwargs)

    loop._selector.resolve = slow_resolve  # type: ignore[method-assign]
    loop.start()
    try:
        acquire = asyncio.ensure_future(loop.acquire(_meta(1), SelectionRequest("1"), reg.instances))
        await until(lambda: loop.status()["selecting"], "the loop is selecting")
        pause = asyncio.ensure_future(loop.pause(wait=True))
        await until(lambda: loop.status()["paused"], "the loop is paused")
        assert not pause.done()  # the decision of the old epoch is still running
        gate.set()
        await asyncio.wait_for(pause, 2)
        assert not acquire.done() and loop.status()["queue_len"] == 1  # dropped and re-enqueued
        assert all(i.inflight == 0 for i in reg.instances())
        loop.resume()
        ticket = await asyncio.wait_for(acquire, 2)
        loop.finished(ticket, success=True)
    finally:
        await loop.stop()


async def test_requests_without_an_instance_wait_in_the_queue() -> None:
    reg, loop = _setup()
    for inst in reg.instances():
        inst.paused = True
    loop.start()
    try:
        acquire = asyncio.ensure_future(loop.acquire(_meta(1), SelectionRequest("1"), reg.instances))
        await until(lambda: loop.status()["queue_len"] == 1, "the request is queued")
        assert not acquire.done()  # every instance is paused
        reg.instances()[1].paused = False
        ticket = await asyncio.wait_for(acquire, 2)
        assert ticket.instance is reg.instances()[1]
        loop.finished(ticket, success=True)
    finally:
        await loop.stop()


async def test_max_running_caps_dispatch() -> None:
    reg, loop = _setup(max_running_dispatch_tasks=1)
    loop.start()
    try:
        first = await loop.acquire(_meta(1), SelectionRequest("1"), reg.instances)
        second = asyncio.ensure_future(loop.acquire(_meta(2), SelectionRequest("2"), reg.instances))
        await until(lambda: loop.status()["queue_len"] == 1, "the second request is queued")
        assert not second.done()  # the one running slot is taken
        loop.finished(first, success=True)
        loop.finished(await asyncio.wait_for(second, 2), success=True)
    finally:
        await loop.stop()


def _versioned(rid: int, version: int) -> RoutingMeta:
    return RoutingMeta(request_id=rid, prompt_id=rid, version_tag=version)


async def test_a_request_no_instance_can_take_does_not_hold_back_the_ones_behind_it() -> None:
    reg, loop = _setup()
    loop.start()
    try:
        blocked = asyncio.ensure_future(loop.acquire(_versioned(1, 7), SelectionRequest("1"), reg.instances))
        await until(lambda: loop.status()["queue_len"] == 1, "the blocker is queued")
        # Behind the blocker in priority order (a higher request id), and placeable: it is served.
        later = await asyncio.wait_for(loop.acquire(_meta(2), SelectionRequest("2"), reg.instances), 2)
        assert not blocked.done() and loop.status()["queue_len"] == 1
        # Once version 7 is synced the blocker goes first again, ahead of a request queued after it.
        for inst in reg.instances():
            inst.paused = True
        after = asyncio.ensure_future(loop.acquire(_meta(3), SelectionRequest("3"), reg.instances))
        await until(lambda: loop.status()["queue_len"] == 2, "both requests are queued")
        assert [k[2] for k in loop.status()["queue_keys"]] == [1, 3]
        reg.instances()[0].synced_version = 7
        reg.instances()[0].paused = False
        first = await asyncio.wait_for(blocked, 2)
        assert first.instance is reg.instances()[0]
        for t in (later, first):
            loop.finished(t, success=True)
        loop.finished(await asyncio.wait_for(after, 2), success=True)
        assert loop.status()["queue_len"] == 0 and loop.status()["running_tasks"] == 0
    finally:
        await loop.stop()


async def test_a_queued_request_whose_caller_left_leaves_the_queue() -> None:
    reg, loop = _setup()
    loop.start()
    try:
        waiting = [
            asyncio.ensure_future(loop.acquire(_versioned(i, 9), SelectionRequest(str(i)), reg.instances))
            for i in range(3)
        ]
        await until(lambda: loop.status()["queue_len"] == 3, "three requests are queued")
        waiting[1].cancel()
        await asyncio.gather(waiting[1], return_exceptions=True)
        assert loop.status()["queue_len"] == 2
        assert [e["request_id"] for e in loop.queued(9)] == [0, 2]
        for w in waiting:
            w.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)
        await until(lambda: loop.status()["pending_request_num"] == 0, "nothing is pending")
        status = loop.status()
        assert status["queue_len"] == 0 and status["pending_request_num"] == 0 and status["running_tasks"] == 0
        assert all(i.inflight == 0 for i in reg.instances())
    finally:
        await loop.stop()


async def test_more_blocked_requests_than_a_pass_tries_still_let_later_ones_through() -> None:
    reg, loop = _setup(max_attempts_per_pass=4)
    loop.start()
    try:
        blocked = [
            asyncio.ensure_future(loop.acquire(_versioned(i, 5), SelectionRequest(str(i)), reg.instances))
            for i in range(10)
        ]
        await until(lambda: loop.status()["queue_len"] == 10, "ten requests are queued")
        ok = await asyncio.wait_for(loop.acquire(_meta(100), SelectionRequest("100"), reg.instances), 5)
        assert loop.status()["queue_len"] == 10
        loop.finished(ok, success=True)
        for b in blocked:
            b.cancel()
        await asyncio.gather(*blocked, return_exceptions=True)
        assert loop.status()["queue_len"] == 0
    finally:
        await loop.stop()


async def test_a_placement_whose_commit_fails_stays_queued_and_is_placed_again() -> None:
    admission = CountingAdmission()
    admission.commit_errors = [RuntimeError("PSManager refused")]
    reg, loop = _setup(admission)
    loop.start()
    try:
        ticket = await asyncio.wait_for(loop.acquire(_meta(1), SelectionRequest("1"), reg.instances), 5)
        assert admission.calls == ["admit", "on_commit", "admit", "on_commit"]
        assert sum(i.inflight for i in reg.instances()) == 1  # the failed commit was released
        assert loop.status()["active_dispatch_handoffs"] == 1 and loop.status()["running_tasks"] == 1
        loop.finished(ticket, success=True)
    finally:
        await loop.stop()


async def test_an_epoch_change_while_recording_drops_the_placement() -> None:
    admission = CountingAdmission()
    admission.commit_gate = asyncio.Event()
    reg, loop = _setup(admission)
    loop.start()
    try:
        acquire = asyncio.ensure_future(loop.acquire(_meta(1), SelectionRequest("1"), reg.instances))
        await until(lambda: admission.calls == ["admit", "on_commit"], "the placement is being recorded")
        assert loop.status()["active_dispatch_handoffs"] == 1
        pause = asyncio.ensure_future(loop.pause(wait=True))
        await until(lambda: loop.status()["paused"], "the loop is paused")
        assert not pause.done()  # the hand-off of the old epoch is still active
        admission.commit_gate.set()
        await asyncio.wait_for(pause, 2)
        status = loop.status()
        assert not acquire.done() and status["queue_len"] == 1 and status["running_tasks"] == 0
        assert all(i.inflight == 0 for i in reg.instances())  # committed, then released: never dispatched
        loop.resume()
        ticket = await asyncio.wait_for(acquire, 2)
        assert admission.calls.count("on_commit") == 2
        loop.finished(ticket, success=True)
    finally:
        await loop.stop()


async def test_stopping_the_loop_while_recording_releases_the_placement() -> None:
    admission = CountingAdmission()
    admission.commit_gate = asyncio.Event()
    reg, loop = _setup(admission)
    loop.start()
    acquire = asyncio.ensure_future(loop.acquire(_meta(1), SelectionRequest("1"), reg.instances))
    await until(lambda: admission.calls == ["admit", "on_commit"], "the placement is being recorded")
    await loop.stop()
    with pytest.raises(asyncio.CancelledError):
        await acquire
    status = loop.status()
    assert status["active_dispatch_handoffs"] == 0 and status["running_tasks"] == 0
    assert all(i.inflight == 0 for i in reg.instances())


def test_a_discarded_entry_is_skipped_and_counted_out() -> None:
    q = RequestQueue("small_id", partitioned=True)
    a, b, c = _entry(1, version=2), _entry(2, version=2), _entry(3, version=4)
    for e in (a, b, c):
        q.push(e)
    q.discard(b)
    q.discard(b)  # twice is a no-op
    assert len(q) == 2 and q.partition_lens() == {"2": 1, "4": 1}
    assert [e.meta.request_id for e in q.entries()] == [1, 3]
    assert q.pop() is a
    q.push(a, keep_seq=True)
    assert [e.meta.request_id for e in iter(q.pop, None)] == [1, 3]
    assert len(q) == 0 and q.partition_lens() == {}


# ---- partial rollout bookkeeping -------------------------------------------------------------------------


def _gen_input(max_tokens: int | None = 10, logprobs: int | None = 0) -> GenerationInput:
    return GenerationInput("r", [1, 2, 3], SamplingSpec(max_tokens=max_tokens, logprobs=logprobs))


def test_rollout_state_merges_segments_and_rebuilds_the_request() -> None:
    state = RolloutState(_gen_input())
    state.add(Generation([7, 8], [-0.1, -0.2], None, "abort", None, 3, 1), weight_version=4)
    assert classify(Generation(finish_reason="abort"), state) is SegmentEnd.LOOP_BACK
    nxt = state.next_input()
    assert nxt.prompt_ids == [1, 2, 3, 7, 8] and nxt.sampling.max_tokens == 8 and nxt.request_id == "r-r1"
    state.add(Generation([], None, None, "abort"), weight_version=5)  # refused at admission: nothing added
    state.add(Generation([9], [-0.3], None, "length"), weight_version=5)
    merged = state.merged(Generation(finish_reason="length"))
    assert merged.output_ids == [7, 8, 9] and merged.logprobs == [-0.1, -0.2, -0.3]
    assert state.token_versions == [4, 4, 5] and merged.prompt_tokens == 3 and merged.cached_tokens == 1


def test_a_segment_without_logprobs_drops_them_all() -> None:
    state = RolloutState(_gen_input())
    state.add(Generation([7], [-0.1], None, "abort"), 1)
    state.add(Generation([8], None, None, "stop"), 1)
    assert state.merged(Generation(finish_reason="stop")).logprobs is None


def test_budget_and_finish_reasons() -> None:
    state = RolloutState(_gen_input(max_tokens=2))
    state.add(Generation([7, 8], [-1.0, -1.0], None, "abort"), 1)
    assert state.remaining_tokens == 0 and classify(Generation(finish_reason="abort"), state) is SegmentEnd.DONE
    unbounded = RolloutState(_gen_input(max_tokens=None))
    assert unbounded.next_input().sampling.max_tokens is None
    with pytest.raises(UnexpectedFinishReason):
        classify(Generation(finish_reason="error"), state)
