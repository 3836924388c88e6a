"""AsyncEngine KV-event subscriptions: snapshot first, then live updates; several subscribers; no leaks."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from _wait import until

from psrl.engine import (
    AllBlocksCleared,
    AsyncEngine,
    BlocksStored,
    EngineDeadError,
    KvEventsOverflowError,
    KvEventStream,
    KvEventsUpdate,
)

from .helpers import CacheState, apply, greedy, make_engine, prompts

PROMPT = prompts([40], seed=21)[0]


@pytest.fixture
def aengine() -> Iterator[AsyncEngine]:
    engine = AsyncEngine(make_engine())
    yield engine
    engine.shutdown()


async def next_update(stream: KvEventStream) -> KvEventsUpdate:
    return await asyncio.wait_for(stream.__anext__(), 10)


async def generate(aengine: AsyncEngine, rid: str, prompt: list[int], max_tokens: int = 4) -> None:
    async for _ in aengine.generate(rid, prompt, greedy(max_tokens)):
        pass


async def test_snapshot_first_then_live_events_and_late_joiners_get_the_state(aengine: AsyncEngine) -> None:
    assert not aengine.engine.kv_events_enabled
    early = aengine.subscribe_kv_events()
    assert aengine.engine.kv_events_enabled and aengine.num_kv_subscribers == 1
    first = await next_update(early)
    assert first.is_snapshot and first.events == (AllBlocksCleared(),)

    await generate(aengine, "a", PROMPT)
    state: CacheState = {}
    while len(state) < 2:  # events of a's prefill: blocks 0 and 1
        update = await next_update(early)
        assert not update.is_snapshot
        apply(state, list(update.events))

    late = aengine.subscribe_kv_events()
    snap = await next_update(late)
    assert snap.is_snapshot and snap.events[0] == AllBlocksCleared()
    rebuilt: CacheState = {}
    apply(rebuilt, list(snap.events))
    assert rebuilt == state

    await generate(aengine, "b", [*PROMPT[:32], 1, 2, 3, 4, 5])  # hits 2 blocks, stores nothing new
    aengine.reset_prefix_cache()  # published at once, even with the engine idle
    for stream in (early, late):
        events = []
        while AllBlocksCleared() not in events:
            events.extend((await next_update(stream)).events)
        assert events == [AllBlocksCleared()]

    early.close()
    assert aengine.num_kv_subscribers == 1 and aengine.engine.kv_events_enabled
    await late.aclose()
    assert aengine.num_kv_subscribers == 0 and not aengine.engine.kv_events_enabled
    with pytest.raises(StopAsyncIteration):
        await late.__anext__()


async def test_a_cancelled_reader_unsubscribes(aengine: AsyncEngine) -> None:
    stream = aengine.subscribe_kv_events()
    await next_update(stream)
    reader = asyncio.create_task(stream.__anext__())
    await asyncio.sleep(0)  # one turn of the loop: the reader runs until it waits on the empty stream
    reader.cancel()
    with pytest.raises(asyncio.CancelledError):
        await reader
    assert stream.closed and aengine.num_kv_subscribers == 0


async def test_a_subscriber_that_falls_behind_is_dropped(aengine: AsyncEngine) -> None:
    stream = aengine.subscribe_kv_events(max_pending=1)  # the snapshot fills it
    await generate(aengine, "a", PROMPT, max_tokens=30)  # several steps store blocks
    await until(lambda: aengine.num_kv_subscribers == 0, "the stream that fell behind is unsubscribed")
    with pytest.raises(KvEventsOverflowError):
        await next_update(stream)
    assert aengine.num_kv_subscribers == 0 and not aengine.engine.kv_events_enabled


async def test_shutdown_ends_subscriptions() -> None:
    aengine = AsyncEngine(make_engine())
    stream = aengine.subscribe_kv_events()
    assert (await next_update(stream)).is_snapshot
    aengine.shutdown()
    with pytest.raises(EngineDeadError):
        await next_update(stream)
    with pytest.raises(EngineDeadError):
        aengine.subscribe_kv_events()


async def test_weight_swap_publishes_a_clear(aengine: AsyncEngine) -> None:
    await generate(aengine, "a", PROMPT)
    stream = aengine.subscribe_kv_events()
    snap = await next_update(stream)
    assert sum(len(e.blocks) for e in snap.events if isinstance(e, BlocksStored)) == 2
    await aengine.load_weights(seed=1, version=1)
    assert (await next_update(stream)).events == (AllBlocksCleared(),)
    stream.close()
