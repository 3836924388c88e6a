"""The paged forward against the plain causal reference, the config round trip and weight files."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from psrl.engine import (
    BlockPool,
    CacheConfig,
    ConfigError,
    ModelConfig,
    PagedKVCache,
    Qwen2Model,
    SamplingOptions,
    WeightLoadError,
)
from psrl.engine.batch import build_paged_batch
from psrl.engine.kv_cache import blocks_for_tokens
from psrl.engine.request import Request
from psrl.engine.scheduler import ScheduledChunk

from .helpers import make_engine, model_config, prompts, run


def paged_logits_teacher_forced(
    model: Qwen2Model, sequences: list[list[int]], prefill_lens: list[int], block_size: int
) -> list[torch.Tensor]:
    """Prefill each sequence's first tokens, then feed the rest one token per step, all sequences batched.

    Returns per sequence the logits at every position, taken from the paged path.
    """
    cache = PagedKVCache(model.config, CacheConfig(block_size=block_size, num_blocks=64))
    alloc = BlockPool(64, block_size, enable_caching=False)
    reqs = [Request(f"s{i}", seq, SamplingOptions(), 10_000) for i, seq in enumerate(sequences)]
    logits: list[list[torch.Tensor]] = [[] for _ in sequences]
    first = True
    while True:
        chunks = []
        for req, seq, p in zip(reqs, sequences, prefill_lens):
            start = req.num_computed_tokens
            if start == len(seq):
                continue
            n = p if first else 1
            need = blocks_for_tokens(start + n, block_size) - len(req.block_ids)
            req.block_ids.extend(alloc.allocate(need))
            chunks.append(ScheduledChunk(req, start, n))
        if not chunks:
            break
        first = False
        batch = build_paged_batch(chunks, block_size, model.config.num_queries_per_kv, model.device)
        batch.logits_index = torch.arange(batch.input_ids.shape[0])  # every row, not just the last
        with torch.inference_mode():
            out = model.forward_paged(batch, cache.layers)
        row = 0
        for chunk in chunks:
            idx = reqs.index(chunk.request)
            logits[idx].append(out[row : row + chunk.num_tokens])
            row += chunk.num_tokens
            chunk.request.num_computed_tokens += chunk.num_tokens
    return [torch.cat(parts) for parts in logits]


@pytest.mark.parametrize("block_size", [4, 16])
def test_paged_path_matches_full_attention_for_batched_sequences(block_size: int) -> None:
    model = Qwen2Model.random(model_config(), seed=3)
    lengths = [1, 7, 16, 17, 40, 53]
    seqs = prompts(lengths, seed=5)
    prefill = [1, 3, 16, 9, 33, 20]
    paged = paged_logits_teacher_forced(model, seqs, prefill, block_size)
    for seq, got in zip(seqs, paged):
        ref = model.forward_full(seq)
        assert got.shape == ref.shape
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


def test_full_path_of_a_prefix_is_a_prefix() -> None:
    model = Qwen2Model.random(model_config(), seed=0)
    (seq,) = prompts([30])
    torch.testing.assert_close(model.forward_full(seq[:12]), model.forward_full(seq)[:12], atol=1e-5, rtol=0)


def test_random_weights_are_seeded_and_greedy_is_not_degenerate() -> None:
    a = Qwen2Model.random(model_config(), seed=7).state_dict()
    b = Qwen2Model.random(model_config(), seed=7).state_dict()
    c = Qwen2Model.random(model_config(), seed=8).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])

    engine = make_engine(seed=0)
    out = run(engine, {"r": (prompts([5])[0], SamplingOptions(temperature=0.0, max_tokens=50))})
    assert len(out["r"].token_ids) == 50
    assert len(set(out["r"].token_ids)) >= 10


def test_safetensors_round_trip_gives_identical_logits(tmp_path) -> None:
    model = Qwen2Model.random(model_config(), seed=11)
    path = tmp_path / "model.safetensors"
    model.save_safetensors(path)
    loaded = Qwen2Model.from_safetensors(model_config(), path)
    (seq,) = prompts([20])
    assert torch.equal(model.forward_full(seq), loaded.forward_full(seq))


def test_tied_embeddings_round_trip(tmp_path) -> None:
    cfg = model_config(tie_word_embeddings=True)
    model = Qwen2Model.random(cfg, seed=1)
    assert "lm_head.weight" not in model.state_dict()
    model.save_safetensors(tmp_path / "m.safetensors")
    loaded = Qwen2Model.from_safetensors(cfg, tmp_path / "m.safetensors")
    (seq,) = prompts([9])
    assert torch.equal(model.forward_full(seq), loaded.forward_full(seq))


def test_bad_weights_are_refused_with_names() -> None:
    cfg = model_config()
    sd = Qwen2Model.random(cfg, seed=0).state_dict()
    missing = {k: v for k, v in sd.items() if k != "model.norm.weight"}
    with pytest.raises(WeightLoadError, match=r"missing tensors: \['model.norm.weight'\]"):
        Qwen2Model(cfg, missing)
    with pytest.raises(WeightLoadError, match=r"unexpected tensors.*model\.extra"):
        Qwen2Model(cfg, {**sd, "model.extra": torch.zeros(1)})
    bad = dict(sd)
    bad["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(3)
    with pytest.raises(WeightLoadError, match=r"q_proj.bias: expected \(128,\), got \(3,\)"):
        Qwen2Model(cfg, bad)
    with pytest.raises(WeightLoadError, match="does not exist"):
        Qwen2Model.from_safetensors(cfg, "/nonexistent/model.safetensors")


def test_hf_config_round_trip_and_validation() -> None:
    cfg = model_config(num_hidden_layers=3, rope_theta=1e6)
    hf = cfg.to_hf_config(bos_token_id=1, eos_token_id=[2, 3])
    assert hf["architectures"] == ["Qwen2ForCausalLM"]
    assert hf["model_type"] == "qwen2"
    assert hf["eos_token_id"] == [2, 3] and hf["bos_token_id"] == 1
    assert ModelConfig.from_hf_config(hf) == cfg
    # Real Qwen2 configs omit head_dim; it is hidden_size / num_attention_heads.
    hf_no_head_dim = {k: v for k, v in hf.items() if k != "head_dim"}
    assert ModelConfig.from_hf_config(hf_no_head_dim).head_dim == 32

    with pytest.raises(ConfigError, match="head_dim"):
        model_config(head_dim=16)
    with pytest.raises(ConfigError, match="multiple of num_key_value_heads"):
        model_config(num_attention_heads=4, num_key_value_heads=3)
    with pytest.raises(ConfigError, match="torch_dtype"):
        model_config(torch_dtype="int8")
    with pytest.raises(ValueError, match="vocab_size"):
        model_config(vocab_size=0)
    with pytest.raises(ValueError, match="model_type"):
        ModelConfig.from_hf_config({**hf, "model_type": "llama"})
    with pytest.raises(ValueError):
        dataclasses.replace(cfg, rms_norm_eps=0.0)
