"""Routed experts of the reference engine's Qwen2-MoE: the config, the MoE forward on both paths, and what a
request that asks for its routing gets (every row the engine's own: computed here, never read from the prefix
cache or migrated KV), checked against the plain reference forward."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from psrl.engine import ConfigError, InvalidRequestError, ModelConfig, Qwen2Model, SamplingOptions
from psrl.engine.config import QWEN2_MOE_DEFAULTS

from .helpers import Collected, drain, greedy, make_engine, model_config, prompts
from .test_model import paged_logits_teacher_forced

MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64, "shared_expert_intermediate_size": 48}


def moe_config(**overrides: object) -> ModelConfig:
    return model_config(**{**MOE, **overrides})


def routing_of(model: Qwen2Model, tokens: list[int]) -> np.ndarray:
    """The reference path's top-k expert ids of every position of `tokens`, [T, num_moe_layers, top_k]."""
    routing: list[torch.Tensor] = []
    model.forward_full(tokens, routing=routing)
    return torch.stack(routing, dim=1).numpy().astype(np.uint8)


def routed(sampling_start: int | None, max_tokens: int = 12, **kwargs: object) -> SamplingOptions:
    return greedy(max_tokens, ignore_eos=True, routed_experts_prompt_start=sampling_start, **kwargs)


def last(collected: Collected) -> np.ndarray:
    assert collected.last is not None and collected.last.finished
    rows = collected.last.routed_experts
    assert rows is not None
    return rows


def test_a_qwen2_moe_config_round_trips_and_takes_hf_defaults() -> None:
    config = moe_config(mlp_only_layers=[1], norm_topk_prob=True)
    hf = config.to_hf_config()
    assert hf["model_type"] == "qwen2_moe" and hf["architectures"] == ["Qwen2MoeForCausalLM"]
    assert hf["mlp_only_layers"] == [1]
    assert ModelConfig.from_hf_config(hf) == config
    assert config.moe_layers == (0,)
    # Keys a qwen2_moe config.json leaves out are HF's defaults, as vLLM reads them.
    bare = ModelConfig.from_hf_config({"model_type": "qwen2_moe", "num_hidden_layers": 2})
    assert bare.num_experts == QWEN2_MOE_DEFAULTS["num_experts"] and bare.moe_layers == (0, 1)
    # A dense config.json is written as before, without MoE keys.
    assert "num_experts" not in model_config().to_hf_config()
    for bad in ({"num_experts_per_tok": 5}, {"moe_intermediate_size": 0}, {"mlp_only_layers": [7]}):
        with pytest.raises(ConfigError):
            moe_config(**bad)


def test_moe_weights_use_qwen2_moe_names_and_round_trip(tmp_path) -> None:
    model = Qwen2Model.random(moe_config(), seed=1)
    names = model.state_dict()
    assert "model.layers.0.mlp.gate.weight" in names and "model.layers.1.mlp.experts.3.down_proj.weight" in names
    assert "model.layers.0.mlp.shared_expert.up_proj.weight" in names
    assert "model.layers.0.mlp.shared_expert_gate.weight" in names
    assert "model.layers.0.mlp.gate_proj.weight" not in names
    model.save_safetensors(tmp_path / "m.safetensors")
    loaded = Qwen2Model.from_safetensors(moe_config(), tmp_path / "m.safetensors")
    seq = prompts([20], seed=2)[0]
    assert torch.equal(model.forward_full(seq), loaded.forward_full(seq))


def test_the_router_spreads_tokens_over_the_experts() -> None:
    """Seeded random routers are lively: a random weight set must exercise every expert, not one."""
    model = Qwen2Model.random(moe_config(), seed=0)
    rows = routing_of(model, prompts([200], seed=3)[0])
    assert rows.shape == (200, 2, 2)
    assert set(np.unique(rows).tolist()) == {0, 1, 2, 3}
    assert (rows[:, :, 0] != rows[:, :, 1]).all()  # top-k picks distinct experts


@pytest.mark.parametrize("block_size", [4, 16])
def test_the_paged_moe_path_matches_the_reference_path(block_size: int) -> None:
    model = Qwen2Model.random(moe_config(), seed=3)
    lengths = [1, 7, 16, 17, 40, 53]
    seqs = prompts(lengths, seed=5)
    paged = paged_logits_teacher_forced(model, seqs, [1, 3, 16, 9, 33, 20], block_size)
    for seq, got in zip(seqs, paged, strict=True):
        torch.testing.assert_close(got, model.forward_full(seq), atol=1e-4, rtol=1e-4)


def test_a_request_gets_the_routing_of_every_position_it_fed() -> None:
    engine = make_engine(model_config=moe_config())
    [prompt] = prompts([21], seed=7)
    engine.add_request("all", prompt, routed(0))
    engine.add_request("tail", prompt, routed(15))
    engine.add_request("none", prompt, greedy(12, ignore_eos=True))
    out = drain(engine)
    tokens = prompt + out["all"].token_ids
    want = routing_of(engine.model, tokens[:-1])  # positions [0, P + R - 1): the last token is never fed
    assert last(out["all"]).shape == (len(prompt) + 12 - 1, 2, 2)
    np.testing.assert_array_equal(last(out["all"]), want)
    np.testing.assert_array_equal(last(out["tail"]), want[15:])
    assert out["none"].last is not None and out["none"].last.routed_experts is None
    assert out["all"].token_ids == out["none"].token_ids  # asking changes nothing else


def test_only_the_finished_output_carries_the_rows() -> None:
    engine = make_engine(model_config=moe_config())
    engine.add_request("r", prompts([9], seed=8)[0], routed(0, max_tokens=4))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert [o.routed_experts is not None for o in outputs] == [False, False, False, True]


def test_positions_to_report_are_computed_even_when_the_prefix_cache_holds_them() -> None:
    engine = make_engine(model_config=moe_config())
    [prompt] = prompts([50], seed=9)
    engine.add_request("warm", prompt, greedy(2))
    drain(engine)
    engine.add_request("all", prompt, routed(0, max_tokens=3))
    engine.add_request("tail", prompt, routed(40, max_tokens=3))
    out = drain(engine)
    want = routing_of(engine.model, prompt + out["all"].token_ids[:-1])
    np.testing.assert_array_equal(last(out["all"]), want)
    np.testing.assert_array_equal(last(out["tail"]), want[40:])
    assert out["all"].last.num_cached_tokens == 0  # type: ignore[union-attr]
    assert out["tail"].last.num_cached_tokens == 32  # type: ignore[union-attr]  # the blocks before 40: cached


def test_an_aborted_request_reports_the_positions_fed_so_far() -> None:
    engine = make_engine(model_config=moe_config())
    [prompt] = prompts([12], seed=10)
    engine.add_request("r", prompt, routed(2, max_tokens=100))
    got: list[int] = []
    for _ in range(5):
        for o in engine.step():
            got += o.new_token_ids
    assert engine.abort("r")
    [aborted] = engine.step()
    assert aborted.finish_reason == "abort" and aborted.routed_experts is not None
    np.testing.assert_array_equal(aborted.routed_experts, routing_of(engine.model, (prompt + got)[:-1])[2:])


def test_a_looped_back_request_with_migrated_kv_computes_the_positions_it_must_report() -> None:
    """A sync abort pins the KV; the request comes back asking routing from inside the pinned part: the pinned
    blocks before that position are used, the rest is computed again, and the rows are exact."""
    engine = make_engine(model_config=moe_config())
    engine.kv_pin_ttl_s = 30.0
    [prompt] = prompts([40], seed=11)
    engine.add_request("r", prompt, greedy(100, ignore_eos=True))
    got: list[int] = []
    for _ in range(6):
        for o in engine.step():
            got += o.new_token_ids
    engine.abort_all_for_sync()
    engine.step()
    tokens = prompt + got
    kv = engine.adopt_pin("r", tokens, len(tokens) - 1)
    assert kv is not None and kv.num_tokens == len(tokens) - 1
    engine.add_request("r-1", tokens, routed(20, max_tokens=4), preloaded=kv)
    out = drain(engine)["r-1"]
    assert out.last is not None and out.last.num_cached_tokens == 16  # one whole block before position 20
    np.testing.assert_array_equal(last(out), routing_of(engine.model, (tokens + out.token_ids)[:-1])[20:])
    assert engine.num_used_blocks == 0  # the blocks it did not use were given back


def test_routing_does_not_depend_on_what_else_is_batched() -> None:
    config = moe_config()
    ps = prompts([30, 5, 64, 17], seed=12)
    alone = []
    for i, p in enumerate(ps):
        engine = make_engine(model_config=config)
        engine.add_request(str(i), p, routed(0, max_tokens=10))
        alone.append(drain(engine)[str(i)])
    engine = make_engine(model_config=config)
    for i, p in enumerate(ps):
        engine.add_request(str(i), p, routed(0, max_tokens=10))
    batched = drain(engine)
    for i, one in enumerate(alone):
        assert batched[str(i)].token_ids == one.token_ids
        np.testing.assert_array_equal(last(batched[str(i)]), last(one))


def test_a_start_past_the_prompt_is_refused_and_a_dense_model_records_nothing() -> None:
    engine = make_engine(model_config=moe_config())
    with pytest.raises(InvalidRequestError, match="routed_experts_prompt_start"):
        engine.add_request("r", [1, 2, 3], routed(4))
    engine.add_request("edge", [1, 2, 3], routed(3, max_tokens=2))  # the whole prompt skipped: output rows only
    assert last(drain(engine)["edge"]).shape == (1, 2, 2)
    dense = make_engine()
    dense.add_request("d", [1, 2, 3], routed(0, max_tokens=2))  # vLLM ignores it without MoE layers too
    out = drain(dense)["d"]
    assert out.last is not None and out.last.routed_experts is None
    with pytest.raises(ValueError, match="routed_experts_prompt_start"):
        SamplingOptions(routed_experts_prompt_start=-1).validate()
