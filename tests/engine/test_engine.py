"""Engine behaviour: batching invariance, seeding, log-probs, stops, abort, preemption, validation, weights."""

from __future__ import annotations

import pytest
import torch

from psrl.engine import (
    DuplicateRequestError,
    EmptyPromptError,
    EngineStepError,
    InvalidSamplingError,
    KVCacheTooSmallError,
    MaxModelLenExceededError,
    SamplingOptions,
    TokenOutOfRangeError,
    WeightLoadError,
)

from .helpers import Collected, drain, greedy, make_engine, model_config, prompts, run

LENGTHS = [3, 17, 1, 33, 8, 16, 50, 5]


def greedy_requests(max_tokens: int = 12, **kwargs: object) -> dict[str, tuple[list[int], SamplingOptions]]:
    return {f"r{i}": (p, greedy(max_tokens, **kwargs)) for i, p in enumerate(prompts(LENGTHS))}


def test_greedy_is_the_same_alone_or_batched_and_across_engines() -> None:
    reqs = greedy_requests(logprobs=0)
    batched = run(make_engine(), reqs)
    again = run(make_engine(), reqs)
    for rid, req in reqs.items():
        alone = run(make_engine(), {rid: req})[rid]
        assert batched[rid].token_ids == alone.token_ids == again[rid].token_ids
        assert batched[rid].logprobs == alone.logprobs  # bit for bit: rows do not depend on the batch
        assert batched[rid].finish_reason == "length"


def test_greedy_tokens_and_logprobs_match_the_full_forward() -> None:
    engine = make_engine()
    reqs = {k: (p, greedy(10, logprobs=3)) for k, (p, _) in list(greedy_requests().items())[:4]}
    out = run(engine, reqs)
    for rid, (prompt, _) in reqs.items():
        got = out[rid]
        logits = engine.model.forward_full(prompt + got.token_ids)
        lp = torch.log_softmax(logits, -1)
        rows = range(len(prompt) - 1, len(prompt) - 1 + len(got.token_ids))
        assert got.token_ids == [int(logits[r].argmax()) for r in rows]
        ref = [lp[r, t].item() for r, t in zip(rows, got.token_ids)]
        assert got.logprobs == pytest.approx(ref, abs=1e-4)
        assert all(v <= 0 for v in got.logprobs)
        for token, top in zip(got.token_ids, got.top_logprobs):
            assert len(top) == 3
            assert [v for _, v in top] == sorted((v for _, v in top), reverse=True)
            assert top[0][0] == token


def test_seeded_sampling_is_reproducible_and_batch_independent() -> None:
    (p,) = prompts([6], seed=9)
    seeded = SamplingOptions(temperature=1.0, top_p=0.95, max_tokens=20, seed=123)
    alone = run(make_engine(seed=0), {"s": (p, seeded)})["s"].token_ids
    others = {f"o{i}": (q, SamplingOptions(max_tokens=20)) for i, q in enumerate(prompts([4, 9, 2]))}
    # The unseeded neighbours draw from the engine's generator; the seeded request must not notice.
    batched = run(make_engine(seed=0), {**others, "s": (p, seeded)})["s"].token_ids
    assert alone == batched
    other_seed = run(make_engine(), {"s": (p, SamplingOptions(temperature=1.0, max_tokens=20, seed=124))})
    assert other_seed["s"].token_ids != alone


def test_unseeded_sampling_follows_the_engine_seed() -> None:
    reqs = {f"r{i}": (p, SamplingOptions(max_tokens=10)) for i, p in enumerate(prompts([4, 7]))}
    a = run(make_engine(seed=1), reqs)
    b = run(make_engine(seed=1), reqs)
    c = run(make_engine(seed=2), reqs)
    assert {k: v.token_ids for k, v in a.items()} == {k: v.token_ids for k, v in b.items()}
    assert {k: v.token_ids for k, v in a.items()} != {k: v.token_ids for k, v in c.items()}


def test_top_k_one_equals_greedy() -> None:
    (p,) = prompts([10])
    g = run(make_engine(), {"r": (p, greedy(15))})["r"].token_ids
    k1 = run(make_engine(), {"r": (p, SamplingOptions(temperature=0.9, top_k=1, max_tokens=15))})["r"]
    assert k1.token_ids == g


def _reference_tokens(prompt: list[int], n: int = 20) -> list[int]:
    return run(make_engine(), {"r": (prompt, greedy(n))})["r"].token_ids


def test_stop_token_ids_end_with_the_token_included() -> None:
    (p,) = prompts([7])
    ref = _reference_tokens(p)
    stop = ref[5]
    first = ref.index(stop)
    out = run(make_engine(), {"r": (p, greedy(20, stop_token_ids=(stop,)))})["r"]
    assert out.token_ids == ref[: first + 1]
    assert out.finish_reason == "stop" and out.matched_stop_token_id == stop


def test_eos_stops_unless_ignored() -> None:
    (p,) = prompts([7])
    ref = _reference_tokens(p)
    eos = ref[4]
    first = ref.index(eos)
    out = run(make_engine(eos_token_ids=(eos,)), {"r": (p, greedy(20))})["r"]
    assert out.token_ids == ref[: first + 1]
    assert out.finish_reason == "stop" and out.matched_stop_token_id is None
    ignored = run(make_engine(eos_token_ids=(eos,)), {"r": (p, greedy(20, ignore_eos=True))})["r"]
    assert ignored.token_ids == ref and ignored.finish_reason == "length"


def test_the_models_other_eos_ids_are_reported_like_stop_tokens() -> None:
    # vLLM stops on the tokenizer's EOS unreported and turns the model's other EOS ids into stop token ids.
    (p,) = prompts([7])
    ref = _reference_tokens(p)
    primary, other = 1000, ref[4]  # an EOS the model never samples, then one it does
    out = run(make_engine(eos_token_ids=(primary, other)), {"r": (p, greedy(20))})["r"]
    assert out.token_ids == ref[: ref.index(other) + 1]
    assert out.finish_reason == "stop" and out.matched_stop_token_id == other
    ignored = run(make_engine(eos_token_ids=(primary, other)), {"r": (p, greedy(20, ignore_eos=True))})["r"]
    assert ignored.token_ids == ref and ignored.finish_reason == "length"


def test_max_tokens_and_max_model_len_finish_with_length() -> None:
    engine = make_engine()
    out = run(engine, {"r": (prompts([4])[0], greedy(7))})["r"]
    assert len(out.token_ids) == 7 and out.finish_reason == "length"
    assert out.num_outputs == 7 and out.last is not None and out.last.num_output_tokens == 7

    short = make_engine(model_config=model_config(max_position_embeddings=40))
    out = run(short, {"r": (prompts([30])[0], SamplingOptions(temperature=0.0, max_tokens=None))})["r"]
    assert len(out.token_ids) == 10 and out.finish_reason == "length"
    assert out.last is not None and out.last.num_prompt_tokens == 30 and out.last.num_cached_tokens == 0
    # Like vLLM, a max_tokens past max_model_len is no error: the request ends at the model length.
    out = run(short, {"past": (prompts([30])[0], greedy(100))})["past"]
    assert len(out.token_ids) == 10 and out.finish_reason == "length"


def test_abort_mid_run_emits_abort_and_frees_blocks() -> None:
    engine = make_engine()
    for rid, (p, s) in greedy_requests(max_tokens=30).items():
        engine.add_request(rid, p, s)
    collected: dict[str, Collected] = {}
    for _ in range(4):
        for out in engine.step():
            collected.setdefault(out.request_id, Collected()).add(out)
    before = len(collected["r6"].token_ids)
    used = engine.num_used_blocks
    held = len(engine.get_block_ids("r6") or [])
    assert held > 0
    assert engine.abort("r6") is True
    assert engine.num_used_blocks == used - held
    assert engine.abort("r6") is False and engine.abort("nope") is False
    outs = engine.step()
    aborted = [o for o in outs if o.request_id == "r6"]
    assert len(aborted) == 1 and aborted[0].finish_reason == "abort" and aborted[0].new_token_ids == []
    assert aborted[0].num_output_tokens == before
    drain(engine, collected)  # Collected.add asserts nothing arrives after the final output
    assert len(collected["r6"].token_ids) == before
    assert engine.num_used_blocks == 0 and engine.num_running == 0 and engine.num_waiting == 0


def test_abort_of_a_waiting_request_and_id_reuse_after_the_notice() -> None:
    engine = make_engine(max_num_seqs=1)
    p1, p2 = prompts([5, 5])
    engine.add_request("a", p1, greedy(5))
    engine.add_request("b", p2, greedy(5))
    engine.step()
    assert engine.num_waiting == 1
    assert engine.abort("b")
    with pytest.raises(DuplicateRequestError):
        engine.add_request("b", p2, greedy(5))  # its abort notice has not been returned yet
    out = drain(engine)
    assert out["b"].finish_reason == "abort" and out["b"].token_ids == []
    engine.add_request("b", p2, greedy(5))
    assert drain(engine)["b"].finish_reason == "length"


def test_preemption_under_a_tiny_cache_keeps_greedy_tokens() -> None:
    reqs = {f"r{i}": (p, greedy(24)) for i, p in enumerate(prompts([5, 9, 3, 12, 7, 4]))}
    free = run(make_engine(), reqs)
    tight = make_engine(block_size=4, num_blocks=12)
    squeezed = run(tight, reqs)
    assert tight.stats().num_preemptions > 0
    for rid in reqs:
        assert squeezed[rid].token_ids == free[rid].token_ids
        assert squeezed[rid].finish_reason == "length"
    assert tight.num_used_blocks == 0


def test_chunked_prefill_gives_the_same_tokens() -> None:
    reqs = {f"r{i}": (p, greedy(10)) for i, p in enumerate(prompts([45, 3, 30]))}
    free = run(make_engine(), reqs)
    chunked = run(make_engine(max_num_batched_tokens=8), reqs)
    assert {k: v.token_ids for k, v in chunked.items()} == {k: v.token_ids for k, v in free.items()}


def test_continuous_batching_serves_many_requests_per_step() -> None:
    engine = make_engine(max_num_seqs=4)
    for rid, (p, s) in greedy_requests(max_tokens=5).items():
        engine.add_request(rid, p, s)
    first = engine.step()
    assert len(first) == 4 and engine.num_running == 4 and engine.num_waiting == 4
    assert 0 < engine.kv_cache_usage < 1
    stats = engine.stats()
    assert stats.num_total_blocks == 256 and stats.kv_capacity_tokens == 256 * 16
    assert stats.num_used_blocks == engine.num_used_blocks


def test_validation_errors() -> None:
    engine = make_engine(model_config=model_config(max_position_embeddings=64), block_size=4, num_blocks=8)
    with pytest.raises(EmptyPromptError):
        engine.add_request("a", [], greedy())
    with pytest.raises(TokenOutOfRangeError, match="256"):
        engine.add_request("a", [1, 256], greedy())
    with pytest.raises(TokenOutOfRangeError):
        engine.add_request("a", [-1], greedy())
    with pytest.raises(MaxModelLenExceededError, match="maximum model length of 64"):
        engine.add_request("a", [1] * 64, SamplingOptions(max_tokens=1))
    with pytest.raises(MaxModelLenExceededError):
        engine.add_request("a", [1] * 64, SamplingOptions(max_tokens=None))
    with pytest.raises(KVCacheTooSmallError, match="32"):
        engine.add_request("a", [1] * 20, SamplingOptions(max_tokens=20))
    with pytest.raises(KVCacheTooSmallError):
        engine.add_request("a", [1] * 33, SamplingOptions(max_tokens=None))
    with pytest.raises(InvalidSamplingError):
        engine.add_request("a", [1], SamplingOptions(top_p=0))
    # vLLM's limits: temperature, log-probs per token, stop ids in the vocabulary; n > 1 is AsyncEngine's.
    bad = {
        "temperature": SamplingOptions(temperature=2.5),
        "max allowed: 20": SamplingOptions(logprobs=21),
        "out-of-vocab": SamplingOptions(stop_token_ids=(5, 256)),
        "AsyncEngine": SamplingOptions(n=2),
        "greedy": SamplingOptions(temperature=0.0, n=2),
        "n must be": SamplingOptions(n=0),
        "engine's tokenizer": SamplingOptions(stop=("x",)),  # this engine was built without one
    }
    for match, sampling in bad.items():
        with pytest.raises(InvalidSamplingError, match=match):
            engine.add_request("a", [1], sampling)
    engine.add_request("a", [1, 2], greedy())
    with pytest.raises(DuplicateRequestError):
        engine.add_request("a", [1, 2], greedy())
    for err in (EmptyPromptError, TokenOutOfRangeError, MaxModelLenExceededError, KVCacheTooSmallError):
        assert issubclass(err, ValueError)
    # max_tokens=None on a cache smaller than max_model_len stops where the cache is full.
    out = run(engine, {"b": ([3] * 30, SamplingOptions(temperature=0.0, max_tokens=None))})
    assert len(out["b"].token_ids) == 3 and out["b"].finish_reason == "length"


def test_weight_swap_changes_outputs_and_swapping_back_restores_them(tmp_path) -> None:
    engine = make_engine(seed=0)
    reqs = dict(list(greedy_requests(max_tokens=10).items())[:3])

    def tokens(tag: str) -> dict[str, list[int]]:
        out = run(engine, {f"{k}-{tag}": v for k, v in reqs.items()})
        return {k: out[f"{k}-{tag}"].token_ids for k in reqs}

    original = tokens("v0")
    assert engine.weight_version == 0
    engine.model.save_safetensors(tmp_path / "v0.safetensors")

    engine.load_weights(seed=1, version=2)
    assert engine.weight_version == 2
    swapped = tokens("v2")
    assert swapped != original

    engine.load_weights(path=tmp_path / "v0.safetensors", version=3)
    assert tokens("v3") == original

    engine.load_weights(state_dict=make_engine(seed=1).model.state_dict(), version=4)
    assert tokens("v4") == swapped

    with pytest.raises(WeightLoadError):
        engine.load_weights(state_dict={}, version=5)
    with pytest.raises(ValueError, match="exactly one"):
        engine.load_weights(seed=1, path="x", version=5)
    assert engine.weight_version == 4


def test_engine_built_from_a_weights_file_matches_the_seeded_one(tmp_path) -> None:
    make_engine(seed=3).model.save_safetensors(tmp_path / "m.safetensors")
    (p,) = prompts([11])
    a = run(make_engine(seed=3), {"r": (p, greedy(8))})["r"].token_ids
    b = run(make_engine(seed=99, weights_path=tmp_path / "m.safetensors"), {"r": (p, greedy(8))})["r"].token_ids
    assert a == b


def test_a_failing_step_fails_its_requests_and_the_engine_lives_on(monkeypatch) -> None:
    engine = make_engine()
    p1, p2 = prompts([4, 6])
    engine.add_request("a", p1, greedy(5))
    model = engine.model

    def boom(*args: object, **kwargs: object) -> None:
        raise RuntimeError("kaboom")

    monkeypatch.setattr(model, "forward_paged", boom)
    with pytest.raises(EngineStepError) as err:
        engine.step()
    assert err.value.request_ids == ["a"]
    assert engine.num_used_blocks == 0 and not engine.has_unfinished_requests()
    monkeypatch.undo()
    engine.add_request("b", p2, greedy(5))
    assert drain(engine)["b"].finish_reason == "length"
