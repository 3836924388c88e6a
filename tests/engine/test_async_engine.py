"""AsyncEngine: concurrent streams, abort, cancellation, failures, weight swaps, shutdown."""

from __future__ import annotations

import asyncio

import pytest
from _wait import until

from psrl.engine import (
    AsyncEngine,
    DuplicateRequestError,
    EmptyPromptError,
    EngineDeadError,
    EngineStepError,
    SamplingOptions,
)

from .helpers import collect, greedy, make_engine, prompts, run, step_thread_parked, wait_idle


async def test_concurrent_generates_match_the_sync_engine(aengine: AsyncEngine) -> None:
    reqs = {f"r{i}": (p, greedy(12, logprobs=0)) for i, p in enumerate(prompts([3, 17, 1, 33, 8, 16, 50, 5]))}
    expected = run(make_engine(), reqs)
    streams = {rid: aengine.generate(rid, p, s) for rid, (p, s) in reqs.items()}
    results = await asyncio.gather(*(collect(s) for s in streams.values()))
    for rid, outs in zip(streams, results):
        assert [t for o in outs for t in o.new_token_ids] == expected[rid].token_ids
        assert [lp for o in outs for lp in (o.new_logprobs or [])] == expected[rid].logprobs
        assert outs[-1].finish_reason == "length" and all(not o.finished for o in outs[:-1])
    assert aengine.stats().num_running == 0


async def test_validation_errors_raise_at_call_time(aengine: AsyncEngine) -> None:
    with pytest.raises(EmptyPromptError):
        aengine.generate("a", [], greedy())
    stream = aengine.generate("a", [1, 2, 3], greedy(200))
    with pytest.raises(DuplicateRequestError):
        aengine.generate("a", [1, 2, 3], greedy())
    assert await aengine.abort("a")
    outs = await collect(stream)
    assert outs[-1].finish_reason == "abort"


async def test_abort_ends_the_stream_with_abort(aengine: AsyncEngine) -> None:
    (p,) = prompts([5])
    stream = aengine.generate("a", p, SamplingOptions(temperature=0.0, max_tokens=2000, ignore_eos=True))
    got = [await stream.__anext__(), await stream.__anext__()]
    assert await aengine.abort("a") is True
    rest = await collect(stream)
    assert rest[-1].finish_reason == "abort" and rest[-1].new_token_ids == []
    produced = sum(len(o.new_token_ids) for o in got + rest)
    assert rest[-1].num_output_tokens == produced < 2000
    assert await aengine.abort("a") is False
    await wait_idle(aengine)
    assert aengine.stats().num_used_blocks == 0


async def test_cancelling_the_consumer_aborts_the_request(aengine: AsyncEngine) -> None:
    (p,) = prompts([5])
    first = asyncio.Event()

    async def consume() -> None:
        async for _ in aengine.generate("c", p, SamplingOptions(max_tokens=3000, ignore_eos=True)):
            first.set()

    task = asyncio.create_task(consume())
    await first.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await wait_idle(aengine)
    assert aengine.stats().num_running == 0 and aengine.stats().num_used_blocks == 0


async def test_leaving_the_loop_early_aborts_the_request(aengine: AsyncEngine) -> None:
    (p,) = prompts([5])
    async for _ in aengine.generate("b", p, SamplingOptions(max_tokens=3000, ignore_eos=True)):
        break
    await wait_idle(aengine)
    assert aengine.stats().num_used_blocks == 0


async def test_a_failing_step_fails_its_requests_not_the_thread(aengine: AsyncEngine, monkeypatch) -> None:
    model = aengine.engine.model

    def boom(*args: object, **kwargs: object) -> None:
        raise RuntimeError("kaboom")

    monkeypatch.setattr(model, "forward_paged", boom)
    with pytest.raises(EngineStepError, match="kaboom"):
        await collect(aengine.generate("x", [1, 2, 3], greedy()))
    monkeypatch.undo()
    assert aengine.is_alive()
    outs = await collect(aengine.generate("y", [1, 2, 3], greedy(4)))
    assert outs[-1].finish_reason == "length"


async def test_load_weights_swaps_between_steps(aengine: AsyncEngine) -> None:
    (p,) = prompts([9])
    before = await collect(aengine.generate("a", p, greedy(10)))
    await aengine.load_weights(seed=1, version=7)  # idle: returns once swapped
    assert aengine.weight_version == 7 and aengine.stats().weight_version == 7
    after = await collect(aengine.generate("b", p, greedy(10)))
    assert [o.new_token_ids for o in after] != [o.new_token_ids for o in before]

    # Under load: the swap lands at a step boundary while a request keeps streaming.
    stream = aengine.generate("c", p, SamplingOptions(max_tokens=300, ignore_eos=True))
    await stream.__anext__()
    await aengine.load_weights(seed=0, version=8)
    assert aengine.weight_version == 8
    outs = await collect(stream)
    assert outs[-1].finish_reason == "length"


async def test_idle_engine_does_not_step(aengine: AsyncEngine) -> None:
    calls = 0
    real_step = aengine.engine.step

    def counting_step():
        nonlocal calls
        calls += 1
        return real_step()

    aengine.engine.step = counting_step  # type: ignore[method-assign]
    await collect(aengine.generate("a", [1, 2], greedy(3)))
    await until(lambda: step_thread_parked(aengine), "the step thread waits for work")
    assert calls == 3  # one step per token, none once the request ended


async def test_shutdown_ends_open_streams() -> None:
    aengine = AsyncEngine(make_engine())
    stream = aengine.generate("a", [1, 2, 3], SamplingOptions(max_tokens=3000, ignore_eos=True))
    await stream.__anext__()
    aengine.shutdown()
    assert not aengine.is_alive()
    with pytest.raises(EngineDeadError):
        await collect(stream)
    with pytest.raises(EngineDeadError):
        aengine.generate("b", [1], greedy())


async def test_dropping_an_old_stream_does_not_abort_a_newer_request_with_its_id(aengine: AsyncEngine) -> None:
    (p,) = prompts([4])
    old = aengine.generate("r", p, greedy(2))
    await wait_idle(aengine)  # finished, but its outputs were never read
    new = aengine.generate("r", p, greedy(30))
    del old
    outs = await collect(new)
    assert outs[-1].finish_reason == "length" and outs[-1].num_output_tokens == 30
