"""Weight-sync support in the engine: admission, freeze, abort-all with its hook, and AsyncEngine.pause modes."""

from __future__ import annotations

import asyncio

import pytest
from _wait import until

from psrl.engine import (
    AdmissionClosedError,
    AsyncEngine,
    EngineDeadError,
    PauseMode,
    RequestOutput,
    SamplingOptions,
    SyncAbortedRequest,
)

from .helpers import collect, drain, greedy, make_engine, prompts, run, step_thread_parked


def ids(outs: list[RequestOutput]) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def long_run(n: int = 3000) -> SamplingOptions:
    return SamplingOptions(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=0)


# ---- the sync engine ------------------------------------------------------------------------------


def test_closed_admission_refuses_before_validation_and_reopens() -> None:
    engine = make_engine()
    engine.close_admission("syncing")
    assert engine.admission_closed_reason == "syncing"
    with pytest.raises(AdmissionClosedError, match="syncing") as err:
        engine.add_request("a", [], greedy())  # an empty prompt would be a ValueError if admitted
    assert err.value.code == "admission_closed" and not isinstance(err.value, ValueError)
    engine.open_admission()
    engine.add_request("a", [1, 2, 3], greedy(4))
    assert drain(engine)["a"].finish_reason == "length"


def test_frozen_engine_keeps_requests_and_continues_exactly() -> None:
    reqs = {f"r{i}": (p, greedy(20, logprobs=0)) for i, p in enumerate(prompts([5, 21, 40]))}
    expected = run(make_engine(), reqs)
    engine = make_engine()
    for rid, (p, s) in reqs.items():
        engine.add_request(rid, p, s)
    collected = {}
    for _ in range(5):
        for out in engine.step():
            collected.setdefault(out.request_id, []).append(out)
    engine.freeze()
    assert engine.frozen and not engine.has_unfinished_requests()
    used = engine.num_used_blocks
    assert engine.step() == [] and engine.num_used_blocks == used and engine.num_running == 3
    assert engine.abort("r0")  # an abort while frozen is still handed out
    assert engine.has_unfinished_requests()
    (out,) = engine.step()
    assert out.request_id == "r0" and out.finish_reason == "abort"
    engine.unfreeze()
    while engine.has_unfinished_requests():
        for out in engine.step():
            collected.setdefault(out.request_id, []).append(out)
    for rid in ("r1", "r2"):
        assert ids(collected[rid]) == expected[rid].token_ids
        assert [lp for o in collected[rid] for lp in (o.new_logprobs or [])] == expected[rid].logprobs


def test_abort_all_for_sync_reports_each_request_and_calls_the_hook_before_freeing() -> None:
    engine = make_engine(max_num_seqs=2)
    p = prompts([20, 20, 20], seed=3)
    for i, prompt in enumerate(p):
        engine.add_request(f"r{i}", prompt, greedy(50))
    produced: dict[str, list[int]] = {}
    for _ in range(4):
        for out in engine.step():
            produced.setdefault(out.request_id, []).extend(out.new_token_ids)
    seen: list[tuple[SyncAbortedRequest, int]] = []
    engine.on_sync_abort = lambda req: seen.append((req, engine.num_used_blocks))
    aborted = engine.abort_all_for_sync()
    assert [a.request_id for a in aborted] == ["r0", "r1", "r2"]  # running first, then waiting
    assert [s for s, _ in seen] == aborted
    for a in aborted[:2]:
        assert list(a.output_token_ids) == produced[a.request_id] and len(a.output_token_ids) == 4
        assert a.num_computed_tokens == len(a.token_ids) - 1 and a.block_ids
    assert aborted[2].output_token_ids == () and aborted[2].block_ids == ()
    assert seen[0][1] > 0  # the hook ran while the blocks were still held
    assert engine.num_used_blocks == 0 and engine.num_running == engine.num_waiting == 0
    outs = engine.step()
    assert sorted(o.request_id for o in outs) == ["r0", "r1", "r2"]
    assert all(o.finish_reason == "abort" and o.new_token_ids == [] for o in outs)


def test_build_then_swap_weights_is_load_weights() -> None:
    (p,) = prompts([9])
    engine, reference = make_engine(), make_engine()
    reference.load_weights(seed=5, version=2)
    model = engine.build_weights(seed=5)
    assert engine.weight_version == 0  # nothing swapped yet
    engine.swap_weights(model, version=2)
    assert engine.weight_version == 2
    want = run(reference, {"a": (p, greedy(10))})["a"].token_ids
    assert run(engine, {"a": (p, greedy(10))})["a"].token_ids == want


# ---- AsyncEngine.pause ---------------------------------------------------------------------------


async def test_pause_abort_ends_streams_with_what_they_produced(aengine: AsyncEngine) -> None:
    p = prompts([7, 30])
    streams = [aengine.generate(f"r{i}", prompt, long_run()) for i, prompt in enumerate(p)]
    firsts = [await s.__anext__() for s in streams]
    aborted = await aengine.pause(PauseMode.ABORT)
    assert aengine.paused and not aengine.engine.has_unfinished_requests()
    assert sorted(a.request_id for a in aborted) == ["r0", "r1"]
    for first, stream, a in zip(firsts, streams, sorted(aborted, key=lambda a: a.request_id)):
        rest = await asyncio.wait_for(collect(stream), 5)
        got = ids([first, *rest])
        assert rest[-1].finish_reason == "abort" and rest[-1].new_token_ids == []
        assert got == list(a.output_token_ids)
    assert aengine.stats().num_running == 0


async def test_pause_refuses_new_requests_until_resume(aengine: AsyncEngine) -> None:
    await aengine.pause(PauseMode.ABORT, reason="sync 3")
    with pytest.raises(AdmissionClosedError, match="sync 3"):
        aengine.generate("a", [1, 2, 3], greedy())
    assert aengine.admission_closed_reason == "sync 3"
    aengine.resume()
    assert not aengine.paused and aengine.admission_closed_reason is None
    outs = await collect(aengine.generate("a", [1, 2, 3], greedy(5)))
    assert outs[-1].finish_reason == "length" and outs[-1].num_output_tokens == 5


async def test_pause_wait_returns_once_requests_finished(aengine: AsyncEngine) -> None:
    stream = aengine.generate("a", [4, 5, 6], long_run(300))
    first = await stream.__anext__()
    assert await aengine.pause(PauseMode.WAIT) == []
    assert aengine.paused and aengine.stats().num_running == 0
    rest = await asyncio.wait_for(collect(stream), 5)  # already queued
    assert rest[-1].finish_reason == "length" and len(ids([first, *rest])) == 300


async def test_pause_keep_freezes_and_resumes_the_same_tokens(aengine: AsyncEngine) -> None:
    (p,) = prompts([11])
    expected = run(make_engine(), {"a": (p, long_run(200))})["a"].token_ids
    stream = aengine.generate("a", p, long_run(200))
    outs = [await stream.__anext__()]
    assert await aengine.pause(PauseMode.KEEP, clear_cache=True) == []
    assert aengine.paused
    frozen_at = aengine.engine.num_running, aengine.stats().num_used_blocks
    while not stream._queue.empty():  # what the last step before the pause produced
        outs.append(await stream.__anext__())
    produced = len(ids(outs))
    assert step_thread_parked(aengine)  # frozen: the running request gives it nothing to run
    assert stream._queue.empty() and (aengine.engine.num_running, aengine.stats().num_used_blocks) == frozen_at
    assert produced < 200
    aengine.resume()
    outs += await asyncio.wait_for(collect(stream), 10)
    assert ids(outs) == expected and outs[-1].finish_reason == "length"


async def test_pause_wait_after_keep_lets_frozen_requests_finish(aengine: AsyncEngine) -> None:
    stream = aengine.generate("a", [1, 2], long_run(100))
    await stream.__anext__()
    await aengine.pause(PauseMode.KEEP)
    await asyncio.wait_for(aengine.pause(PauseMode.WAIT), 10)
    outs = await collect(stream)
    assert outs[-1].finish_reason == "length" and aengine.paused


async def test_pause_abort_after_keep_aborts_the_frozen_requests(aengine: AsyncEngine) -> None:
    stream = aengine.generate("a", [1, 2], long_run())
    await stream.__anext__()
    await aengine.pause(PauseMode.KEEP)
    (aborted,) = await aengine.pause(PauseMode.ABORT)
    assert aborted.request_id == "a"
    outs = await asyncio.wait_for(collect(stream), 5)
    assert outs[-1].finish_reason == "abort"


async def test_weights_swap_while_paused_apply_after_resume(aengine: AsyncEngine) -> None:
    (p,) = prompts([9])
    before = ids(await collect(aengine.generate("a", p, greedy(10))))
    await aengine.pause(PauseMode.ABORT)
    model = await aengine.prepare_weights(seed=1)
    await aengine.swap_weights(model, version=4)
    assert aengine.weight_version == 4 and aengine.paused
    aengine.resume()
    after = ids(await collect(aengine.generate("b", p, greedy(10))))
    assert after != before


async def test_pause_on_a_shut_down_engine_raises() -> None:
    aengine = AsyncEngine(make_engine())
    aengine.shutdown()
    with pytest.raises(EngineDeadError):
        await aengine.pause(PauseMode.KEEP)


async def test_cancelled_pause_leaves_admission_closed(aengine: AsyncEngine) -> None:
    stream = aengine.generate("a", [1, 2], long_run())
    await stream.__anext__()
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(aengine.pause(PauseMode.WAIT), 0.05)
    assert aengine._idle_waiters == []
    with pytest.raises(AdmissionClosedError):
        aengine.generate("b", [1], greedy())
    await aengine.pause(PauseMode.ABORT)
    assert (await collect(stream))[-1].finish_reason == "abort"


async def test_pause_wait_waits_for_a_request_held_for_its_kv(aengine: AsyncEngine) -> None:
    stream = aengine.generate("held", [1, 2, 3], greedy(3), kv_pending=True)  # its KV is being pulled
    pause = asyncio.ensure_future(aengine.pause(PauseMode.WAIT))

    def pause_waits_on_an_idle_engine() -> bool:
        # A waiter registered while the step thread sits idle (its going idle takes every waiter): the pause
        # saw the idle engine and still waits, as the held request has not run yet.
        with aengine._wake:
            return aengine._idle and bool(aengine._idle_waiters)

    await until(pause_waits_on_an_idle_engine, "the pause waits on an idle engine")
    assert not pause.done()  # the WAIT pause must not pass the held request by
    assert aengine.attach_kv("held", None)  # the pull ended without KV: it is prefilled
    assert await asyncio.wait_for(pause, 10) == []
    outs = await collect(stream)
    assert outs[-1].finish_reason == "length" and aengine.paused
