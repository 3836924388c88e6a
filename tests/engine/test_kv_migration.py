"""The engine side of KV migration: pins on a sync abort, leases for a transfer, migrated KV that skips prefill,
and requests held until their KV lands. Blocks move with psrl.kv's gather/scatter, in process."""

from __future__ import annotations

import time

import pytest

from psrl.engine import Engine, InvalidRequestError, OutOfBlocks, PreloadedKV
from psrl.kv import gather_blocks, scatter_blocks

from .helpers import drain, greedy, make_engine, prompts


def _interrupted(engine: Engine, rid: str, prompt: list[int], steps: int) -> list[int]:
    """Run `rid` for `steps` steps, then a sync abort; returns prompt + everything it produced."""
    engine.add_request(rid, prompt, greedy(200, logprobs=0, ignore_eos=True))
    out: list[int] = []
    for _ in range(steps):
        for o in engine.step():
            out += o.new_token_ids
    engine.close_admission("sync")
    [aborted] = engine.abort_all_for_sync()
    engine.step()  # hands out the abort output
    engine.open_admission()
    assert list(aborted.output_token_ids) == out
    return prompt + out


def _move(src: Engine, dst: Engine, rid: str, tokens: list[int]) -> PreloadedKV:
    lease = src.lease_kv(rid, tokens, allow_prefix_cache=False)
    assert lease is not None and lease.source == "pin"
    buffer = gather_blocks(src.kv_cache.layers, list(lease.block_ids))
    src.release_blocks(lease.block_ids)
    ids = dst.reserve_blocks(lease.num_tokens)
    scatter_blocks(buffer, dst.kv_cache.layers, ids)
    return PreloadedKV(tuple(ids), lease.num_tokens)


def test_migrated_kv_continues_exactly_and_skips_prefill() -> None:
    [prompt] = prompts([150], seed=5)
    reference = make_engine()
    reference.add_request("r", prompt, greedy(200, logprobs=0, ignore_eos=True))
    expected = drain(reference)["r"]

    src, dst = make_engine(), make_engine()
    src.kv_pin_ttl_s = 30.0
    tokens = _interrupted(src, "r", prompt, steps=40)
    assert src.num_pinned == 1
    kv = _move(src, dst, "r", tokens)
    assert kv.num_tokens == len(tokens) - 1  # all but the last sampled token, which was never computed
    before = dst.num_prompt_tokens_computed
    dst.add_request("r", tokens, greedy(200 - (len(tokens) - len(prompt)), logprobs=0, ignore_eos=True), preloaded=kv)
    got = drain(dst)["r"]
    assert tokens[len(prompt) :] + got.token_ids == expected.token_ids
    assert got.last is not None and got.last.num_cached_tokens == kv.num_tokens
    assert dst.num_prompt_tokens_computed - before == 1  # only the last prompt token was computed
    assert src.unpin_kv("r") and not src.unpin_kv("r") and src.num_pinned == 0
    assert src.num_used_blocks == 0 and dst.num_used_blocks == 0


def test_pins_expire_and_end_when_the_request_returns() -> None:
    [prompt] = prompts([40], seed=2)
    engine = make_engine()
    engine.kv_pin_ttl_s = 0.05
    tokens = _interrupted(engine, "r", prompt, steps=5)
    used = engine.num_used_blocks
    assert used > 0 and engine.num_pinned == 1
    time.sleep(0.06)
    assert engine.lease_kv("r", tokens, allow_prefix_cache=False) is None  # expired: nothing to lend
    assert engine.num_pinned == 0 and engine.num_used_blocks == 0
    engine.kv_pin_ttl_s = 30.0
    tokens = _interrupted(engine, "r2", prompt, steps=5)
    engine.add_request("r2", tokens, greedy(3))  # back on the same engine: the pin is not needed any more
    assert engine.num_pinned == 0
    drain(engine)


def test_lease_serves_the_matching_prefix_and_the_prefix_cache() -> None:
    [prompt] = prompts([64], seed=3)
    engine = make_engine()
    engine.kv_pin_ttl_s = 30.0
    tokens = _interrupted(engine, "r", prompt, steps=10)
    diverged = [*tokens[:20], (tokens[20] + 1) % 256, *tokens[21:]]
    lease = engine.lease_kv("r", diverged, allow_prefix_cache=False)
    assert lease is not None and lease.num_tokens == 20 and len(lease.block_ids) == 2  # a partial last block
    engine.release_blocks(lease.block_ids)
    engine.unpin_kv("r")
    assert engine.lease_kv("r", tokens, allow_prefix_cache=False) is None
    cached = engine.lease_kv("r", tokens, allow_prefix_cache=True)  # the abort left full blocks in the cache
    assert cached is not None and cached.source == "prefix_cache" and cached.num_tokens % 16 == 0
    assert cached.num_tokens >= 64
    engine.release_blocks(cached.block_ids)


def test_a_held_request_waits_for_its_kv_and_falls_back_to_prefill() -> None:
    [prompt] = prompts([100], seed=7)
    reference = make_engine()
    reference.add_request("r", prompt, greedy(12))
    expected = drain(reference)["r"].token_ids
    src, dst = make_engine(), make_engine()
    src.kv_pin_ttl_s = 30.0
    tokens = _interrupted(src, "r", prompt, steps=1)
    rest = greedy(12 - (len(tokens) - len(prompt)))
    dst.add_request("r", tokens, rest, kv_pending=True)
    assert dst.num_waiting == 1 and not dst.has_unfinished_requests()  # held: nothing to step
    assert dst.attach_kv("r", _move(src, dst, "r", tokens))
    assert tokens[len(prompt) :] + drain(dst)["r"].token_ids == expected
    # no KV after all (a failed pull): prefilled instead, same output
    dst.add_request("r", tokens, rest, kv_pending=True)
    assert dst.attach_kv("r", None) and not dst.attach_kv("r", None)
    assert tokens[len(prompt) :] + drain(dst)["r"].token_ids == expected
    # aborted while held: attach reports it, the caller keeps its blocks
    dst.add_request("gone", tokens, rest, kv_pending=True)
    assert dst.abort("gone")
    ids = dst.reserve_blocks(16)
    assert not dst.attach_kv("gone", PreloadedKV(tuple(ids), 16))
    dst.release_blocks(ids)
    drain(dst)
    assert dst.num_used_blocks == 0


def test_bad_preloaded_kv_and_no_room() -> None:
    engine = make_engine(num_blocks=4)
    with pytest.raises(InvalidRequestError, match="last token"):
        engine.add_request("a", [1, 2, 3], greedy(2), preloaded=PreloadedKV((0,), 3))
    with pytest.raises(InvalidRequestError, match="blocks for"):
        engine.add_request("a", list(range(40)), greedy(2), preloaded=PreloadedKV((0,), 20))
    with pytest.raises(OutOfBlocks):
        engine.reserve_blocks(5 * 16)
    with pytest.raises(InvalidRequestError, match="not running"):
        engine.pin_kv("nope", 1.0)


def test_a_request_back_on_its_engine_adopts_its_pin_without_a_copy() -> None:
    [prompt] = prompts([70], seed=11)
    reference = make_engine()
    reference.add_request("r", prompt, greedy(30))
    expected = drain(reference)["r"].token_ids
    engine = make_engine()
    engine.kv_pin_ttl_s = 30.0
    tokens = _interrupted(engine, "r", prompt, steps=8)
    kv = engine.adopt_pin("r", tokens, len(tokens) - 1)
    assert kv is not None and kv.num_tokens == len(tokens) - 1 and engine.num_pinned == 0
    engine.add_request("r-1", tokens, greedy(30 - (len(tokens) - len(prompt))), preloaded=kv)
    assert tokens[len(prompt) :] + drain(engine)["r-1"].token_ids == expected
    assert engine.num_used_blocks == 0
    assert engine.adopt_pin("r", tokens, 10) is None


def test_waiting_requests_with_migrated_kv_cannot_starve_each_other() -> None:
    # 8 blocks of 16: two migrated requests of 65 tokens (64 moved) hold all 8; each needs one more to run.
    [p1, p2] = prompts([65, 65], seed=13)
    engine = make_engine(num_blocks=8)
    for rid, p in (("a", p1), ("b", p2)):
        ids = engine.reserve_blocks(64)
        engine.add_request(rid, p, greedy(4), preloaded=PreloadedKV(tuple(ids), 64))
    assert engine.num_used_blocks == 8
    out = drain(engine, max_steps=200)  # the second one gives its KV back and is prefilled instead
    assert {rid: len(c.token_ids) for rid, c in out.items()} == {"a": 4, "b": 4}
    assert engine.num_used_blocks == 0


def test_pins_are_given_back_before_anything_waits_or_is_preempted() -> None:
    engine = make_engine(num_blocks=8)
    engine.kv_pin_ttl_s = 3600.0
    [p] = prompts([90], seed=17)
    engine.add_request("r", p, greedy(10))
    engine.step()
    engine.step()
    engine.abort_all_for_sync()  # the pin holds the 6 blocks of its 91 computed tokens
    engine.step()
    assert engine.num_pinned == 1 and engine.num_used_blocks == 6
    [q] = prompts([100], seed=19)
    engine.add_request("q", q, greedy(8))  # needs 7 blocks: only the pin's can make room
    assert len(drain(engine, max_steps=200)["q"].token_ids) == 8
    assert engine.num_pinned == 0 and engine.num_used_blocks == 0


def test_adopting_a_pin_never_writes_into_a_block_others_read() -> None:
    [prompt] = prompts([40], seed=23)
    engine = make_engine()
    engine.kv_pin_ttl_s = 30.0
    tokens = _interrupted(engine, "r", prompt, steps=4)  # 43 tokens: blocks 0-1 full (cached), block 2 partial
    diverged = [*tokens[:20], (tokens[20] + 1) % 256, *tokens[21:]]  # diverges inside full, cached block 1
    kv = engine.adopt_pin("r", diverged, len(diverged) - 1)
    assert kv is not None and kv.num_tokens == 16 and len(kv.block_ids) == 1  # rounded down to block 0
    engine.release_blocks(kv.block_ids)
    assert engine.num_used_blocks == 0


def test_kv_for_other_tokens_is_refused() -> None:
    engine = make_engine()
    ids = engine.reserve_blocks(20)
    kv = PreloadedKV(tuple(ids), 20, tuple(range(20)))
    with pytest.raises(InvalidRequestError, match="other tokens"):
        engine.add_request("a", [*range(1, 21), 5, 6], greedy(2), preloaded=kv)
    engine.add_request("b", [*range(20), 5, 6], greedy(2), kv_pending=True)  # a held request checks on attach
    with pytest.raises(InvalidRequestError, match="other tokens"):
        engine.attach_kv("b", PreloadedKV(tuple(ids), 20, tuple(range(1, 21))))
    assert engine.attach_kv("b", kv)
    drain(engine)
    assert engine.num_used_blocks == 0


def test_blocks_of_a_request_aborted_during_a_forward_are_freed_after_it() -> None:
    """reserve_blocks runs outside a step: it must never get blocks the forward in flight still writes."""
    engine = make_engine(num_blocks=8)
    [p] = prompts([40], seed=29)
    engine.add_request("r", p, greedy(4))
    engine.step()
    written = set(engine.get_block_ids("r") or [])
    assert len(written) == 3
    engine._kv.begin_forward()  # as step() does before the forward (white-box: the race is timing-bound)
    assert engine.abort("r")
    with pytest.raises(OutOfBlocks):
        engine.reserve_blocks(6 * 16)  # its 3 blocks are not free yet: only the 5 nobody writes are
    engine._kv.end_forward()  # the forward ended: its blocks are free now
    ids = engine.reserve_blocks(6 * 16)
    assert written & set(ids)
    engine.release_blocks(ids)
    assert engine.num_used_blocks == 0
