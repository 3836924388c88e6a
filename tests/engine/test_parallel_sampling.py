"""n > 1 in AsyncEngine, as vLLM's parallel sampling: one stream over n choices, seeds, abort, sync pauses."""

from __future__ import annotations

from dataclasses import replace

import pytest

from psrl.engine import (
    AdmissionClosedError,
    AsyncEngine,
    DuplicateRequestError,
    InvalidRequestError,
    InvalidSamplingError,
    PauseMode,
    PreloadedKV,
    RequestOutput,
    SamplingOptions,
)

from .helpers import collect, make_engine, prompts, wait_idle

SAMPLED = SamplingOptions(temperature=1.0, max_tokens=8, ignore_eos=True, logprobs=0)


def by_choice(outs: list[RequestOutput]) -> dict[int, list[int]]:
    ids: dict[int, list[int]] = {}
    for out in outs:
        ids.setdefault(out.index, []).extend(out.new_token_ids)
    return ids


async def test_choices_share_one_stream_and_are_seeded_seed_plus_index(aengine: AsyncEngine) -> None:
    (p,) = prompts([6])
    outs = await collect(aengine.generate("par", p, replace(SAMPLED, n=3, seed=40)))
    assert {o.request_id for o in outs} == {"par"} and sorted({o.index for o in outs}) == [0, 1, 2]
    assert [o.index for o in outs if o.finished] == [0, 1, 2] and outs[-1].finished
    choices = by_choice(outs)
    assert len({tuple(ids) for ids in choices.values()}) == 3  # they differ
    for index, ids in choices.items():  # choice i is what a request seeded seed + i samples (vLLM's rule)
        alone = await collect(aengine.generate(f"one-{index}", p, replace(SAMPLED, seed=40 + index)))
        assert [t for o in alone for t in o.new_token_ids] == ids
    again = by_choice(await collect(aengine.generate("par", p, replace(SAMPLED, n=3, seed=40))))
    assert again == choices  # the id is free again once the request ended, and the seed reproduces it


async def test_unseeded_choices_differ(aengine: AsyncEngine) -> None:
    (p,) = prompts([6])
    choices = by_choice(await collect(aengine.generate("u", p, replace(SAMPLED, n=4, max_tokens=12))))
    assert len({tuple(ids) for ids in choices.values()}) == 4


async def test_abort_of_the_request_ends_every_choice(aengine: AsyncEngine) -> None:
    (p,) = prompts([6])
    stream = aengine.generate("ab", p, replace(SAMPLED, n=2, max_tokens=3000))
    first = [await stream.__anext__(), await stream.__anext__()]
    assert await aengine.abort("ab") is True
    rest = await collect(stream)
    finals = [o for o in first + rest if o.finished]
    assert sorted(o.index for o in finals) == [0, 1] and {o.finish_reason for o in finals} == {"abort"}
    assert await aengine.abort("ab") is False
    await wait_idle(aengine)
    assert aengine.stats().num_used_blocks == 0


async def test_leaving_the_stream_aborts_every_choice(aengine: AsyncEngine) -> None:
    (p,) = prompts([6])
    stream = aengine.generate("gone", p, replace(SAMPLED, n=3, max_tokens=3000))
    await stream.__anext__()
    await stream.aclose()
    await wait_idle(aengine)
    assert aengine.stats().num_running == 0 and aengine.stats().num_used_blocks == 0
    await collect(aengine.generate("gone", p, replace(SAMPLED, n=2)))  # the id is free again


async def test_refusals(aengine: AsyncEngine) -> None:
    (p,) = prompts([6])
    aengine.close_admission("syncing")
    with pytest.raises(AdmissionClosedError):  # before validation, as for n == 1
        aengine.generate("g", p, SamplingOptions(temperature=0.0, n=2))
    aengine.resume()
    with pytest.raises(InvalidSamplingError, match="greedy"):
        aengine.generate("g", p, SamplingOptions(temperature=0.0, n=2))
    with pytest.raises(InvalidRequestError, match="migrated KV"):
        aengine.generate("kv", p, replace(SAMPLED, n=2), kv_pending=True)
    with pytest.raises(InvalidRequestError, match="migrated KV"):
        aengine.generate("kv", p, replace(SAMPLED, n=2), preloaded=PreloadedKV((0,), 3))
    running = aengine.generate("busy", p, replace(SAMPLED, n=2, max_tokens=3000))
    for sampling in (SAMPLED, replace(SAMPLED, n=3)):  # the request's id is taken, whatever its n
        with pytest.raises(DuplicateRequestError):
            aengine.generate("busy", p, sampling)
    single = aengine.generate("single", p, replace(SAMPLED, max_tokens=3000))
    with pytest.raises(DuplicateRequestError):
        aengine.generate("single", p, replace(SAMPLED, n=2))
    for rid, stream in (("busy", running), ("single", single)):
        assert await aengine.abort(rid)
        await collect(stream)
    assert aengine.stats().num_running == 0


async def test_a_sync_abort_ends_every_choice_and_pins_none_of_them() -> None:
    engine = make_engine()
    engine.kv_pin_ttl_s = 30.0
    aengine = AsyncEngine(engine)
    try:
        (p,) = prompts([40])
        parallel = aengine.generate("par", p, replace(SAMPLED, n=2, max_tokens=3000))
        single = aengine.generate("one", p, replace(SAMPLED, max_tokens=3000))
        await parallel.__anext__()
        await single.__anext__()
        aborted = await aengine.pause(PauseMode.ABORT)
        assert sorted(a.request_id for a in aborted) == ["0_par", "1_par", "one"]
        finals = [o for o in await collect(parallel) if o.finished]
        assert sorted(o.index for o in finals) == [0, 1] and {o.finish_reason for o in finals} == {"abort"}
        assert (await collect(single))[-1].finish_reason == "abort"
        assert engine.num_pinned == 1  # only the n == 1 request: KV migration moves whole requests
        assert engine.lease_kv("0_par", p, allow_prefix_cache=False) is None
        assert engine.unpin_kv("one")
    finally:
        aengine.shutdown()
