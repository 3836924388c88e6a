"""Automatic prefix caching in the engine: hits, exactness against caching off, sharing, eviction, reset, events."""

from __future__ import annotations

import pytest

from psrl.engine import AllBlocksCleared, BlocksRemoved, BlocksStored, Engine, SamplingOptions, hash_block_tokens

from .helpers import CacheState, Collected, apply, drain, greedy, make_engine, prompts, run

Requests = dict[str, tuple[list[int], SamplingOptions]]


def assert_same_outputs(got: dict[str, Collected], want: dict[str, Collected]) -> None:
    assert got.keys() == want.keys()
    for rid in want:
        assert got[rid].token_ids == want[rid].token_ids, rid
        assert got[rid].logprobs == pytest.approx(want[rid].logprobs, abs=1e-5), rid
        assert got[rid].finish_reason == want[rid].finish_reason, rid


def run_in_order(engine: Engine, reqs: Requests) -> dict[str, Collected]:
    """One request after another, so that each can hit what the earlier ones cached."""
    out: dict[str, Collected] = {}
    for rid, req in reqs.items():
        out.update(run(engine, {rid: req}))
    return out


def no_cache() -> Engine:
    return make_engine(enable_prefix_caching=False)


def cached_tokens(out: Collected) -> int:
    assert out.last is not None
    return out.last.num_cached_tokens


BASE = prompts([80], seed=5)[0]


def test_a_shared_prefix_is_served_from_the_cache_with_identical_outputs() -> None:
    reqs: Requests = {
        "a": ([*BASE[:50], 1, 2, 3], greedy(20, logprobs=2)),
        "b": ([*BASE[:50], 9, 8, 7, 6], greedy(20, logprobs=2)),  # shares 3 full blocks with a
        "c": (BASE[:20], greedy(5, logprobs=0)),  # shares 1 block
    }
    engine = make_engine()
    got = run_in_order(engine, reqs)
    # The next turn of a: its prompt is a's prompt and output, whose blocks (output included) are cached.
    reqs["d"] = (reqs["a"][0] + got["a"].token_ids[:15] + [5], greedy(30, logprobs=0))
    got.update(run(engine, {"d": reqs["d"]}))
    assert_same_outputs(got, run_in_order(no_cache(), reqs))
    assert [cached_tokens(got[r]) for r in "abcd"] == [0, 48, 16, 64]
    assert all(top[0][0] == t for t, top in zip(got["b"].token_ids, got["b"].top_logprobs))
    stats = engine.stats()
    assert stats.prefix_caching and stats.prefix_cache_hits == 48 + 16 + 64
    assert stats.prefix_cache_queries == sum(len(p) for p, _ in reqs.values())
    assert stats.num_used_blocks == 0 and stats.num_cached_blocks > 0


def test_a_fully_cached_prompt_still_computes_its_last_token() -> None:
    reqs: Requests = {"first": (BASE[:32], greedy(6, logprobs=0)), "again": (BASE[:32], greedy(6, logprobs=0))}
    got = run_in_order(make_engine(), reqs)
    assert cached_tokens(got["again"]) == 16  # not 32: the last block is recomputed for its logits
    assert got["again"].token_ids == got["first"].token_ids
    off = run_in_order(no_cache(), reqs)
    assert_same_outputs(got, off)
    assert cached_tokens(off["again"]) == 0


def test_concurrent_requests_share_blocks_by_reference() -> None:
    engine = make_engine()
    a = BASE[:40]
    b = [*BASE[:36], 7, 7, 7]
    engine.add_request("a", a, greedy(30))
    collected = {"a": Collected()}
    for out in engine.step():  # a's prefill caches its first two blocks
        collected[out.request_id].add(out)
    engine.add_request("b", b, greedy(30))
    collected["b"] = Collected()
    for out in engine.step():
        collected[out.request_id].add(out)
    blocks_a, blocks_b = engine.get_block_ids("a"), engine.get_block_ids("b")
    assert blocks_a is not None and blocks_b is not None
    assert blocks_a[:2] == blocks_b[:2] and not set(blocks_a[2:]) & set(blocks_b[2:])
    assert engine.num_used_blocks == len(set(blocks_a) | set(blocks_b))  # shared blocks count once

    assert engine.abort("a")  # b still holds the shared blocks
    assert engine.num_used_blocks == len(blocks_b)
    drain(engine, collected)
    assert collected["b"].last is not None and collected["b"].last.num_cached_tokens == 32
    assert engine.num_used_blocks == 0 and engine.num_cached_blocks >= 2

    alone = run(no_cache(), {"b": (b, greedy(30))})
    assert collected["b"].token_ids == alone["b"].token_ids


def test_lru_eviction_under_a_small_cache() -> None:
    engine = make_engine(block_size=4, num_blocks=8)
    engine.kv_events_enabled = True
    p1, p2, p3 = prompts([12, 12, 12], seed=11)
    one = greedy(1)  # prefill only: 3 full blocks cached per prompt
    run(engine, {"p1": (p1, one)})
    run(engine, {"p2": (p2, one)})  # 6 of 8 blocks cached, 2 never used
    assert engine.num_cached_blocks == 6
    engine.drain_kv_events()
    run(engine, {"p3": (p3, one)})  # takes the 2 fresh blocks, then evicts p1's tail block
    removed = [e for e in engine.drain_kv_events() if isinstance(e, BlocksRemoved)]
    h0 = hash_block_tokens(None, p1[:4])
    h1 = hash_block_tokens(h0, p1[4:8])
    assert removed == [BlocksRemoved((hash_block_tokens(h1, p1[8:12]),))]
    again = run(engine, {"p1-again": (p1, greedy(4))})["p1-again"]
    assert cached_tokens(again) == 8
    assert again.token_ids == run(no_cache(), {"p1": (p1, greedy(4))})["p1"].token_ids
    assert engine.num_cached_blocks <= 8 and engine.num_used_blocks == 0


def test_reset_prefix_cache_drops_every_block_even_while_requests_run() -> None:
    engine = make_engine()
    engine.kv_events_enabled = True
    reqs: Requests = {"a": (BASE[:40], greedy(40))}
    run(engine, reqs)
    engine.drain_kv_events()
    assert engine.num_cached_blocks == 4  # 40 + 39 computed tokens
    assert engine.reset_prefix_cache() == 4
    assert engine.num_cached_blocks == 0
    assert engine.drain_kv_events() == [AllBlocksCleared()]
    engine.add_request("b", BASE[:40], greedy(40))
    collected = {"b": Collected()}
    for _ in range(2):
        for o in engine.step():
            collected["b"].add(o)
    assert engine.num_cached_blocks == 2  # b's prefill, computed afresh
    assert [type(e) for e in engine.drain_kv_events()] == [BlocksStored]
    assert engine.reset_prefix_cache() == 2
    out = drain(engine, collected)["b"]  # b decodes on; its blocks from before the reset are never cached again
    assert engine.num_cached_blocks == 0
    assert cached_tokens(out) == 0
    assert out.token_ids == run(no_cache(), reqs)["a"].token_ids
    assert engine.drain_kv_events() == [AllBlocksCleared()]  # and nothing stored after it


def test_a_weight_swap_clears_the_cache() -> None:
    engine = make_engine(seed=0)
    reqs: Requests = {"a": (BASE[:40], greedy(10))}
    run(engine, reqs)
    assert engine.num_cached_blocks > 0
    engine.load_weights(seed=1, version=1)
    assert engine.num_cached_blocks == 0
    again = run(engine, {"a2": reqs["a"]})["a2"]
    assert cached_tokens(again) == 0
    assert again.token_ids == run(make_engine(seed=1, enable_prefix_caching=False), reqs)["a"].token_ids


def test_events_come_in_order_and_chain_by_parent_hash() -> None:
    engine = make_engine()
    prompt = BASE[:40]
    assert engine.drain_kv_events() == [] and not engine.kv_events_enabled
    run(engine, {"quiet": (BASE[40:60], greedy(4))})
    assert engine.drain_kv_events() == []  # nobody asked: nothing recorded

    engine.kv_events_enabled = True
    out = run(engine, {"a": (prompt, greedy(30))})["a"]
    events = engine.drain_kv_events()
    assert all(isinstance(e, BlocksStored) and e.block_size == 16 for e in events)
    stored = [e for e in events if isinstance(e, BlocksStored)]
    # The prefill stores two blocks at once; decode then fills block 2 (40 + 29 computed tokens = 4 blocks).
    assert [len(e.blocks) for e in stored] == [2, 1, 1]
    tokens = prompt + out.token_ids
    parent = None
    for i, blk in enumerate(b for e in stored for b in e.blocks):
        assert blk.token_ids == tuple(tokens[16 * i : 16 * (i + 1)])
        assert blk.block_hash == hash_block_tokens(parent, blk.token_ids)
        parent = blk.block_hash
    assert [e.parent_block_hash for e in stored] == [
        None,
        stored[0].blocks[1].block_hash,
        stored[1].blocks[0].block_hash,
    ]

    state: CacheState = {}
    apply(state, engine.kv_cache_snapshot())
    rebuilt: CacheState = {}
    apply(rebuilt, events)
    assert rebuilt.items() <= state.items() and len(state) == len(rebuilt) + 1  # + the "quiet" block
    engine.reset_prefix_cache()
    assert engine.drain_kv_events() == [AllBlocksCleared()]
    engine.kv_events_enabled = False
    engine.reset_prefix_cache()
    assert engine.drain_kv_events() == []


def test_preemption_and_abort_with_caching_stay_exact() -> None:
    shared = BASE[:24]
    reqs: Requests = {f"r{i}": (shared + p, greedy(24)) for i, p in enumerate(prompts([5, 9, 3, 12, 7, 4]))}
    want = run(no_cache(), reqs)
    tight = make_engine(block_size=4, num_blocks=24)
    tight.kv_events_enabled = True
    state: CacheState = {}
    for rid, (p, s) in reqs.items():
        tight.add_request(rid, p, s)
    collected: dict[str, Collected] = {}
    for step in range(6):
        for out in tight.step():
            collected.setdefault(out.request_id, Collected()).add(out)
        if step == 3:
            assert tight.abort("r1")
    drain(tight, collected)
    assert tight.stats().num_preemptions > 0 and tight.stats().prefix_cache_hits > 0
    for rid in reqs:
        if rid != "r1":
            assert collected[rid].token_ids == want[rid].token_ids, rid
    assert collected["r1"].finish_reason == "abort"
    assert collected["r1"].token_ids == want["r1"].token_ids[: len(collected["r1"].token_ids)]
    assert tight.num_used_blocks == 0
    # The event stream, replayed, gives exactly the cache's state.
    apply(state, tight.drain_kv_events())
    snapshot: CacheState = {}
    apply(snapshot, tight.kv_cache_snapshot())
    assert snapshot == state and len(state) == tight.num_cached_blocks
